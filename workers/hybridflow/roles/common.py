"""What every model-holding role shares: memory readings (loading HF weights: `hybridflow.engines.train.fsdp`;
checkpoint save/load of its engine: `hybridflow.checkpoint.role.CheckpointMixin`)."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource

import torch


def peak_memory_bytes() -> int:
    """Peak device memory on GPU; peak resident set of this process on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def release_free_memory() -> None:
    """Give memory that is free but still held by this process back to the OS: the allocator's caches (CUDA) or the
    C heap (glibc keeps freed chunks in its arenas; a process that loaded a whole model and sharded it, or finished
    a generation phase, would otherwise carry that high-water mark into the next phase)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)

