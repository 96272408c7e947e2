"""The megatron kind's factory (registered in hybridflow.api.engines): the engine of `megatron`, or with
spec.training.lora its subclass that trains adapters alone (`megatron_lora`). It lives apart from both because the
subclass imports the engine's module, and sibling modules import each other one way only (the acyclic contract of
pyproject.toml's import-linter)."""
from __future__ import annotations

import logging

from hybridflow.engines.train.base import TrainSettings
from hybridflow.engines.train.megatron import MegatronEngine
from hybridflow.engines.train.megatron_lora import MegatronLoraEngine
from hybridflow.logs import say_once
from hybridflow.single_controller.context import WorkerContext

log = logging.getLogger(__name__)


def build(ctx: WorkerContext, settings: TrainSettings) -> MegatronEngine:
    """A causal LM only (no value heads), computing in its weights' dtype (the spec's rules refuse a narrower
    compute dtype for it)."""
    s = settings
    if s.head != "lm" or s.dtype is None or not s.trainable:
        raise ValueError("the megatron engine trains causal LMs (the actor) in a given dtype")
    args = (s.model_dir, s.dtype, s.tensor_parallel, s.lr, s.grad_clip, ctx.device, s.seed)
    engine = (MegatronEngine(*args, pp=s.pipeline_parallel) if s.lora is None
              else MegatronLoraEngine(s.lora, *args, pp=s.pipeline_parallel))
    engine.dynamic_batch_size = s.dynamic_batch_size
    if s.shared_prompt:
        say_once(log, "shared-prompt packing is off for the megatron engine: its rotary embeddings follow each "
                 "token's place in the sequence, not position ids, so a response after another's slot would see the "
                 "prompt at the wrong distance; rows of a group run unshared")
    return engine
