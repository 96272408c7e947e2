"""Checkpoints that survive `kill -9`: each one is built in a hidden temp directory, sealed with a manifest of
SHA-256 digests, then renamed into place. A checkpoint whose manifest is missing or whose files do not match is
skipped with a warning, and the previous one is used. The step log is rewound to the checkpoint on resume, so the
final log lists every step exactly once."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("hybridflow.checkpoint")

MANIFEST = "MANIFEST.json"
STEP_LOG = "steps.jsonl"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    d = root / f".step_{step:08d}.tmp"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(root: Path, staging: Path, step: int, trainer_state: dict[str, Any], keep: int) -> Path:
    """Write trainer state and manifest into `staging`, rename it to step_N, prune old checkpoints."""
    (staging / "trainer_state.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
    files = {p.name: _sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
    tmp = staging / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    os.replace(tmp, staging / MANIFEST)
    _fsync_dir(staging)
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=lambda p: p.name)


def verify(ckpt: Path) -> str | None:
    """None when intact, else what is wrong."""
    mf = ckpt / MANIFEST
    if not mf.is_file():
        return "no manifest (interrupted while writing?)"
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, OSError) as err:
        return f"unreadable manifest: {err}"
    for name, digest in manifest.get("files", {}).items():
        p = ckpt / name
        if not p.is_file():
            return f"missing file {name}"
        if _sha256(p) != digest:
            return f"file {name} does not match its checksum"
    return None


def latest_good(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint and its trainer state; corrupt newer ones are reported and skipped."""
    for ckpt in reversed(list_checkpoints(root)):
        problem = verify(ckpt)
        if problem is None:
            return ckpt, json.loads((ckpt / "trainer_state.json").read_text())
        log.warning("skipping corrupt checkpoint %s: %s; falling back to the previous one", ckpt, problem)
    return None


def append_step_log(root: Path, record: dict[str, Any]) -> None:
    with open(root / STEP_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_step_log(root: Path) -> list[dict[str, Any]]:
    p = root / STEP_LOG
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by a crash ends the log
    return out


def rewind_step_log(root: Path, step: int) -> int:
    """Keep log records up to `step` (the checkpoint resumed from); returns how many were dropped."""
    records = read_step_log(root)
    kept = [r for r in records if r.get("step", 0) <= step]
    tmp = root / (STEP_LOG + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, root / STEP_LOG)
    return len(records) - len(kept)
