"""The client's calls on this machine: a job is a `hybridflow run` of it, started from the caller's working
directory (relative paths in the spec mean what they mean to `hybridflow run` there) under a supervisor
(hybridflow.client.supervise) that records its pid, its process group and its exit code in the job's directory
under the client's workdir (`<workdir>/<name>/`: job.yaml, driver.log, checkpoints/), so any later client, in this
script or another, knows the run's state and can stop it; a script tried on a laptop talks to its runs as it will
talk to a cluster's jobs (hybridflow.client.cluster)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from hybridflow.api import dump_job
from hybridflow.api.errors import last_error
from hybridflow.api.status import Phase
from hybridflow.client import storage
from hybridflow.client.jobs import Snapshot, Source, manifest, wait_for_end

LOG, MANIFEST, CHECKPOINTS = "driver.log", "job.yaml", "checkpoints"
PID, PGID, RETURNCODE, DELETED = "pid", "pgid", "returncode", "deleted"
STOP_SECONDS = 60.0  # how long `delete` lets the run stop on its own (an interrupt: the last checkpoint is kept)
INTERRUPT_EVERY = 5.0  # seconds between its interrupts while the run has not stopped


class LocalJob:
    """One local run (the Job protocol), known by its directory. `process`: its supervisor, when this client
    started it."""

    def __init__(self, name: str, root: Path, total_steps: int, process: subprocess.Popen | None = None) -> None:
        self.name, self.root, self.total_steps, self.process = name, root, total_steps, process

    @property
    def checkpoint_dir(self) -> str:
        return str(self.root / CHECKPOINTS)

    def _read_int(self, name: str) -> int | None:
        try:
            return int((self.root / name).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def returncode(self) -> int | None:
        """The run's exit code, None while it runs. A run whose supervisor is gone without recording one (killed
        with it) counts as failed: -9."""
        rc = self._read_int(RETURNCODE)
        if rc is not None:
            return rc
        if self.process is not None and self.process.poll() is None:
            return None
        if self.process is None and _signal(os.kill, self._read_int(PGID), 0):
            return None  # its supervisor (the session's leader: its pid is the pgid) still runs
        rc = self._read_int(RETURNCODE)  # written as it ended
        return -9 if rc is None else rc

    def status(self) -> Snapshot:
        records = self.steps()
        last = records[-1] if records else {}
        rc = self.returncode()
        phase = (Phase.SUCCEEDED if rc == 0 else Phase.FAILED if rc is not None else
                 Phase.RUNNING if records else Phase.INITIALIZING)
        reason, message = "", ""
        if rc not in (None, 0):
            deleted = (self.root / DELETED).exists()
            reason = "Deleted" if deleted else "Failed"
            message = "stopped by delete()" if deleted else _last_error(self.root / LOG, rc)
        found = self.checkpoints()
        return Snapshot(phase=phase, step=int(last.get("step", 0)), total_steps=self.total_steps,
                        tokens_per_second=float(last.get("throughput_tokens_per_s", 0.0)),
                        eta_seconds=last.get("eta_seconds"), reason=reason, message=message,
                        last_checkpoint=found[-1] if found else "")

    def wait(self, timeout: float | None = None, progress: bool = True, poll: float = 2.0) -> Snapshot:
        return wait_for_end(self.name, self.status, self._pause, timeout, progress, poll)

    def _pause(self, seconds: float) -> None:
        """Until the next read: the run's end ends it early."""
        if self.process is None:
            time.sleep(seconds)
            return
        try:
            self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            pass

    def logs(self, follow: bool = False) -> Iterator[str]:
        """The run's log (both streams, as written), line by line; a line still being written is held back until
        it ends (or the run does)."""
        with open(self.root / LOG, errors="replace") as f:
            pending = ""
            while True:
                pending += f.read()
                *lines, pending = pending.split("\n")
                yield from lines
                if not follow or self.returncode() is not None:
                    pending += f.read()  # what it wrote before it ended
                    yield from (ln for ln in pending.split("\n") if ln)
                    return
                time.sleep(0.2)

    def steps(self) -> list[dict[str, Any]]:
        return storage.steps(self.checkpoint_dir) if (self.root / CHECKPOINTS).exists() else []

    def checkpoints(self) -> list[str]:
        return storage.checkpoints(self.checkpoint_dir) if (self.root / CHECKPOINTS).exists() else []

    def export(self, to: str | Path, checkpoint: str | int | None = None, role: str = "actor",
               dtype: str | None = None) -> Path:
        return storage.export(self.checkpoint_dir, to, checkpoint, role, dtype)

    def delete(self) -> None:
        """Stop the run as Ctrl-C would (the driver keeps its last checkpoint and ends Ray), then end whatever of
        its session is left: at once, or after STOP_SECONDS, by SIGTERM and SIGKILL."""
        pid, pgid = self._read_int(PID), self._read_int(PGID)
        if self.returncode() is None:
            (self.root / DELETED).touch()
            deadline, again = time.monotonic() + STOP_SECONDS, 0.0
            while self.returncode() is None and time.monotonic() < deadline:
                if time.monotonic() >= again:  # again: an interrupt landing in a library's import can be swallowed
                    _signal(os.kill, pid, signal.SIGINT)
                    again = time.monotonic() + INTERRUPT_EVERY
                time.sleep(0.2)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # Ray's processes of a run that ended (or would not)
            if not _signal(os.killpg, pgid, sig):
                break
            time.sleep(1.0)
        if self.process is not None:
            self.process.wait()


