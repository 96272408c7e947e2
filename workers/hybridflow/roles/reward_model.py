"""An optional reward (or cost) model: a sequence classifier scoring prompt + response with one scalar."""
from __future__ import annotations

import torch
from torch import nn

from hybridflow.controller.batch import Batch
from hybridflow.controller.protocol import Dispatch, register
from hybridflow.controller.worker_group import WorkerContext
from hybridflow.engines.fsdp import FSDPEngine, sequence_inputs
from hybridflow.engines.precision import compute_dtype
from hybridflow.models.builders import local_model_dir
from hybridflow.roles.config import ScoringConfig


def last_token_scores(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The score head's output at each row's last real token (the prompt + response end)."""
    out = model(**sequence_inputs(batch), use_cache=False)
    last = batch["attention_mask"].long().cumsum(-1).argmax(-1)
    return out.logits[torch.arange(len(last)), last, 0].float() if out.logits.dim() == 3 else out.logits[:, 0].float()


class RewardModelWorker:
    def __init__(self, ctx: WorkerContext, config: ScoringConfig, model_dir: str) -> None:
        from transformers import AutoModelForTokenClassification

        self.config = config
        model = AutoModelForTokenClassification.from_pretrained(
            local_model_dir(model_dir, config.model, config.seed), num_labels=1)
        self.engine = FSDPEngine(model, lr=0.0, grad_clip=1.0, device=ctx.device, trainable=False,
                                 compute_dtype=compute_dtype(config.compute_dtype, ctx.device),
                                 dynamic_batch_size=config.dynamic_batch_size)

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_rm_scores(self, batch: Batch) -> Batch:
        scores = self.engine.forward_micro(batch, self.config.micro_batch_size, last_token_scores)
        return Batch({"rm_scores": scores.cpu()})
