"""What a script holds on to for a job, whichever runs it: the `Job` protocol, the job's state as one `Snapshot`,
and the spec a script submits, however it has it. Pure (no I/O but reading the manifest a path names)."""
from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hybridflow.api import RLHFJob, dump_job, load_job, loads_job, parse_job
from hybridflow.api.status import TERMINAL, Phase

# What `submit` takes: a path to a manifest, its YAML text, the manifest as a dict, or a parsed RLHFJob.
Source = str | Path | dict[str, Any] | RLHFJob


class JobFailed(RuntimeError):
    """The job ended Failed: the message is its status's (the driver's error, or the operator's reason)."""

    def __init__(self, name: str, snapshot: Snapshot) -> None:
        super().__init__(f"job {name} failed: {snapshot.message or snapshot.reason or 'no reason given'}")
        self.snapshot = snapshot


@dataclass(frozen=True)
class Snapshot:
    """A job's state, the same fields for a cluster's RLHFJob status and a local run."""
    phase: str  # a hybridflow.api.status.Phase ("Running", "Succeeded", ...; "" before the operator saw it)
    step: int = 0
    total_steps: int = 0
    tokens_per_second: float = 0.0
    eta_seconds: float | None = None
    reason: str = ""
    message: str = ""
    last_checkpoint: str = ""
    restarts: int = 0

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL

    @property
    def failed(self) -> bool:
        return self.phase == Phase.FAILED


def snapshot_of(status: dict[str, Any]) -> Snapshot:
    """A Snapshot from an RLHFJob's status, as the operator writes it."""
    return Snapshot(phase=status.get("phase", ""), step=int(status.get("step") or 0),
                    total_steps=int(status.get("totalSteps") or 0),
                    tokens_per_second=float(status.get("tokensPerSecond") or 0.0),
                    eta_seconds=status.get("etaSeconds"), reason=status.get("reason", ""),
                    message=status.get("message", ""), last_checkpoint=status.get("lastCheckpoint", ""),
                    restarts=int(status.get("restarts") or 0))


def progress_line(name: str, s: Snapshot) -> str:
    """One line of a wait's progress: phase, step of total (percent), throughput and ETA, or why it waits."""
    line = f"{name}: {s.phase or 'Created'}"
    if s.total_steps:
        line += f" step {s.step}/{s.total_steps} ({100 * s.step // s.total_steps}%)"
    if s.tokens_per_second:
        line += f" {s.tokens_per_second:.0f} tok/s"
    if s.eta_seconds is not None and not s.done and s.step:
        line += f" ETA {dt.timedelta(seconds=round(float(s.eta_seconds)))}"
    if s.phase not in (Phase.RUNNING, Phase.SUCCEEDED) and s.message:
        line += f" ({s.message})"
    return line


def wait_for_end(name: str, read: Callable[[], Snapshot], pause: Callable[[float], None], timeout: float | None,
                 progress: bool, poll: float) -> Snapshot:
    """Read the job's state until it ends (the Job protocol's `wait`, for any backend: `read` its state, `pause`
    between reads): its final Snapshot; JobFailed; TimeoutError past `timeout`. `progress`: a line to stderr at
    each change."""
    deadline = None if timeout is None else time.monotonic() + timeout
    shown = ""
    while True:
        now = read()
        if progress and (line := progress_line(name, now)) != shown:
            print(line, file=sys.stderr, flush=True)
            shown = line
        if now.failed:
            raise JobFailed(name, now)
        if now.done:
            return now
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {name} still {now.phase or 'new'} after {timeout:.0f} s")
        pause(poll)


def manifest(source: Source, name: str | None = None, namespace: str | None = None) -> RLHFJob:
    """The job a script submits, validated as `hybridflow validate` validates it (a SpecError names the file or the
    field); `name` and `namespace` replace the manifest's own."""
    if isinstance(source, RLHFJob):  # validated again: fields set on it since were not
        job = parse_job(dump_job(source), "the job given")
    elif isinstance(source, dict):
        job = parse_job(source, "the manifest given")
    elif isinstance(source, Path) or _names_a_file(source):
        job = load_job(source)
    else:
        job = loads_job(source, "the manifest given")
    if name is not None or namespace is not None:
        doc = dump_job(job)
        doc["metadata"].update({k: v for k, v in (("name", name), ("namespace", namespace)) if v is not None})
        job = parse_job(doc, "the manifest given")
    return job


def _names_a_file(source: str) -> bool:
    """Whether a string is a manifest's path rather than its text: not when it spans lines or reads as a mapping
    (`key: value`, `{...}`), which no path does (a path that is not there: load_job says so)."""
    text = source.strip()
    if "\n" in text or ": " in text or text.startswith("{"):
        return False
    return True


class Job(Protocol):
    """A job submitted through the client (a cluster's RLHFJob, or a local `hybridflow run`): the same calls for
    both, so a script written against a laptop runs against a cluster."""

    name: str

    def status(self) -> Snapshot:
        """Its state now."""
        ...

    def wait(self, timeout: float | None = None, progress: bool = True, poll: float = 2.0) -> Snapshot:
        """Until it ends: its final Snapshot if it succeeded; JobFailed if it failed; TimeoutError past `timeout`.
        `progress` prints a line (progress_line) to stderr at each change."""
        ...

    def logs(self, follow: bool = False) -> Iterator[str]:
        """The driver's log, line by line; `follow` waits for more until it ends."""
        ...

    def steps(self) -> list[dict[str, Any]]:
        """The step log (one record per completed step, as steps.jsonl holds it)."""
        ...

    def checkpoints(self) -> list[str]:
        """Its checkpoints (step_* directories or URLs), oldest first, intact or not."""
        ...

    def export(self, to: str | Path, checkpoint: str | int | None = None, role: str = "actor",
               dtype: str | None = None) -> Path:
        """A checkpoint as an HF model directory at `to`: default the newest intact one; else a step number, a
        step_* directory's name, or a path."""
        ...

    def delete(self) -> None:
        """Stop it (a cluster: delete the RLHFJob, its pods and children go; locally: end the run)."""
        ...
