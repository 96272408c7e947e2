"""The training loop every engine shares: micro-batch accumulation, one optimizer step per mini-batch, PPO epochs.

Engines differ only in how gradients are reduced and their norm computed (FSDP: by torch; megatron: over the
tensor- and data-parallel groups), and in how log-probabilities come out of the model (whole or vocab-parallel).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from hybridflow.controller.batch import Batch
from hybridflow.data.packing import merge_rows, micro_batches
from hybridflow.spec import Training

LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, dict[str, float]]]


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, betas, weight decay...): what a resumed job keeps from its own spec when
    it loads a checkpoint's optimizer state (saved under settings that a new job may have changed)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def restore_optimizer_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)


class TrainEngine:
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    dynamic_batch_size: bool = False  # token-budget micro-batches cut to their own lengths (data/packing.py)

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's part of the model and optimizer state for torch.distributed.checkpoint, as (D)Tensors under
        names that do not depend on the layout (HF parameter names, whole-tensor shapes): each rank writes its own
        shards, and a load re-shards them to another world size or tensor-parallel size. The same call on a freshly
        built engine gives the template that a load fills in place."""
        raise NotImplementedError

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Take `state` (a `checkpoint_state()` that a load filled in) as the engine's model and optimizer state."""
        raise NotImplementedError

    def clip_grad_norm(self) -> torch.Tensor:
        """Reduce gradients as the layout needs, clip them to `grad_clip`, return the global norm before clipping."""
        raise NotImplementedError

    @torch.no_grad()
    def forward_micro(self, batch: Batch, micro_batch_size: int, fn: Callable[[nn.Module, Batch], Any]) -> Any:
        """`fn` over micro-batches; its outputs (a tensor or a tuple of tensors, per row or per response token) come
        back as one, in the batch's row order and at its full response width."""
        self.module.eval()
        rows, outs = [], []
        for idx, mb in micro_batches(batch, micro_batch_size, self.dynamic_batch_size):
            rows.append(idx)
            outs.append(fn(self.module, mb.to(self.device)))
        return merge_rows(outs, rows, batch["responses"].shape[1] if "responses" in batch else None)

    def train_mini_batch(self, batch: Batch, micro_batch_size: int, loss_fn: LossFn,
                         per: str = "rows") -> dict[str, float]:
        """One optimizer step over `batch`, accumulating micro-batches weighted by their share of what the loss
        averages over (`per`: "rows", or "tokens" for a token mean), so the step is the same however the rows were
        grouped (length-sorted micro-batches hold few long rows or many short ones)."""
        assert self.optimizer is not None, "this engine was built frozen"
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {}
        size = (lambda b: float(b["response_mask"].sum())) if per == "tokens" else len  # noqa: E731
        total = size(batch)
        for _, mb in micro_batches(batch, micro_batch_size, self.dynamic_batch_size):
            share = size(mb) / total if total else 0.0
            loss, mstats = loss_fn(self.module, mb.to(self.device))
            (loss * share).backward()
            for k, v in mstats.items():
                stats[k] = stats.get(k, 0.0) + float(v) * share
        norm = self.clip_grad_norm()
        stats["grad_norm"] = float(norm)
        if torch.isfinite(norm):
            self.optimizer.step()
        return stats

    def ppo_update(self, batch: Batch, t: Training, prompts_per_step: int, loss_fn: LossFn,
                   per: str = "rows") -> dict[str, float]:
        """`ppoEpochs` passes over this rank's shard, one optimizer step per mini-batch; stats averaged over steps.

        A mini-batch is `miniBatchSize` prompts of the global batch, i.e. the same fraction of this rank's rows.
        """
        t0 = time.perf_counter()
        prompts = prompts_per_step
        rows = max(1, len(batch) * (t.mini_batch_size or prompts) // prompts)
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(t.ppo_epochs):
            for mini in batch.split(rows):
                for k, v in self.train_mini_batch(mini, t.micro_batch_size, loss_fn, per).items():
                    totals[k] = totals.get(k, 0.0) + v
                steps += 1
        out = {k: v / steps for k, v in totals.items()}
        out["update_seconds"] = time.perf_counter() - t0
        return out
