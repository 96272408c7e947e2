"""The C heap allocator of the job's worker processes (spec.resourcePools[].allocator).

A training rank allocates and frees activation-sized blocks (hundreds of MB a micro-batch, a different shape each
time) and a vLLM rank repacks all its weights after every update. glibc's malloc serves the largest of them with
fresh mmaps (zero-filled pages, faulted in again every time) and leaves the rest scattered over its arenas, so a
rank's resident set grows step after step. tcmalloc keeps freed spans for reuse. Measured on a 2-core AVX2 machine
(bench/throughput.py --ablate tcmalloc): the SmolLM2 GRPO job's tokens/s and its summed peak memory both move by
about a third, and the peak stops growing after the first steps. vLLM's own CPU guide asks for it too.

The allocator has to be in place when a process starts (LD_PRELOAD), so it reaches a worker through Ray's
runtime_env of the worker's actor, not through os.environ inside it. Pure decisions here; the one look at the
machine is `find_allocator`.
"""
from __future__ import annotations

import ctypes.util
import logging

# The allocators a pool may ask for (a registry of the job's API: the spec validates names against it).
from hybridflow.api.allocators import ALLOCATORS, AUTO_ORDER

__all__ = ["ALLOCATORS", "AUTO_ORDER", "AllocatorMissing", "allocator_in_maps", "choose_allocator", "find_allocator",
           "own_allocator", "preload_env", "worker_allocator_env"]

log = logging.getLogger(__name__)


class AllocatorMissing(RuntimeError):
    pass


def find_allocator(name: str) -> str | None:
    """The shared library file (a soname the dynamic linker resolves) of allocator `name` on this machine."""
    for lib in ALLOCATORS[name].libraries:
        found = ctypes.util.find_library(lib)
        if found:
            return found
    return None


def choose_allocator(wanted: str, found: dict[str, str | None], field: str) -> tuple[str, str | None]:
    """(allocator name, library) for a pool asking for `wanted` ("auto", "system" or a name of ALLOCATORS), given
    what the machine has (`found`: name -> library or None). An allocator asked for by name must be there."""
    if wanted == "system":
        return "system", None
    if wanted == "auto":
        for name in AUTO_ORDER:
            if found.get(name):
                return name, found[name]
        return "system", None
    lib = found.get(wanted)
    if not lib:
        raise AllocatorMissing(f"{field}: {wanted} is not installed on this machine (apt-get install "
                               f"{ALLOCATORS[wanted].package}); or set it to auto or system")
    return wanted, lib


def preload_env(lib: str | None) -> dict[str, str]:
    """The environment a worker process starts with so that `lib` serves its malloc: LD_PRELOAD ahead of whatever
    the node's Ray already preloads (Ray expands ${LD_PRELOAD} from the worker's own environment)."""
    return {} if lib is None else {"LD_PRELOAD": f"{lib}:${{LD_PRELOAD}}"}


def worker_allocator_env(wanted: str, field: str) -> dict[str, str]:
    """`preload_env` for a pool's `allocator` setting on this machine; "auto" without tcmalloc says once how to get
    it (the job runs, slower, on the C library's malloc)."""
    name, lib = choose_allocator(wanted, {n: find_allocator(n) for n in ALLOCATORS}, field)
    if wanted == "auto" and lib is None:
        log.warning("%s: no tcmalloc on this machine, the workers use the C library's malloc (slower, and their "
                    "memory grows over the first steps); apt-get install %s", field, ALLOCATORS["tcmalloc"].package)
    return preload_env(lib)


def allocator_in_maps(maps: str) -> str:
    """Which allocator serves a process, from its /proc/<pid>/maps: the first of ALLOCATORS whose library is mapped
    into it, else "system"."""
    for name, kind in ALLOCATORS.items():
        if any(f"lib{lib}.so" in maps for lib in kind.libraries):
            return name
    return "system"


def own_allocator() -> str:
    """The allocator serving this process (Linux; "system" where /proc cannot tell)."""
    try:
        with open("/proc/self/maps") as f:
            return allocator_in_maps(f.read())
    except OSError:
        return "system"
