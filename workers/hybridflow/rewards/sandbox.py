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
read-only), another uid, rlimits, and an environment with none of the driver's credentials (only SAFE_ENV). Where the
machine lacks a layer (no bwrap, user namespaces refused) the job warns once, when the function starts, and runs with
the layers that remain, unless the sandbox is required (`require_sandbox`, or HYBRIDFLOW_SANDBOX=require), which
refuses to start.

The driver sends a worker the file's source and each call as JSON lines (hybridflow.wire) and reads JSON lines back,
never pickles: the user's code runs in the worker and can write anything onto its pipe (its fds are the user's), so
the driver only parses plain data from it, takes only the line that carries the random id of the call it sent (a
line forged with another id is skipped), checks that again for finite numbers and strings, and replaces a worker
whose pipe carried something that is not JSON (the pipe can no longer be trusted to be in step). The arguments
travel as JSON too: what JSON lacks (a numpy array, a date) reaches the function as its str.

This module is the driver's side (the pool of workers, deadlines, replacing dead workers); what runs inside each
sandbox is hybridflow.rewards.worker, and the checks made before any worker starts are hybridflow.rewards.reward_file.
"""
from __future__ import annotations

import math
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Any, Sequence

from hybridflow import sandbox, wire
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
# How long the pool waits for the rest of a line a worker has begun: the other workers' replies wait meanwhile, so a
# worker that writes half a line and hangs holds the pool this long at a time, and loses its call at its deadline.
LINE_SECONDS = 0.05
# The kinds of reply each request of the driver's takes (hybridflow.rewards.worker sends them).
REPLY_KINDS = {"load": ("ready", "load-error"), "call": ("ok", "error")}


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
    """One worker process in a sandbox of its own, started with only SAFE_ENV of the driver's environment, and the
    driver's end of its pipes: a JSON line each way per request, each request with a fresh random id that its reply
    carries (the user's code cannot guess it, so what it writes onto the pipe is never taken for a reply)."""

    def __init__(self, path: str, name: str, source: str, limits: Limits, layers: sandbox.Layers) -> None:
        argv = sandbox.python_module(WORKER_MODULE, path, name)
        self.box = sandbox.spawn(argv, limits, layers, env=sandbox.clean_env(SAFE_ENV), binds=sandbox.code_binds(path),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.proc = self.box.popen
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.reader = wire.LineReader(self.proc.stdout.fileno())
        self.cpu_seconds = 0.0  # the worker's own CPU time, from its last reply
        self.call_id, self.op = "", "load"
        try:
            self.send({"op": "load", "source": source})
        except OSError:  # it died at once: its load reports it
            pass

    def fileno(self) -> int:
        """The worker's stdout: what multiprocessing.connection.wait waits on."""
        return self.reader.fd

    def has_line(self) -> bool:
        """A whole line already read into the buffer, which waiting on the pipe would not see."""
        return b"\n" in self.reader.buffer

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.call_id, self.op = secrets.token_hex(16), str(message["op"])
        wire.send(self.proc.stdin, {**message, "id": self.call_id})

    def recv(self, timeout: float) -> tuple[str, Any]:
        """The reply to the last request as (kind, value): what the worker sent (one of REPLY_KINDS of the
        request), ('broken', why) when it died or its pipe carried something that is not JSON, ('timeout', None)
        when no whole reply came within `timeout` (half a line included). Lines with another id are skipped."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self.reader.receive(max(0.0, deadline - time.monotonic()))
            except wire.WireTimeout:
                return "timeout", None
            except (wire.WireError, RecursionError) as err:  # RecursionError: JSON nested too deep to parse
                return "broken", self._broken(err)
            if reply.get("id") != self.call_id:
                continue  # written by the user's code, or the reply to a call whose id it forged before
            cpu = _as_float(reply.get("cpu"))
            if cpu is not None:
                self.cpu_seconds = cpu
            kind = reply.get("kind")
            if kind in REPLY_KINDS[self.op]:
                return str(kind), reply.get("value")
            return "error", f"the reward worker sent a {kind!r:.80} reply to a {self.op}"

    def _broken(self, err: Exception) -> str:
        """Why the pipe failed: WORKER_DIED and how, or (the worker still running) that it carried something that
        is not a reply, which only the user's code writes."""
        try:
            rc = self.proc.wait(2)
        except subprocess.TimeoutExpired:
            return (f"the reward worker's pipe carried something that is not a reply ({err}): the reward code "
                    "wrote onto it")
        sig = self.box.signal_of(rc)
        if not sig:
            return f"{WORKER_DIED} (exit status {rc})"
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        why = {signal.SIGKILL: ": its CPU-time limit, or killed", signal.SIGXCPU: ": its CPU-time limit",
               signal.SIGXFSZ: ": its file-size limit"}.get(sig, "")
        return f"{WORKER_DIED} ({name}{why})"

    def kill(self) -> None:
        self.box.kill()  # and everything the user's code started: the sandbox's PID namespace goes with it
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:  # unflushed bytes to a dead worker
                pass


def _as_float(v: Any) -> float | None:
    """A JSON number as a float; None for anything else (a bool, or an int too large for a float)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def _score_pair(value: Any) -> tuple[float, dict[str, float]] | str:
    """The worker's (score, extras) as JSON sent it, checked again here (the user's code may have forged the reply
    by reading its id from the worker's frames; it still gets only finite numbers into the driver), or what was
    wrong with it. A string is the error the worker found."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 2 and isinstance(value[1], dict):
        score, extras = _as_float(value[0]), {str(k): _as_float(v) for k, v in value[1].items()}
        if score is not None and math.isfinite(score) and None not in extras.values():
            return score, {k: v for k, v in extras.items() if v is not None}
    return f"the reward worker's reply is not a score: {value!r:.80}"


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
        kind, detail = p.recv(self._load_timeout)
        if kind == "timeout":
            p.kill()
            raise RewardFileError(f"{self.path}: loading took longer than {self._load_timeout:.0f} s")
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
        late = f"timed out after {self.timeout:g} s"
        try:
            while pending or busy:
                for slot in range(len(self._procs)):
                    if slot not in busy and pending:
                        i = pending.pop(0)
                        self._send(slot, [data_sources[i], solutions[i], ground_truths[i], extra_infos[i]])
                        busy[slot] = (i, time.monotonic() + self.timeout)
                ready = self._wait([self._procs[s] for s in busy], min(d for _, d in busy.values()))
                now = time.monotonic()
                for slot, (i, deadline) in list(busy.items()):
                    p = self._procs[slot]
                    kind, value = p.recv(LINE_SECONDS) if p in ready else ("timeout", None)
                    if kind == "timeout" and now < deadline:
                        continue  # no whole reply yet (what it began stays in its reader)
                    kind, value = self._settle(slot, kind, value, late)
                    results[i] = self._result(i, kind, value, solutions, ground_truths)
                    del busy[slot]
        finally:
            for slot in busy:  # left abnormally: a late reply must never be read as another sample's
                self._replace(slot, must_start=False)
        return self._collect(results)

    def _score_batched(self, sources: list[str], solutions: list[str], truths: list[Any],
                       infos: list[dict[str, Any]]) -> RewardResult:
        n = len(solutions)
        limit = self.timeout * max(1, n)
        self._send(0, [sources, solutions, truths, infos])
        kind, value = self._settle(0, *self._procs[0].recv(limit), f"the batch timed out after {limit:g} s")
        if kind == "ok" and not (isinstance(value, list) and len(value) == n):
            kind, value = "error", f"the reward worker's reply is not a list of {n} results: {value!r:.80}"
        if kind != "ok":
            return self._collect([RewardError(i, solutions[i], truths[i], str(value)) for i in range(n)])
        return self._collect([self._result(i, "ok", v, solutions, truths) for i, v in enumerate(value)])

    def _result(self, i: int, kind: str, value: Any, solutions: Sequence[str],
                truths: Sequence[Any]) -> tuple[float, dict[str, float]] | RewardError:
        """The worker already turned the user's result into (score, extras) or an error string."""
        got = _score_pair(value) if kind == "ok" else str(value)
        return got if isinstance(got, tuple) else RewardError(i, solutions[i], truths[i], got)

    @staticmethod
    def _wait(procs: list[_Proc], deadline: float) -> list[_Proc]:
        """The workers with a reply to read, waiting until the first of them has one or until `deadline`."""
        buffered = [p for p in procs if p.has_line()]
        timeout = 0.0 if buffered else max(0.0, deadline - time.monotonic())
        return buffered + [p for p in wait_for_any(procs, timeout=timeout) if p not in buffered]

    def _send(self, slot: int, args: list[Any]) -> None:
        call = {"op": "call", "args": args}
        try:
            if self._procs[slot].proc.poll() is not None:  # its sandbox is gone, the worker with it (or going)
                raise BrokenPipeError
            self._procs[slot].send(call)
        except OSError:  # the worker died while idle: a new one takes the call
            self._replace(slot)
            self._procs[slot].send(call)

    def _settle(self, slot: int, kind: str, value: Any, late: str) -> tuple[str, Any]:
        """The slot's reply as a result ('timeout' as ('error', late)). A worker that timed out, died or garbled its
        pipe is replaced, and so is one near its RLIMIT_CPU."""
        p = self._procs[slot]
        if kind in ("timeout", "broken"):
            self._replace(slot)
            kind, value = "error", late if kind == "timeout" else value
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
