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


def export(root: str, to: str | Path, checkpoint: str | None, role: str, dtype: str | None) -> Path:
    """`checkpoint` (a step_* directory, or its name under `root`), default the newest intact one, as an HF model."""
    from hybridflow.export import chosen_checkpoint, export as export_model

    where = root if checkpoint is None else checkpoint if "/" in checkpoint else f"{root.rstrip('/')}/{checkpoint}"
    return export_model(chosen_checkpoint(where), Path(to), role, dtype)
