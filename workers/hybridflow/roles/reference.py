"""The reference policy: a frozen, sharded copy of the initial actor that scores responses for the KL term. A LoRA
actor (spec.training.lora) is its own reference, its adapters switched off (roles.actor), and no ReferenceWorker
runs."""
from __future__ import annotations

import torch
from torch import nn

from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.protocol import Dispatch, register
from hybridflow.single_controller.context import WorkerContext
from hybridflow.engines.train.base import TrainEngine, TrainEngineFactory, TrainSettings
from hybridflow.models.builders import local_model_dir
from hybridflow.roles.config import ScoringConfig


class ReferenceWorker:
    def __init__(self, ctx: WorkerContext, config: ScoringConfig, model_dir: str) -> None:
        self.config = config
        build: TrainEngineFactory = config.train_engine.load()
        self.engine: TrainEngine = build(ctx, TrainSettings(
            local_model_dir(model_dir, config.model, config.seed), config.model.dtype, trainable=False,
            compute_dtype=config.compute_dtype, dynamic_batch_size=config.dynamic_batch_size,
            shared_prompt=config.shared_prompt, seed=config.seed))

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return reference_log_probs(self.engine, batch, self.config.micro_batch_size, self.config.temperature)


def reference_log_probs(engine: TrainEngine, batch: Batch, micro_batch_size: int, temperature: float) -> Batch:
    """The stage's output, `ref_log_probs`, from whichever engine holds the reference policy (this worker's, or a
    LoRA actor's with its adapters off)."""
    def fn(model: nn.Module, mb: Batch) -> torch.Tensor:
        return engine.log_probs(model, mb, temperature)[0]

    return Batch({"ref_log_probs": engine.forward_micro(batch, micro_batch_size, fn).cpu()})
