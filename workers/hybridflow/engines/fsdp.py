"""Training engine on torch FSDP2 (`fully_shard`): each rank keeps 1/N of every parameter and its optimizer state.

Device-agnostic: gloo on CPU, NCCL on GPU. The engine knows nothing of RL; roles hand it loss functions.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.controller.batch import Batch


def sequence_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """Model inputs for left-padded prompt + right-padded response rows; positions skip the left padding."""
    mask = batch["attention_mask"]
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    return {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": pos}


def response_logits(model: nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """Logits that predict each response token: (B, R, V)."""
    out = model(**sequence_inputs(batch), use_cache=False)
    R = batch["responses"].shape[1]
    logits = out.logits[:, -R - 1 : -1, :].float()
    return logits / temperature


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class FSDPEngine:
    """A module sharded with FSDP2 plus its AdamW optimizer."""

    def __init__(self, module: nn.Module, lr: float, grad_clip: float, device: str, trainable: bool = True) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.device = torch.device("cuda" if device == "gpu" else "cpu")
        module.to(self.device)
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        inner = getattr(module, "model", None) or getattr(module, getattr(module, "base_model_prefix", ""), None)
        for layer in getattr(inner, "layers", []):
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        self.module = module
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0) if trainable else None
        if not trainable:
            module.requires_grad_(False)
            module.eval()

    @torch.no_grad()
    def forward_micro(self, batch: Batch, micro_batch_size: int, fn: Callable[[nn.Module, Batch], torch.Tensor]) -> list:
        self.module.eval()
        return [fn(self.module, mb.to(self.device)) for mb in batch.split(micro_batch_size)]

    def train_mini_batch(
        self,
        batch: Batch,
        micro_batch_size: int,
        loss_fn: Callable[[nn.Module, Batch], tuple[torch.Tensor, dict[str, float]]],
    ) -> dict[str, float]:
        """One optimizer step over `batch`, accumulating micro-batches weighted by their share of the rows."""
        assert self.optimizer is not None, "this engine was built frozen"
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {}
        n = len(batch)
        for mb in batch.split(micro_batch_size):
            loss, mstats = loss_fn(self.module, mb.to(self.device))
            (loss * (len(mb) / n)).backward()
            for k, v in mstats.items():
                stats[k] = stats.get(k, 0.0) + float(v) * len(mb) / n
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        stats["grad_norm"] = float(norm)
        if torch.isfinite(norm):
            self.optimizer.step()
        return stats

    def ppo_update(
        self,
        batch: Batch,
        spec: Any,
        loss_fn: Callable[[nn.Module, Batch], tuple[torch.Tensor, dict[str, float]]],
    ) -> dict[str, float]:
        """`ppoEpochs` passes over this rank's shard, one optimizer step per mini-batch; stats averaged over steps.

        A mini-batch is `miniBatchSize` prompts of the global batch, i.e. the same fraction of this rank's rows.
        """
        t0 = time.perf_counter()
        t = spec.training
        prompts = spec.trainer.prompts_per_step
        rows = max(1, len(batch) * (t.mini_batch_size or prompts) // prompts)
        totals: dict[str, float] = {}
        steps = 0
        for _ in range(t.ppo_epochs):
            for mini in batch.split(rows):
                for k, v in self.train_mini_batch(mini, t.micro_batch_size, loss_fn).items():
                    totals[k] = totals.get(k, 0.0) + v
                steps += 1
        out = {k: v / steps for k, v in totals.items()}
        out["update_seconds"] = time.perf_counter() - t0
        return out

    def full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter gathered whole (an all-gather per tensor), HF names; what a generation engine loads."""
        for name, p in self.module.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, full.detach()

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return {"model": get_model_state_dict(self.module, options=opts)}
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=opts)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_state_dict(
            self.module,
            self.optimizer or [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optimizer", {}) if self.optimizer else {},
            options=opts,
        )
