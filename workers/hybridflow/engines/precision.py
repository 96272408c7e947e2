"""Which dtype a job computes in, and which its trained weights are kept in.

A trained model's weights, the reduction of their gradients and its optimizer state are always float32: the
master copy (`master_dtype`). At the learning rates RL uses (1e-6 for a 7B model) almost every AdamW update is below
half a bf16 ulp of the weight it changes, so weights kept in bf16 stop learning. Forward, backward and generation run
in the compute dtype: `training.computeDtype` when set, else (`auto`) bfloat16 where the model's own dtype
(`models.<role>.dtype`) says so or the hardware does bf16 natively (bf16 matmuls on an AVX512-BF16 core run about
twice as fast as fp32 ones, and every activation halves). A frozen model (reference, reward) has no master: it is
held in its own dtype."""
from __future__ import annotations

import torch
import torch.distributed as dist
from hybridflow.engines import collectives


def native_bf16(device: str) -> bool:
    """Whether this process's device computes bfloat16 natively (not emulated through fp32)."""
    if device == "gpu":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    cpu = torch.backends.cpu.get_cpu_capability()  # "AVX512" etc.; bf16 needs the AVX512-BF16 or AMX extensions
    return cpu.startswith("AVX512") and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def master_dtype(model_dtype: str | None, trainable: bool) -> str | None:
    """The dtype a model's weights are loaded and kept in: float32 for a trained one, whatever `model_dtype` says
    (that is its compute dtype); a frozen one's own (None: its loader's default)."""
    return "float32" if trainable else model_dtype


def compute_dtype(setting: str, device: str, group: dist.ProcessGroup | None = None,
                  model_dtype: str | None = None) -> torch.dtype:
    """The dtype `setting` ("auto", "float32", "bfloat16") means here. `auto` is bfloat16 for a model whose dtype is
    bfloat16, else agreed over `group` (with torch.distributed up): one rank on a node without native bf16 makes
    every rank compute in fp32, so collectives match."""
    if setting != "auto":
        return getattr(torch, setting)
    if model_dtype == "bfloat16":
        return torch.bfloat16
    ok = native_bf16(device)
    if dist.is_initialized():
        flag = torch.tensor([1 if ok else 0], device="cuda" if device == "gpu" else "cpu")
        collectives.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flag.item())
    return torch.bfloat16 if ok else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
