"""What every model-holding role shares: loading HF weights, checkpoint save/load of its engine, memory readings."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridflow import sharded_checkpoint
from hybridflow.checkpoint import load_tensors, storage_path
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
    """Sharded checkpoints of `self.engine`: each rank writes its own shards of the engine's `checkpoint_state()`
    into `<checkpoint>/<role>/` (torch.distributed.checkpoint), which loads on another world size or tensor-parallel
    size; rank 0 adds the model directory's config and tokenizer files (what `hybridflow export` needs). The
    controller seals the checkpoint with the file digests the ranks return. Older checkpoints (`<role>.pt`, the full
    state written by rank 0 alone) still load."""

    checkpoint_name = "model"
    engine: Any
    model_dir: Path
    _pending_save: Future | None = None

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str, asynchronous: bool = False) -> dict[str, str] | None:
        """Collective. Returns this rank's {file: sha256} once written; with `asynchronous`, returns None as soon as
        the state is copied to host memory, and `finish_checkpoint` gives the digests when the write is done."""
        self.finish_checkpoint()  # one save in flight per role; the controller normally collected it already
        checkpoint = storage_path(directory)
        state = self.engine.checkpoint_state()  # collective where the engine gathers (e.g. a fresh optimizer's)
        target = checkpoint / self.checkpoint_name

        def model_files() -> None:  # what `hybridflow export` needs beside the weights
            if dist.get_rank() == 0:
                copy_model_metadata(self.model_dir, checkpoint, self.checkpoint_name)

        if asynchronous:
            self._pending_save = sharded_checkpoint.save_async(state, target, checkpoint, model_files)
            return None
        return sharded_checkpoint.save(state, target, checkpoint, model_files)

    @register(Dispatch.ONE_TO_ALL)
    def checkpoint_written(self) -> bool:
        """Whether no write of this rank is still running (never blocks)."""
        return self._pending_save is None or self._pending_save.done()

    @register(Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self) -> dict[str, str]:
        """Wait for this rank's asynchronous write; its digests ({} if none was running). A failed write raises."""
        pending, self._pending_save = self._pending_save, None
        return pending.result() if pending is not None else {}

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        full = storage_path(directory) / f"{self.checkpoint_name}.pt"
        if full.is_file():  # written before checkpoints were sharded
            state = load_tensors(full)  # never a full unpickle
            self.engine.load_state_dict(state)
            return
        state = self.engine.checkpoint_state()
        sharded_checkpoint.load(state, storage_path(directory) / self.checkpoint_name)
        self.engine.load_checkpoint_state(state)
