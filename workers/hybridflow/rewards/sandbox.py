"""A user's reward function, run as untrusted code: in separate processes inside the OS sandbox
(hybridflow.sandbox), with a deadline per call.

The function has verl's signature, `compute_score(data_source, solution_str, ground_truth, extra_info)`, and returns a
number or a dict with a numeric `score` (its other numeric keys become per-sample metrics). With `batched` it takes
lists and returns a list. Parameters named as verl names them are passed by keyword (as verl does), otherwise by
position. A call that raises, returns something that is not a score, runs past its deadline, or is stopped by one
of the sandbox's limits scores `error_score` and is reported with its sample. A worker that timed out or died is
killed and replaced (with everything it started: its PID namespace goes with it), so a function that hangs once
costs one deadline, not the job.

Each worker is a sandbox of its own (see hybridflow.sandbox for what each layer stops): no network, its own PID
namespace and /proc, a read-only view of the machine with a private /tmp (the reward file's directory is visible,
read-only), another uid, rlimits, and an environment with none of the driver's credentials (only SAFE_ENV). The
driver sends it the file's source and only ever reads plain floats and strings back: it never unpickles the user's
objects. Where the machine lacks a layer (no bwrap, user namespaces refused) the job warns once, when the function
starts, and runs with the layers that remain, unless the sandbox is required (`require_sandbox`, or
HYBRIDFLOW_SANDBOX=require), which refuses to start.

This module is the driver's side (the pool of workers, deadlines, replacing dead workers); what runs inside each
sandbox is hybridflow.rewards.worker, and the checks made before any worker starts are hybridflow.rewards.reward_file.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Any, Sequence

from hybridflow import sandbox
from hybridflow.rewards import worker
from hybridflow.rewards.reward_file import RewardFileError, check_reward_file
from hybridflow.sandbox import Limits, SandboxUnavailable

__all__ = ["Limits", "RewardError", "RewardFileError", "RewardFunction", "RewardResult", "SandboxUnavailable",
           "check_reward_file"]

WORKER_DIED = "the reward worker process died"
# The driver's variables a reward worker starts with: nothing else of the driver's (tokens, keys, Ray's addresses) is
# passed; HOME and TMPDIR are the worker's own private directory.
SAFE_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH")
# The module each worker runs (`python -m`), named from the module itself so that the command line and the check
# below cannot drift apart from where the worker's code is.
WORKER_MODULE = worker.__name__
# What a sandbox must be able to run for a worker to start: the interpreter and the worker's imports.
WORKER_CHECK = (sys.executable, "-c", f"import {WORKER_MODULE}; print('ok')")


@dataclass(frozen=True)
class RewardError:
    index: int  # the sample's position in the batch
    solution: str
    ground_truth: Any
    error: str  # the exception (last line of its traceback), 'timed out after Ns', or what was returned

    def __str__(self) -> str:
        sol = self.solution if len(self.solution) <= 200 else self.solution[:200] + "..."
        return f"sample {self.index} (ground truth {self.ground_truth!r}, response {sol!r}): {self.error}"


@dataclass
class RewardResult:
    scores: list[float]
    extras: dict[str, list[float]] = field(default_factory=dict)  # per-sample metrics from dict results
    errors: list[RewardError] = field(default_factory=list)



class _Proc:
    """One worker process in a sandbox of its own, started with only SAFE_ENV of the driver's environment."""

    def __init__(self, path: str, name: str, source: str, limits: Limits, layers: sandbox.Layers) -> None:
        argv = [sys.executable, "-m", WORKER_MODULE, path, name]
        self.box = sandbox.spawn(argv, limits, layers, env=sandbox.clean_env(SAFE_ENV), binds=_code_binds(path),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.proc = self.box.popen
        self.cpu_seconds = 0.0  # the worker's own CPU time, from its last reply
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.send_conn = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.conn = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        try:
            self.send(("load", source))
        except OSError:  # it died at once: its load reports it
            pass

    def send(self, obj: Any) -> None:
        self.send_conn.send(obj)

    def recv(self) -> tuple[str, Any]:
        """A reply, or ('error', why) when the worker died or sent something unreadable."""
        try:
            kind, value, cpu = self.conn.recv()
            self.cpu_seconds = float(cpu)
            return kind, value
        except (EOFError, OSError):
            return "error", self._death()
        except Exception as err:  # noqa: BLE001 - a garbled reply is that sample's error, not the job's
            return "error", f"unreadable reply from the reward worker: {err}"

    def _death(self) -> str:
        """WORKER_DIED and how: its exit status or signal (bwrap exits 128 + the signal of what it ran)."""
        try:
            rc = self.proc.wait(2)
        except subprocess.TimeoutExpired:
            return WORKER_DIED
        sig = -rc if rc < 0 else rc - 128 if self.box.layers.bwrap and rc > 128 else 0
        if not sig:
            return f"{WORKER_DIED} (exit status {rc})"
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        why = {signal.SIGKILL: ": its CPU-time limit, or killed", signal.SIGXCPU: ": its CPU-time limit",
               signal.SIGXFSZ: ": its file-size limit"}.get(sig, "")
        return f"{WORKER_DIED} ({name}{why})"

    def kill(self) -> None:
        self.box.kill()  # and everything the user's code started: the sandbox's PID namespace goes with it
        self.send_conn.close()
        self.conn.close()


def _code_binds(path: str) -> list[str]:
    """What of the machine a worker sees beside the read-only root: the reward file's directory (its data files, by
    `__file__`), or the file alone where that directory holds the driver's home or the sandbox's own mounts."""
    d = os.path.dirname(path)
    special = [*sandbox.default_hidden(), *sandbox.PRIVATE_TMP, "/dev", "/proc"]
    return [path] if any(sandbox.is_under(h, d) for h in special) else [d]


class RewardFunction:
    """A pool of reward worker processes running one user function; `score` fans a batch out over them."""

    def __init__(self, path: str | Path, name: str = "compute_score", batched: bool = False, workers: int = 2,
                 timeout_seconds: float = 10.0, error_score: float = 0.0, load_timeout_seconds: float = 60.0,
                 limits: Limits | None = None, require_sandbox: bool | None = None,
                 layers: sandbox.Layers | None = None) -> None:
        """limits: each worker's rlimits (default: hybridflow.sandbox.Limits, with at least twice the deadline in
        CPU seconds); require_sandbox: refuse to start (SandboxUnavailable) where the machine lacks a layer of the
        sandbox (None: HYBRIDFLOW_SANDBOX=require says so), instead of warning once and going on without it;
        layers: the kind of sandbox (default: the best this machine offers, hybridflow.sandbox.probe)."""
        self.path, self.name, self.batched = str(Path(path).resolve()), name, batched
        check_reward_file(self.path, name, batched)
        self.source = Path(self.path).read_text()  # what every worker runs, even if the file changes meanwhile
        self.timeout, self.error_score = timeout_seconds, error_score
        self.limits = limits or Limits(cpu_seconds=max(Limits.cpu_seconds, int(math.ceil(2 * timeout_seconds))))
        self.layers = layers or sandbox.probe(WORKER_CHECK)
        sandbox.check_required(self.layers, f"the reward function {self.path}:{name}", require_sandbox)
        self._load_timeout = load_timeout_seconds
        self._procs: list[_Proc] = []
        try:
            for _ in range(1 if batched else max(1, workers)):
                self._procs.append(self._start())
        except BaseException:
            self.close()
            raise

    def _start(self) -> _Proc:
        p = _Proc(self.path, self.name, self.source, self.limits, self.layers)
        if not p.conn.poll(self._load_timeout):
            p.kill()
            raise RewardFileError(f"{self.path}: loading took longer than {self._load_timeout:.0f} s")
        kind, detail = p.recv()
        if kind != "ready":
            p.kill()
            raise RewardFileError(f"{self.path}: loading it failed: {detail}")
        return p

    def close(self) -> None:
        for p in self._procs:
            p.kill()
        self._procs = []

    def __enter__(self) -> "RewardFunction":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def score(self, data_sources: Sequence[str], solutions: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict[str, Any]]) -> RewardResult:
        if self.batched:
            return self._score_batched(list(data_sources), list(solutions), list(ground_truths), list(extra_infos))
        n = len(solutions)
        results: list[tuple[float, dict[str, float]] | RewardError | None] = [None] * n
        pending = list(range(n))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (sample, deadline)
        try:
            while pending or busy:
                for slot in range(len(self._procs)):
                    if slot not in busy and pending:
                        i = pending.pop(0)
                        self._send(slot, (data_sources[i], solutions[i], ground_truths[i], extra_infos[i]))
                        busy[slot] = (i, time.monotonic() + self.timeout)
                ready = wait_for_any([self._procs[s].conn for s in busy],
                                     timeout=max(0.0, min(d for _, d in busy.values()) - time.monotonic()))
                now = time.monotonic()
                for slot, (i, deadline) in list(busy.items()):
                    if self._procs[slot].conn in ready:
                        kind, value = self._recv(slot)
                        results[i] = self._result(i, kind, value, solutions, ground_truths)
                        del busy[slot]
                    elif now >= deadline:
                        results[i] = RewardError(i, solutions[i], ground_truths[i],
                                                 f"timed out after {self.timeout:g} s")
                        self._replace(slot)
                        del busy[slot]
        finally:
            for slot in busy:  # left abnormally: a late reply must never be read as another sample's
                self._replace(slot, must_start=False)
        return self._collect(results)

    def _score_batched(self, sources: list[str], solutions: list[str], truths: list[Any],
                       infos: list[dict[str, Any]]) -> RewardResult:
        n = len(solutions)
        limit = self.timeout * max(1, n)
        self._send(0, (sources, solutions, truths, infos))
        if not self._procs[0].conn.poll(limit):
            self._replace(0)
            kind, value = "error", f"the batch timed out after {limit:g} s"
        else:
            kind, value = self._recv(0)
        if kind != "ok":
            return self._collect([RewardError(i, solutions[i], truths[i], str(value)) for i in range(n)])
        return self._collect([self._result(i, "ok", v, solutions, truths) for i, v in enumerate(value)])

    def _result(self, i: int, kind: str, value: Any, solutions: Sequence[str],
                truths: Sequence[Any]) -> tuple[float, dict[str, float]] | RewardError:
        """The worker already turned the user's result into (score, extras) or an error string."""
        if kind == "ok" and isinstance(value, tuple):
            return (float(value[0]), {str(k): float(v) for k, v in value[1].items()})
        return RewardError(i, solutions[i], truths[i], str(value))

    def _send(self, slot: int, call: tuple[Any, ...]) -> None:
        try:
            if self._procs[slot].proc.poll() is not None:  # its sandbox is gone, the worker with it (or going)
                raise BrokenPipeError
            self._procs[slot].send(call)
        except OSError:  # the worker died while idle: a new one takes the call
            self._replace(slot)
            self._procs[slot].send(call)

    def _recv(self, slot: int) -> tuple[str, Any]:
        p = self._procs[slot]
        kind, value = p.recv()
        if kind == "error" and str(value).startswith(WORKER_DIED):
            self._replace(slot)
        elif p.cpu_seconds > self.limits.cpu_seconds / 2:
            # RLIMIT_CPU counts a worker's whole life: a fresh one takes over before the next call could hit it
            self._replace(slot)
        return kind, value

    def _replace(self, slot: int, must_start: bool = True) -> None:
        self._procs[slot].kill()
        try:
            self._procs[slot] = self._start()
        except RewardFileError:
            if must_start:
                raise

    def _collect(self, results: list[Any]) -> RewardResult:
        out = RewardResult(scores=[])
        keys = sorted({k for r in results if isinstance(r, tuple) for k in r[1]})
        out.extras = {k: [] for k in keys}
        for r in results:
            if isinstance(r, RewardError):
                out.errors.append(r)
                out.scores.append(self.error_score)
                extras: dict[str, float] = {}
            else:
                out.scores.append(r[0])
                extras = r[1]
            for k in keys:
                out.extras[k].append(extras.get(k, float("nan")))
        return out
