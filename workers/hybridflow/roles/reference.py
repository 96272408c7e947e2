"""The reference policy: a frozen, sharded copy of the initial actor that scores responses for the KL term."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridflow.controller.batch import Batch
from hybridflow.controller.protocol import Dispatch, register
from hybridflow.controller.worker_group import WorkerContext
from hybridflow.engines.fsdp import FSDPEngine, response_logits, token_log_probs
from hybridflow.roles.common import load_causal_lm
from hybridflow.models.builders import local_model_dir
from hybridflow.spec import JobSpec


class ReferenceWorker:
    def __init__(self, ctx: WorkerContext, spec: dict[str, Any], model_dir: str) -> None:
        self.spec = JobSpec.model_validate(spec)
        s = self.spec
        model = load_causal_lm(local_model_dir(model_dir, s.models.actor, s.trainer.seed), s.models.actor.dtype)
        self.engine = FSDPEngine(model, lr=0.0, grad_clip=1.0, device=ctx.device, trainable=False)

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        temp = self.spec.rollout.temperature

        def fn(model: nn.Module, mb: Batch) -> torch.Tensor:
            return token_log_probs(response_logits(model, mb, temp), mb["responses"])

        outs = self.engine.forward_micro(batch, self.spec.training.micro_batch_size, fn)
        return Batch({"ref_log_probs": torch.cat(outs).cpu()})
