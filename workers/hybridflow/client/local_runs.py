"""The client's calls on this machine: a job is a `hybridflow run` of it in a process of its own, in a directory of
its own under the client's workdir (`<workdir>/<name>/`: the manifest it ran, `driver.log`, `checkpoints/`), so a
script tried on a laptop talks to its runs as it will talk to a cluster's jobs (hybridflow.client.cluster)."""
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


class LocalJob:
    """One local run (the Job protocol). `process` is None for a run this client did not start (`LocalJobs.get`):
    its state is then read from its files alone."""

    def __init__(self, name: str, root: Path, total_steps: int, process: subprocess.Popen | None = None) -> None:
        self.name, self.root, self.total_steps, self.process = name, root, total_steps, process

    @property
    def checkpoint_dir(self) -> str:
        return str(self.root / CHECKPOINTS)

    def _returncode(self) -> int | None:
        if self.process is not None:
            return self.process.poll()
        done = self.root / "returncode"
        return int(done.read_text()) if done.exists() else None

    def status(self) -> Snapshot:
        records = self.steps()
        last = records[-1] if records else {}
        rc = self._returncode()
        phase = (Phase.SUCCEEDED if rc == 0 else Phase.FAILED if rc is not None else
                 Phase.RUNNING if records else Phase.INITIALIZING)
        message = "" if rc in (None, 0) else _last_error(self.root / LOG, rc)
        found = storage.checkpoints(self.checkpoint_dir) if (self.root / CHECKPOINTS).exists() else []
        return Snapshot(phase=phase, step=int(last.get("step", 0)), total_steps=self.total_steps,
                        tokens_per_second=float(last.get("throughput_tokens_per_s", 0.0)),
                        eta_seconds=last.get("eta_seconds"), message=message,
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
        path = self.root / LOG
        with open(path, errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    yield line.rstrip("\n")
                elif not follow or self._returncode() is not None:
                    rest = f.read()  # what the run wrote between the last read and its end
                    yield from rest.splitlines()
                    return
                else:
                    time.sleep(0.2)

    def steps(self) -> list[dict[str, Any]]:
        return storage.steps(self.checkpoint_dir) if (self.root / CHECKPOINTS).exists() else []

    def checkpoints(self) -> list[str]:
        return storage.checkpoints(self.checkpoint_dir) if (self.root / CHECKPOINTS).exists() else []

    def export(self, to: str | Path, checkpoint: str | None = None, role: str = "actor",
               dtype: str | None = None) -> Path:
        return storage.export(self.checkpoint_dir, to, checkpoint, role, dtype)

    def delete(self) -> None:
        """End the run (SIGTERM to its process group: the driver saves nothing half-written and Ray goes with it)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class LocalJobs:
    """Submits jobs as `hybridflow run` processes under `workdir`. `env`: more environment for the runs (e.g.
    HYBRIDFLOW_MODEL_CACHE); `ray_temp_dir`: Ray's session directory (default: Ray's)."""

    def __init__(self, workdir: str | Path = "hybridflow-runs", env: dict[str, str] | None = None,
                 ray_temp_dir: str | None = None, python: str = sys.executable) -> None:
        self.workdir, self.env, self.ray_temp_dir, self.python = Path(workdir), env or {}, ray_temp_dir, python

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
            # Its own session: the run and everything it starts (Ray) end together (`delete`).
            process = subprocess.Popen(cmd, cwd=root, env={**os.environ, **self.env}, stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        _ReturnCodeKeeper(process, root / "returncode")
        return LocalJob(job.metadata.name, root, job.spec.trainer.steps, process)

    def get(self, name: str) -> LocalJob:
        """A run under workdir by its job's name (one this process did not start: its state from its files)."""
        root = self.workdir / name
        if not (root / MANIFEST).exists():
            raise FileNotFoundError(f"{root}: no run of job {name} here")
        return LocalJob(name, root, manifest(root / MANIFEST).spec.trainer.steps)


class _ReturnCodeKeeper:
    """Writes the run's exit code into its directory when it ends, so a later client (`LocalJobs.get`) knows it."""

    def __init__(self, process: subprocess.Popen, path: Path) -> None:
        import threading

        def keep() -> None:
            path.write_text(str(process.wait()))

        threading.Thread(target=keep, daemon=True, name=f"returncode-{process.pid}").start()


def _last_error(log: Path, rc: int) -> str:
    """The run's own last words (its log's tail), with its exit code."""
    tail = log.read_text(errors="replace")[-20000:] if log.exists() else ""
    return f"exit code {rc}: {last_error(tail)}"
