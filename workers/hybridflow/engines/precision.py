"""Which dtype a job computes in. Weights and optimizer state stay in the model's dtype (fp32 masters); forward,
backward and generation run in the compute dtype, which `auto` makes bfloat16 wherever the hardware does bf16
natively (bf16 matmuls on an AVX512-BF16 core run about twice as fast as fp32 ones, and every buffer halves)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def native_bf16(device: str) -> bool:
    """Whether this process's device computes bfloat16 natively (not emulated through fp32)."""
    if device == "gpu":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    cpu = torch.backends.cpu.get_cpu_capability()  # "AVX512" etc.; bf16 needs the AVX512-BF16 or AMX extensions
    return cpu.startswith("AVX512") and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def compute_dtype(setting: str, device: str, group: dist.ProcessGroup | None = None) -> torch.dtype:
    """The dtype `setting` ("auto", "float32", "bfloat16") means here. With torch.distributed up, `auto` is agreed
    over `group`: one rank on a node without bf16 makes every rank compute in fp32, so collectives match."""
    if setting != "auto":
        return getattr(torch, setting)
    ok = native_bf16(device)
    if dist.is_initialized():
        flag = torch.tensor([1 if ok else 0], device="cuda" if device == "gpu" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flag.item())
    return torch.bfloat16 if ok else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
