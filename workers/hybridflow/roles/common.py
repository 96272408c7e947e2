"""What every model-holding role shares: memory readings, per phase (loading HF weights:
`hybridflow.engines.train.fsdp`; checkpoint save/load of its engine: `hybridflow.checkpoint.role.CheckpointMixin`)."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import resource
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch


class CudaMemory(Protocol):
    """The torch.cuda calls the readings below make: `torch.cuda` itself, or a test's double of it (no GPU here)."""

    def is_available(self) -> bool: ...
    def is_initialized(self) -> bool: ...
    def max_memory_allocated(self) -> int: ...
    def reset_peak_memory_stats(self) -> None: ...
    def mem_get_info(self) -> tuple[int, int]: ...
    def memory_reserved(self) -> int: ...
    def memory_allocated(self) -> int: ...


def _on_gpu(cuda: CudaMemory) -> bool:
    return bool(cuda.is_available() and cuda.is_initialized())


def status_bytes(field: str) -> int | None:
    """A memory line of /proc/self/status (VmRSS, VmHWM, RssAnon...) in bytes (None where there is no such file)."""
    try:
        with open("/proc/self/status") as f:
            line = next((x for x in f if x.startswith(field + ":")), None)
    except OSError:
        return None
    return None if line is None else int(line.split()[1]) * 1024


def peak_memory_bytes(cuda: CudaMemory = torch.cuda) -> int:
    """Peak memory since the last `reset_peak_memory` (or the process's start): torch's allocator on GPU; the
    resident set on CPU, as the kernel's high-water mark VmHWM (the one `reset_peak_memory` resets; getrusage's
    ru_maxrss also keeps the peaks of threads that ended, so it may not fall), ru_maxrss where /proc has none."""
    if _on_gpu(cuda):
        return int(cuda.max_memory_allocated())
    hwm = status_bytes("VmHWM")
    return hwm if hwm is not None else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_memory(cuda: CudaMemory = torch.cuda) -> bool:
    """Start a phase's peak, so that a phase reports its own peak and not the process's: on a GPU that would be
    vLLM's start-up profiling, which fills the device to gpuMemoryUtilization before step 1. GPU:
    torch.cuda.reset_peak_memory_stats. CPU: getrusage's ru_maxrss has no reset of its own, but Linux (4.0 on)
    resets the resident high-water mark when "5" is written to /proc/self/clear_refs (seen here: VmHWM and
    ru_maxrss fell from 320 MB to 13 MB once a 300 MB buffer was freed). Returns False where that cannot be written
    (an older kernel, a sandbox without it): the CPU reading then stays the process's lifetime peak."""
    if _on_gpu(cuda):
        cuda.reset_peak_memory_stats()
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@dataclass
class PhasePeak:
    """One phase's peak memory in bytes, read when the phase ends."""

    bytes: int = 0


@contextlib.contextmanager
def memory_phase(cuda: CudaMemory = torch.cuda) -> Iterator[PhasePeak]:
    """A phase (a log-prob pass, an update) with its own peak: reset at its start, read at its end."""
    reading = PhasePeak()
    reset_peak_memory(cuda)
    try:
        yield reading
    finally:
        reading.bytes = peak_memory_bytes(cuda)


def memory_in_use_bytes(cuda: CudaMemory = torch.cuda) -> int:
    """Memory this process holds now, to measure what one call frees or takes (vLLM's sleep and wake). GPU: the
    device's used memory as the driver reports it (total - free: it sees what sleep mode unmaps beneath torch),
    less the blocks torch's caching allocator holds free (a transition's freed buffers are not the engine's). CPU:
    the resident set (VmRSS)."""
    if _on_gpu(cuda):
        free, total = cuda.mem_get_info()
        return int(total - free - (cuda.memory_reserved() - cuda.memory_allocated()))
    rss = status_bytes("VmRSS")
    return 0 if rss is None else rss


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

