"""What every model-holding role shares: loading HF weights, checkpoint save/load of its engine, memory readings."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.checkpoint import load_tensors
from hybridflow.controller.protocol import Dispatch, register
from hybridflow.export import copy_model_metadata


def load_causal_lm(model_dir: Path, dtype: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))


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


class CheckpointMixin:
    """Full (unsharded) state of `self.engine`, written by rank 0 into a directory the controller then seals, with
    the model directory's config and tokenizer files beside it (what `hybridflow export` needs)."""

    checkpoint_name = "model"
    engine: Any
    model_dir: Path

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> str | None:
        state = self.engine.state_dict()  # collective: every rank takes part
        path = Path(directory) / f"{self.checkpoint_name}.pt"
        if dist.get_rank() == 0:
            tmp = path.with_suffix(".pt.tmp")
            torch.save(state, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            copy_model_metadata(self.model_dir, Path(directory), self.checkpoint_name)
            return str(path)
        return None

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        state = load_tensors(Path(directory) / f"{self.checkpoint_name}.pt")  # never a full unpickle
        self.engine.load_state_dict(state)
