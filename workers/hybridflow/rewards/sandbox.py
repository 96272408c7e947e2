"""A user's reward function, run as untrusted code: in separate processes, with a deadline per call.

The function has verl's signature, `compute_score(data_source, solution_str, ground_truth, extra_info)`, and returns a
number or a dict with a numeric `score` (its other numeric keys become per-sample metrics). With `batched` it takes
lists and returns a list. It runs in worker processes that never see the driver's memory, start from an environment
with no credentials in it (only SAFE_ENV), in an empty working directory; a call that raises, returns
something that is not a score, or runs past its deadline scores `error_score` and is reported with its sample. A
worker that timed out is killed and replaced, so a function that hangs once costs one deadline, not the job.

This is process isolation, not a security boundary against a hostile author: the code runs as the job's own user,
with the job's files and network. It is meant for a job author's own reward code, so that their bugs cannot hang or
crash the training loop.
"""
from __future__ import annotations

import ast
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Any, Sequence

# The environment a reward worker starts from: nothing else of the driver's (tokens, keys, Ray's addresses) is passed.
SAFE_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "HOME")
SIGNATURE = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFileError(ValueError):
    """The reward file cannot be used: missing, not Python, no such function, or the wrong signature."""


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


def check_reward_file(path: str | Path, name: str, batched: bool = False) -> None:
    """What can be checked without running the user's code: the file exists, parses, defines `name` at top level
    taking verl's four arguments (data_source, solution_str, ground_truth, extra_info) by position. Raises RewardFileError naming the file (and line)."""
    p = Path(path)
    if not p.is_file():
        raise RewardFileError(f"{p}: reward file not found")
    try:
        tree = ast.parse(p.read_text(), filename=str(p))
    except SyntaxError as err:
        raise RewardFileError(f"{p}:{err.lineno}: syntax error: {err.msg}") from None
    except UnicodeDecodeError as err:
        raise RewardFileError(f"{p}: not a text file ({err})") from None
    fns = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if name not in fns:
        found = ", ".join(sorted(fns)) or "none"
        raise RewardFileError(f"{p}: no top-level function '{name}' (functions found: {found})")
    fn = fns[name]
    if isinstance(fn, ast.AsyncFunctionDef):
        raise RewardFileError(f"{p}:{fn.lineno}: '{name}' is async; write a plain function")
    a = fn.args  # called positionally with four arguments: parameter names are the author's
    positional = [x.arg for x in a.posonlyargs + a.args]
    required = len(positional) - len(a.defaults)
    required_kwonly = [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    if (len(positional) < len(SIGNATURE) and a.vararg is None) or required > len(SIGNATURE) or required_kwonly:
        raise RewardFileError(
            f"{p}:{fn.lineno}: '{name}' must accept ({', '.join(SIGNATURE)})"
            + (" as lists (batched: true)" if batched else "") + f"; it takes ({', '.join(positional)})")


def _score_of(value: Any) -> tuple[float, dict[str, float]]:
    """A result -> (score, extra metrics); ValueError says what was wrong with it."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys: {sorted(value)})")
        extras = {k: float(v) for k, v in value.items()
                  if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"returned {type(value).__name__} {value!r:.80}, not a number")
    if not math.isfinite(float(value)):
        raise ValueError(f"returned {value}, not a finite number")
    return float(value), extras


def _worker_main(path: str, name: str, cpu_seconds: int) -> None:
    """The reward worker (`python -m hybridflow.rewards.sandbox PATH NAME CPU`): load the file once, then answer
    calls until the driver closes the pipe. The protocol runs on the original stdin/stdout; the user's prints go
    to stderr."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    conn_in, conn = Connection(proto_in, writable=False), Connection(proto_out, readable=False)
    if cpu_seconds:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    try:
        namespace: dict[str, Any] = {"__name__": "hybridflow_user_reward", "__file__": path}
        exec(compile(Path(path).read_text(), path, "exec"), namespace)  # noqa: S102 - the point: run the user's file
        fn = namespace[name]
        if not callable(fn):
            raise TypeError(f"'{name}' is not a function")
        conn.send(("ready", None))
    except BaseException as err:  # noqa: BLE001 - whatever the file does at import is reported, not raised here
        conn.send(("load-error", _describe(err)))
        return
    while True:
        try:
            args = conn_in.recv()
        except EOFError:
            return
        try:
            result = fn(*args)
        except BaseException as err:  # noqa: BLE001 - a user's exception is a result, reported with its sample
            conn.send(("error", _describe(err)))
            continue
        try:
            conn.send(("ok", result))
        except Exception as err:  # noqa: BLE001 - e.g. an object that cannot be pickled
            conn.send(("error", f"returned {type(result).__name__}, which cannot be sent back: {err}"))


def _describe(err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != __file__]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


class _Proc:
    """One worker process, started with only SAFE_ENV of the driver's environment, in an empty directory."""

    def __init__(self, path: str, name: str, cpu_seconds: int, workdir: str) -> None:
        env = {k: v for k, v in os.environ.items() if k in SAFE_ENV}
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridflow.rewards.sandbox", path, name, str(cpu_seconds)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=workdir,
                                     start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.send_conn = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.conn = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()

    def send(self, obj: Any) -> None:
        self.send_conn.send(obj)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # and anything the user's code started
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.send_conn.close()
        self.conn.close()


class RewardFunction:
    """A pool of reward worker processes running one user function; `score` fans a batch out over them."""

    def __init__(self, path: str | Path, name: str = "compute_score", batched: bool = False, workers: int = 2,
                 timeout_seconds: float = 10.0, error_score: float = 0.0, load_timeout_seconds: float = 60.0) -> None:
        self.path, self.name, self.batched = str(Path(path).resolve()), name, batched
        check_reward_file(self.path, name, batched)
        self.timeout, self.error_score = timeout_seconds, error_score
        self.cpu_seconds = 0  # no RLIMIT_CPU: it counts a worker's whole life; the per-call deadline is the limit
        self._workdir = tempfile.mkdtemp(prefix="reward-")
        self._load_timeout = load_timeout_seconds
        self._procs = [self._start() for _ in range(1 if batched else max(1, workers))]

    def _start(self) -> _Proc:
        p = _Proc(self.path, self.name, self.cpu_seconds, self._workdir)
        if not p.conn.poll(self._load_timeout):
            p.kill()
            raise RewardFileError(f"{self.path}: loading took longer than {self._load_timeout:.0f} s")
        kind, detail = p.conn.recv()
        if kind != "ready":
            p.kill()
            raise RewardFileError(f"{self.path}: loading it failed: {detail}")
        return p

    def close(self) -> None:
        for p in self._procs:
            p.kill()
        self._procs = []
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "RewardFunction":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def score(self, data_sources: Sequence[str], solutions: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict[str, Any]]) -> RewardResult:
        n = len(solutions)
        if self.batched:
            return self._score_batched(list(data_sources), list(solutions), list(ground_truths), list(extra_infos))
        results: list[tuple[float, dict[str, float]] | RewardError | None] = [None] * n
        pending = list(range(n))
        busy: dict[int, tuple[int, float]] = {}  # proc slot -> (sample, deadline)
        while pending or busy:
            for slot in range(len(self._procs)):
                if slot not in busy and pending:
                    i = pending.pop(0)
                    self._procs[slot].send((data_sources[i], solutions[i], ground_truths[i], extra_infos[i]))
                    busy[slot] = (i, time.monotonic() + self.timeout)
            ready = wait_for_any([self._procs[s].conn for s in busy],
                                       timeout=max(0.0, min(d for _, d in busy.values()) - time.monotonic()))
            now = time.monotonic()
            for slot, (i, deadline) in list(busy.items()):
                conn = self._procs[slot].conn
                if conn in ready:
                    try:
                        kind, value = conn.recv()
                    except EOFError:  # the worker died (os._exit, a signal, its CPU limit)
                        kind, value = "error", "the reward worker process died"
                        self._replace(slot)
                    results[i] = self._result(i, kind, value, solutions, ground_truths)
                    del busy[slot]
                elif now >= deadline:
                    results[i] = RewardError(i, solutions[i], ground_truths[i], f"timed out after {self.timeout:g} s")
                    self._replace(slot)
                    del busy[slot]
        return self._collect(results)

    def _score_batched(self, sources: list[str], solutions: list[str], truths: list[Any],
                       infos: list[dict[str, Any]]) -> RewardResult:
        n = len(solutions)
        proc = self._procs[0]
        proc.send((sources, solutions, truths, infos))
        limit = self.timeout * max(1, n)
        if not proc.conn.poll(limit):
            self._replace(0)
            err = f"the batch timed out after {limit:g} s"
            return self._collect([RewardError(i, solutions[i], truths[i], err) for i in range(n)])
        try:
            kind, value = proc.conn.recv()
        except EOFError:
            self._replace(0)
            kind, value = "error", "the reward worker process died"
        if kind == "ok" and not (isinstance(value, (list, tuple)) and len(value) == n):
            kind, value = "error", f"a batched function must return a list of {n} scores, got {type(value).__name__}"
        if kind != "ok":
            return self._collect([RewardError(i, solutions[i], truths[i], str(value)) for i in range(n)])
        return self._collect([self._result(i, "ok", v, solutions, truths) for i, v in enumerate(value)])

    def _result(self, i: int, kind: str, value: Any, solutions: Sequence[str],
                truths: Sequence[Any]) -> tuple[float, dict[str, float]] | RewardError:
        if kind != "ok":
            return RewardError(i, solutions[i], truths[i], str(value))
        try:
            return _score_of(value)
        except ValueError as err:
            return RewardError(i, solutions[i], truths[i], str(err))

    def _replace(self, slot: int) -> None:
        self._procs[slot].kill()
        self._procs[slot] = self._start()

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


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
