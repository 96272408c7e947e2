"""The model's own files in a checkpoint: each role's HF directory minus its weights (config, generation config,
tokenizer, chat template) is copied next to its shards at save time as `<role>.hf.<file>` and sealed with them, so a
checkpoint exports to an HF model directory (hybridflow.export) without the directory the job trained from."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from hybridflow.checkpoint import store as ckpt

HF_FILES_INFIX = ".hf."
# Small files of an HF model directory that describe the model and its tokenizer; weights are never copied.
_META_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_META_MAX_BYTES = 64 << 20


def model_metadata_files(model_dir: Path) -> list[Path]:
    """The files of an HF model directory that are not weights: config, generation config, tokenizer, template."""
    return sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in _META_SUFFIXES
                  and p.name not in _WEIGHT_INDEXES and p.stat().st_size <= _META_MAX_BYTES)


def copy_model_metadata(model_dir: Path, directory: Path, role: str) -> list[Path]:
    """Copy `model_dir`'s metadata files into a checkpoint being written, as `<role>.hf.<name>`; fsynced like the
    weights, so a sealed checkpoint never holds an empty one after a power loss."""
    out = []
    for p in model_metadata_files(model_dir):
        dest = directory / f"{role}{HF_FILES_INFIX}{p.name}"
        if ckpt.is_remote(dest):
            dest.write_bytes(p.read_bytes())
        else:
            shutil.copyfile(p, dest)
            with open(dest, "rb+") as f:
                os.fsync(f.fileno())
        out.append(dest)
    return out
