"""A job's step log, checkpoints and their export, read where the job keeps them (a directory, or object storage
with the caller's own credentials): the part of the client that is the same for a cluster's job and a local run."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def steps(root: str) -> list[dict[str, Any]]:
    from hybridflow import checkpoint as ckpt

    return ckpt.read_step_log(ckpt.storage_path(root))


def checkpoints(root: str) -> list[str]:
    from hybridflow import checkpoint as ckpt

    return [str(p) for p in ckpt.list_checkpoints(ckpt.storage_path(root))]


def export(root: str, to: str | Path, checkpoint: str | int | Path | None, role: str, dtype: str | None) -> Path:
    """A checkpoint, default the newest intact one, as an HF model: `checkpoint` is a step number, a step_*
    directory's name (under `root`), or its path (a step_* directory, or a checkpointDir: its newest intact one)."""
    from hybridflow.export import chosen_checkpoint, export as export_model

    return export_model(chosen_checkpoint(checkpoint_path(root, checkpoint)), Path(to), role, dtype)


def checkpoint_path(root: str, checkpoint: str | int | Path | None) -> str:
    if checkpoint is None:
        return root
    if isinstance(checkpoint, int):
        return f"{root.rstrip('/')}/step_{checkpoint:08d}"
    name = str(checkpoint).rstrip("/")
    if "/" not in name:  # a name under the job's directory
        return f"{root.rstrip('/')}/{name}"
    return name
