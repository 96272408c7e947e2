"""The reference policy: a frozen, sharded copy of the initial actor that scores responses for the KL term."""
from __future__ import annotations

import torch
from torch import nn

from hybridflow.controller.batch import Batch
from hybridflow.controller.protocol import Dispatch, register
from hybridflow.controller.worker_group import WorkerContext
from hybridflow.engines.fsdp import FSDPEngine, response_logits, token_log_probs
from hybridflow.engines.precision import compute_dtype
from hybridflow.roles.common import load_causal_lm
from hybridflow.models.builders import local_model_dir
from hybridflow.roles.config import ScoringConfig


class ReferenceWorker:
    def __init__(self, ctx: WorkerContext, config: ScoringConfig, model_dir: str) -> None:
        self.config = config
        model = load_causal_lm(local_model_dir(model_dir, config.model, config.seed), config.model.dtype)
        self.engine = FSDPEngine(model, lr=0.0, grad_clip=1.0, device=ctx.device, trainable=False,
                                 compute_dtype=compute_dtype(config.compute_dtype, ctx.device),
                                 dynamic_batch_size=config.dynamic_batch_size)

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        temp = self.config.temperature

        def fn(model: nn.Module, mb: Batch) -> torch.Tensor:
            return token_log_probs(response_logits(model, mb, temp), mb["responses"])

        return Batch({"ref_log_probs": self.engine.forward_micro(batch, self.config.micro_batch_size, fn).cpu()})
