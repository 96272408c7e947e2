"""The job's step log (`steps.jsonl`, one JSON record per step) and its rollout log (`rollouts/step_N.jsonl`,
trainer.rolloutLog), beside the checkpoints. Both are rewound to the checkpoint a job resumes from, so that the
final logs list every step exactly once. Object storage has no append: there the step log is a series of parts,
each put whole."""
from __future__ import annotations

import json
import os
import re
from typing import Any

from hybridflow.checkpoint.store import StoragePath, is_remote

STEP_LOG = "steps.jsonl"
# Object storage has no append: there the log is a series of parts of STEP_LOG_PART_RECORDS records, each put
# whole, so a step's write stays small however long the job runs (one object put whole would grow with every step).
STEP_LOG_PARTS = "steps"
STEP_LOG_PART_RECORDS = 100


def _log_parts(root: StoragePath) -> list[StoragePath]:
    parts = root / STEP_LOG_PARTS
    return sorted(parts.glob("part-*.jsonl"), key=lambda p: p.name) if parts.exists() else []


def _part(root: StoragePath, index: int) -> StoragePath:
    return root / STEP_LOG_PARTS / f"part-{index:05d}.jsonl"


def _lines(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _read_log_parts(root: StoragePath) -> list[list[dict[str, Any]]]:
    return [_parse_log(p.read_text()) for p in _log_parts(root)]


def _write_log_parts(root: StoragePath, records: list[dict[str, Any]], first_part: int) -> None:
    """Parts `first_part`.. hold `records` (the log's records from that part on); later parts are deleted."""
    n = STEP_LOG_PART_RECORDS
    chunks = [records[i:i + n] for i in range(0, len(records), n)]
    for i, chunk in enumerate(chunks):
        _part(root, first_part + i).write_text(_lines(chunk))
    for p in _log_parts(root)[first_part + len(chunks):]:
        p.unlink()


def append_step_log(root: StoragePath, record: dict[str, Any]) -> None:
    """Add one step's record, fsync'd locally; on object storage the last part is put again with it (or a new one
    is begun), never the whole log."""
    if is_remote(root):
        parts = _log_parts(root)
        last = _parse_log(parts[-1].read_text()) if parts else []
        if parts and len(last) < STEP_LOG_PART_RECORDS:
            parts[-1].write_text(_lines(last + [record]))
        else:
            _part(root, len(parts)).write_text(_lines([record]))
        return
    with open(root / STEP_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _parse_log(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by a crash ends the log
    return out


def read_step_log(root: StoragePath) -> list[dict[str, Any]]:
    """The job's step records, oldest first (`steps.jsonl`; on object storage, its parts in order)."""
    if is_remote(root):
        return [r for part in _read_log_parts(root) for r in part]
    p = root / STEP_LOG
    return _parse_log(p.read_text()) if p.is_file() else []


def rewind_step_log(root: StoragePath, step: int) -> int:
    """Keep log records up to `step` (the checkpoint resumed from); returns how many were dropped."""
    if is_remote(root):  # each part was put whole: nothing torn to clean up
        parts = _read_log_parts(root)
        # rewritten from the part holding the first record dropped (not necessarily at the end: steps go backwards
        # in a log that a run with `resume: never` continued); the parts before it are kept as they are
        first = next((i for i, part in enumerate(parts) if any(r.get("step", 0) > step for r in part)), None)
        if first is None:
            return 0
        later = [r for part in parts[first:] for r in part]
        kept_later = [r for r in later if r.get("step", 0) <= step]
        _write_log_parts(root, kept_later, first)
        return len(later) - len(kept_later)
    records = read_step_log(root)
    kept = [r for r in records if r.get("step", 0) <= step]
    if len(kept) == len(records):  # nothing to drop (a fresh job has no log yet: none is made)
        return 0
    tmp = root / (STEP_LOG + ".tmp")
    tmp.write_text(_lines(kept))
    os.replace(tmp, root / STEP_LOG)
    return len(records) - len(kept)


# --- the rollout log (trainer.rolloutLog): each step's trained samples, one JSON line per sample ---
# One file per step, put whole: a step redone after a resume replaces its file, and object storage needs no append.
ROLLOUTS = "rollouts"
_ROLLOUT_FILE = re.compile(r"^step_(\d{8})\.jsonl$")


def rollout_path(root: StoragePath, step: int) -> StoragePath:
    """`rollouts/step_N.jsonl` (N with 8 digits, as checkpoints' `step_N`)."""
    return root / ROLLOUTS / f"step_{step:08d}.jsonl"


def write_rollouts(root: StoragePath, step: int, records: list[dict[str, Any]]) -> StoragePath:
    """`step`'s samples as `rollouts/step_<N>.jsonl` (N with 8 digits, as checkpoints' `step_N`); locally written
    to a temporary file and renamed, so a crash never leaves a torn one."""
    p = rollout_path(root, step)
    if is_remote(root):
        p.write_text(_lines(records))
        return p
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(_lines(records))
    os.replace(tmp, p)
    return p


def read_rollouts(root: StoragePath, step: int) -> list[dict[str, Any]]:
    """`step`'s samples, in the order the actor trained on them ([] when the step wrote none)."""
    p = rollout_path(root, step)
    return _parse_log(p.read_text()) if p.exists() else []


def rollout_steps(root: StoragePath) -> list[int]:
    """The steps that have a rollout file, in order."""
    d = root / ROLLOUTS
    if not d.exists():
        return []
    return sorted(int(m.group(1)) for p in d.glob("step_*.jsonl") if (m := _ROLLOUT_FILE.match(p.name)))


def rewind_rollouts(root: StoragePath, step: int) -> int:
    """Delete the rollout files of steps after `step` (the checkpoint resumed from), as the step log is rewound:
    those steps are redone and write theirs again. Returns how many were deleted."""
    dropped = [s for s in rollout_steps(root) if s > step]
    for s in dropped:
        rollout_path(root, s).unlink()
    return len(dropped)
