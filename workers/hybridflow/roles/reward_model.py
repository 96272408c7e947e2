"""An optional reward (or cost) model: a sequence classifier scoring prompt + response with one scalar."""
from __future__ import annotations

import torch
from torch import nn

from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.protocol import Dispatch, register
from hybridflow.single_controller.context import WorkerContext
from hybridflow.engines.train.base import TrainEngine, TrainEngineFactory, TrainSettings
from hybridflow.engines.train.fsdp import sequence_inputs
from hybridflow.models.builders import local_model_dir
from hybridflow.roles.config import ScoringConfig


def last_token_scores(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The score head's output at each row's last real token (the prompt + response end)."""
    out = model(**sequence_inputs(batch), use_cache=False)
    last = batch["attention_mask"].long().cumsum(-1).argmax(-1)
    return out.logits[torch.arange(len(last)), last, 0].float() if out.logits.dim() == 3 else out.logits[:, 0].float()


class RewardModelWorker:
    def __init__(self, ctx: WorkerContext, config: ScoringConfig, model_dir: str) -> None:
        self.config = config
        build: TrainEngineFactory = config.train_engine.load()
        self.engine: TrainEngine = build(ctx, TrainSettings(  # held in the dtype its spec names (models.*.dtype)
            local_model_dir(model_dir, config.model, config.seed), config.model.dtype, head="value", trainable=False,
            compute_dtype=config.compute_dtype, dynamic_batch_size=config.dynamic_batch_size, seed=config.seed))

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_rm_scores(self, batch: Batch) -> Batch:
        scores = self.engine.forward_micro(batch, self.config.micro_batch_size, last_token_scores)
        return Batch({"rm_scores": scores.cpu()})
