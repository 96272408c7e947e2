"""A tiny HF model, a ragged batch for it (prompts of 1-7 tokens, responses of 1-6, left and right padding) and a
one-rank FSDP2 actor: what the engine tests share (tests/engines/test_throughput.py, tests/engines/test_corrections.py,
tests/engines/test_vllm_gpu_paths.py, and the ranks test_throughput starts). The `tiny_dir` fixture (tests/engines/conftest.py)
builds the model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hybridflow.api import TinyModel, parse_job
from hybridflow.data.packing import pack_rollout
from hybridflow.engines.train.fsdp import FSDPEngine, response_logits, token_log_probs
from hybridflow.models.builders import build_tiny
from hybridflow.roles.config import actor_config
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.context import WorkerContext

P, R = 8, 6  # the padded prompt and response lengths
PROMPTS = [[3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17, 18, 19], [20, 21, 22], [23], [24, 25]]
RESPONSES = [[1, 2, 3, 4, 5, 6], [7], [8, 9], [10, 11, 12], [13], [14, 15, 16, 17], [18, 19], [20, 21, 22, 23, 24]]


def build_tiny_model(directory: Path) -> Path:
    """The tiny model (vocabulary 32, 2 layers) written to `directory`, seed 0."""
    return build_tiny(TinyModel(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2), directory, 0)


def ragged_batch() -> Batch:
    """PROMPTS and RESPONSES packed, with advantages from -1 to 1 over the rows (zero on padding)."""
    b = Batch(pack_rollout(PROMPTS, RESPONSES, P, R))
    n = len(b)
    return b.with_columns(advantages=torch.linspace(-1, 1, n)[:, None].expand(n, R).contiguous() * b["response_mask"])


def ragged_batch_with_uids() -> Batch:
    """ragged_batch() with a `uid` per row (each row its own group), as the actor's update takes it."""
    b = ragged_batch()
    b.non_tensors["uid"] = np.arange(len(b))
    return b


def masked_log_probs(engine: FSDPEngine, batch: Batch, micro: int) -> torch.Tensor:
    """The engine's response log-probs in micro-batches of `micro` rows, zero on padding."""
    def fn(model, mb):
        return token_log_probs(response_logits(model, mb, 1.0), mb["responses"])

    return engine.forward_micro(batch, micro, fn) * batch["response_mask"]


def one_rank_actor(model_dir, algorithm: dict, training: dict | None = None):
    """The actor worker (FSDP2, float32, micro-batches of 3, HF rollout lengths P and R) on a one-rank group that the
    caller made (the `one_rank` fixture), with `algorithm` over token-mean loss aggregation; `training` adds to the
    spec's training section."""
    from hybridflow.roles.actor import ActorWorker

    job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                     "spec": {"algorithm": {"lossAgg": "token-mean", **algorithm},
                              "rollout": {"engine": "hf", "maxPromptLength": P, "maxResponseLength": R},
                              "training": {"microBatchSize": 3, "computeDtype": "float32", **(training or {})},
                              "trainer": {"promptsPerStep": 8}}})
    return ActorWorker(WorkerContext(0, 1, 0, "cpu"), actor_config(job.spec), str(model_dir))


def token_mean_policy_loss(engine: FSDPEngine):
    """A loss function for `engine.train_mini_batch`: -advantage x log-prob, the micro-batch's token mean, with its
    value as the statistic `loss`."""
    def fn(model, mb):
        logp, _ = engine.log_probs(model, mb, 1.0)
        mask = mb["response_mask"].to(logp.dtype)
        loss = -(logp * mb["advantages"] * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"loss": loss.item()}
    return fn
