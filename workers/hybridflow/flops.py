"""Model FLOPs utilisation: the FLOPs a pass needs by the dense-transformer rule (2 x parameters per token forward,
twice that backward) against what this device's matmuls reach, measured here rather than read off a data sheet
(a CPU's peak depends on its vector units, threads and dtype; a laptop user has no data sheet at hand)."""
from __future__ import annotations

import time

import torch


def forward_flops(parameters: int, tokens: int) -> float:
    return 2.0 * parameters * tokens


def training_flops(parameters: int, tokens: int, trained: int | None = None) -> float:
    """Forward (2 FLOPs a parameter and token), the backward's input gradients (2 more) and its weight gradients (2
    a trained parameter): 6N a token in full fine-tuning (`trained` unset: every parameter), about 4N with LoRA,
    whose frozen base has no weight gradients."""
    return (4.0 * parameters + 2.0 * (parameters if trained is None else trained)) * tokens


def matmul_peak_flops(dtype: torch.dtype, device: str = "cpu", size: int = 1024, seconds: float = 0.1) -> float:
    """FLOP/s of square `size` matmuls in `dtype` on this process's device and threads: the ceiling MFU divides by."""
    dev = torch.device("cuda" if device == "gpu" else "cpu")
    if dev.type == "cuda":
        size = max(size, 8192)
    a = torch.randn(size, size, device=dev).to(dtype)
    b = torch.randn(size, size, device=dev).to(dtype)
    a @ b  # warm-up: kernel selection, page faults
    n, t0 = 0, time.perf_counter()
    while True:
        a @ b
        n += 1
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 3:
            return 2.0 * size**3 * n / elapsed
