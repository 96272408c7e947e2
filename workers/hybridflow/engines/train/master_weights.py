"""fp32 master copies of a module's lower-precision parameters, for an engine that computes in its weights' dtype
(megatron-core: its layers take their dtype from the config and have no separate compute dtype). The module keeps
computing in bf16; the optimizer steps these fp32 copies (fp32 AdamW moments too) and each step's result is cast
back into the module. Without them, a bf16 weight at lr 1e-6 almost never moves: the update is below half its ulp.
This is megatron's own mixed-precision optimizer's scheme (main params in fp32, model params in bf16), with torch's
AdamW: megatron's `get_megatron_optimizer` is CUDA-only.
"""
from __future__ import annotations

import torch
from torch import nn


class MasterWeights:
    """One fp32 tensor per module parameter, in the parameters' order: what the optimizer is given."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.masters = [p.detach().float().clone() for p in params]
        self._of = {id(p): m for p, m in zip(params, self.masters)}

    def master_of(self, param: nn.Parameter) -> torch.Tensor:
        return self._of[id(param)]

    def take_grads(self) -> None:
        """Move each parameter's gradient, reduced and clipped, to its master as fp32 (the module's is freed)."""
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """The masters, cast to the module's dtype, into its parameters (after every optimizer step)."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    @torch.no_grad()
    def refresh(self) -> None:
        """The module's parameters into the masters (after weights were loaded into the module)."""
        for p, m in zip(self.params, self.masters):
            m.copy_(p)
