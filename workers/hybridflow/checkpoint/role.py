"""The role side of a checkpoint: what every trained role (actor, critics) does on each of its ranks to save and
load its engine's state. The controller side (when, sealing, resume) is `checkpointer`."""
from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hybridflow.checkpoint import dcp
from hybridflow.models import lora
from hybridflow.checkpoint.store import load_tensors, storage_path
from hybridflow.single_controller.protocol import Dispatch, register
from hybridflow.checkpoint.model_files import copy_model_metadata, write_adapter_config


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
                if self.engine.lora is not None:  # the weights saved are an adapter's: say which
                    write_adapter_config(checkpoint, self.checkpoint_name, lora.adapter_config(
                        self.engine.lora, lora.model_type(self.model_dir), str(self.model_dir)))

        if asynchronous:
            self._pending_save = dcp.save_async(state, target, checkpoint, model_files)
            return None
        return dcp.save(state, target, checkpoint, model_files)

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
        dcp.load(state, storage_path(directory) / self.checkpoint_name)
        self.engine.load_checkpoint_state(state)
