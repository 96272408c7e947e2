"""The reference policy: a frozen, sharded copy of the initial actor that scores responses for the KL term."""
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
        temp = self.config.temperature

        def fn(model: nn.Module, mb: Batch) -> torch.Tensor:
            return self.engine.log_probs(model, mb, temp)[0]

        return Batch({"ref_log_probs": self.engine.forward_micro(batch, self.config.micro_batch_size, fn).cpu()})
