"""Model FLOPs utilisation: the FLOPs a pass needs by the dense-transformer rule (2 x parameters per token forward,
twice that backward) against what this device's matmuls reach, measured here rather than read off a data sheet
(a CPU's peak depends on its vector units, threads and dtype; a laptop user has no data sheet at hand)."""
from __future__ import annotations

from time import perf_counter
from typing import Callable, Iterable, Mapping

import torch


def forward_flops(parameters: int, tokens: int) -> float:
    return 2.0 * parameters * tokens


def training_flops(parameters: int, tokens: int, trained: int | None = None) -> float:
    """Forward (2 FLOPs a parameter and token), the backward's input gradients (2 more) and its weight gradients (2
    a trained parameter): 6N a token in full fine-tuning (`trained` unset: every parameter), about 4N with LoRA,
    whose frozen base has no weight gradients."""
    return (4.0 * parameters + 2.0 * (parameters if trained is None else trained)) * tokens


def pooled_mfu(per_rank: Iterable[Mapping[str, float]]) -> float | None:
    """The job's MFU from its ranks' update statistics: their FLOP/s summed over their peaks summed (None where no
    rank reports both). Not the mean of the ranks' ratios, where one rank whose peak read low counts as much as
    the rest together and the job can read above 1; the ranks' own ratios stay in each rank's `mfu`."""
    pairs = [(r["update_flops_per_s"], r["peak_flops"]) for r in per_rank
             if "update_flops_per_s" in r and r.get("peak_flops")]
    return sum(f for f, _ in pairs) / sum(p for _, p in pairs) if pairs else None


def matmul_peak_flops(dtype: torch.dtype, device: str = "cpu", size: int = 1024, seconds: float = 0.1,
                      windows: int = 3) -> float:
    """FLOP/s of square `size` matmuls in `dtype` on this process's device and threads: the ceiling MFU divides by.
    The best of `windows` windows of at least `seconds` (and one matmul) each: other work on the machine (another
    rank loading, a burst elsewhere) only ever slows a window, so the fastest is the nearest to the ceiling."""
    dev = torch.device("cuda" if device == "gpu" else "cpu")
    if dev.type == "cuda":
        size = max(size, 8192)
    a = torch.randn(size, size, device=dev).to(dtype)
    b = torch.randn(size, size, device=dev).to(dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def matmul() -> None:
        a @ b
        sync()

    matmul()  # warm-up: kernel selection, page faults
    return 2.0 * size**3 * max(calls_per_second(matmul, seconds) for _ in range(windows))


def calls_per_second(call: Callable[[], None], seconds: float) -> float:
    """How often `call` ran a second over one window of at least `seconds` and one call (a call that alone takes
    longer, a bf16 matmul on a CPU without native bf16, still gives a rate, not a wait for more)."""
    n, t0 = 0, perf_counter()
    while True:
        call()
        n += 1
        elapsed = perf_counter() - t0
        if elapsed >= seconds:
            return n / elapsed