def _signal(send: Any, target: int | None, sig: int) -> bool:
    """Send `sig`; whether there was anyone to send it to."""
    if target is None:
        return False
    try:
        send(target, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process under a reused pid: not ours to signal
        return False


class LocalJobs:
    """Submits jobs as `hybridflow run` processes, each in `<workdir>/<name>/` (workdir made absolute now). `env`:
    more environment for the runs (e.g. HYBRIDFLOW_MODEL_CACHE); `ray_temp_dir`: Ray's session directory."""

    def __init__(self, workdir: str | Path = "hybridflow-runs", env: dict[str, str] | None = None,
                 ray_temp_dir: str | None = None, python: str = sys.executable) -> None:
        self.workdir = Path(workdir).resolve()
        self.env, self.ray_temp_dir, self.python = env or {}, ray_temp_dir, python

    def submit(self, source: Source, name: str | None = None) -> LocalJob:
        job = manifest(source, name=name)
        root = self.workdir / job.metadata.name
        if (root / LOG).exists():
            raise FileExistsError(f"{root}: a run of job {job.metadata.name} is there already; give the job another "
                                  "name (submit(..., name=...)), or move that run away")
        root.mkdir(parents=True, exist_ok=True)
        (root / MANIFEST).write_text(yaml.safe_dump(dump_job(job), sort_keys=False))
        cmd = [self.python, "-m", "hybridflow.cli", "run", str(root / MANIFEST), "--checkpoint-dir",
               str(root / CHECKPOINTS), "--metrics-port", "0"]
        if self.ray_temp_dir:
            cmd += ["--ray-temp-dir", self.ray_temp_dir]
        with open(root / LOG, "ab") as log:
            # A session of its own (the supervisor leads it): the run and all it starts end together (`delete`).
            process = subprocess.Popen([self.python, "-m", "hybridflow.client.supervise", str(root), "--", *cmd],
                                       env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while not (root / PID).exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until the run's pid is known: `delete` can stop it from now on
        return LocalJob(job.metadata.name, root, job.spec.trainer.steps, process)

    def get(self, name: str) -> LocalJob:
        """A run under workdir by its job's name, started by this client or any other."""
        root = self.workdir / name
        if not (root / MANIFEST).exists():
            raise FileNotFoundError(f"{root}: no run of job {name} here")
        return LocalJob(name, root, manifest(root / MANIFEST).spec.trainer.steps)


def _last_error(log: Path, rc: int) -> str:
    """The run's own last words (its log's tail), with its exit code."""
    tail = log.read_text(errors="replace")[-20000:] if log.exists() else ""
    return f"exit code {rc}: {last_error(tail)}"
