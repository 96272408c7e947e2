"""The few CUDA assumptions megatron-core 0.16 makes that stop it on a CPU build of torch, answered with CPU
equivalents. Applied only when a job runs on CPU (tests, laptops); on GPUs nothing here runs.

What megatron calls, and what we answer:
  torch.cuda.current_device()          -> "cpu" (RoPE and masks move tensors to it)
  torch.cuda.{get,set}_rng_state()     -> the CPU generator's state (the model-parallel RNG tracker)
  torch.cuda.manual_seed()             -> seeds the CPU generator
  torch.cuda.synchronize()             -> no-op
  transformer.utils.get_default_causal_mask (device="cuda") -> the same mask on the CPU
  tensor_parallel.random._{get,set}_cuda_rng_state -> CPU generator state
  pipeline_parallel.schedules: torch.zeros(..., device="cuda") -> on the CPU (its token counter)
"""
from __future__ import annotations

import torch

_APPLIED = False


class _TorchOnCpu:
    """`torch` as the pipeline schedules see it: identical, except tensors asked for on "cuda" land on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def apply_cpu_fallbacks() -> None:
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda device="cpu": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cpu": torch.set_rng_state(state)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.random.default_generator.manual_seed(seed)  # type: ignore
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as tf_utils

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    tf_utils.get_default_causal_mask = causal_mask
    fused_softmax.get_default_causal_mask = causal_mask  # imported by name there

    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()  # type: ignore[attr-defined]

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[attr-defined]
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[attr-defined]
    _APPLIED = True
