"""The model's own files in a checkpoint: each role's HF directory minus its weights (config, generation config,
tokenizer, chat template) is copied next to its shards at save time as `<role>.hf.<file>` and sealed with them, so a
checkpoint exports to an HF model directory (hybridflow.export) without the directory the job trained from."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from hybridflow.checkpoint import store as ckpt

HF_FILES_INFIX = ".hf."
# A LoRA role's adapter_config.json (PEFT's), beside its shards: the checkpoint's weights are then the adapter alone,
# and `hybridflow export` writes them as an adapter directory or merges them into the base it names
LORA_CONFIG_SUFFIX = ".lora.json"
# Small files of an HF model directory that describe the model and its tokenizer; weights are never copied.
_META_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_META_MAX_BYTES = 64 << 20


# Where a model file may not lead through a symbolic link (the kernel's files, the secrets mounts): a
# `tokenizer.json -> /proc/self/environ` planted on a model claim would copy the pod's environment (its Ray token,
# storage keys) into the checkpoint. Links elsewhere stay followed: an HF cache's snapshot holds links into its blobs.
_NEVER_COPIED = ("/proc", "/sys", "/dev", "/run", "/var/run")


def model_metadata_files(model_dir: Path) -> list[Path]:
    """The files of an HF model directory that are not weights: config, generation config, tokenizer, template;
    regular files only, none reached through a link into the machine's own (`_NEVER_COPIED`)."""
    def wanted(p: Path) -> bool:
        if not (p.is_file() and p.suffix in _META_SUFFIXES and p.name not in _WEIGHT_INDEXES):
            return False
        real = os.path.realpath(p)
        return (not any(real == d or real.startswith(d + "/") for d in _NEVER_COPIED)
                and p.stat().st_size <= _META_MAX_BYTES)
    return sorted(p for p in model_dir.iterdir() if wanted(p))


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


def write_adapter_config(directory: Path, role: str, config: dict) -> Path:
    """`config` (models.lora.adapter_config's) as `<role>.lora.json` in a checkpoint being written, fsynced."""
    import json

    dest = directory / f"{role}{LORA_CONFIG_SUFFIX}"
    text = json.dumps(config, indent=2, sort_keys=True)
    if ckpt.is_remote(dest):
        dest.write_text(text)
    else:
        with open(dest, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return dest
