"""Tools and environment sessions in OS sandboxes on this machine (hybridflow.sandbox: no network, no credentials,
another uid, rlimits, a PID namespace that takes everything started in it along when it is killed).

A tool call gets a fresh sandbox and a deadline: a call that hangs is killed at its deadline and answers "timed
out", one that forks or fills memory meets the sandbox's limits and answers with its error; the episode goes on.
An environment session is one sandbox for the episode's life (the environment object keeps its state between
steps), each step with its deadline; a step that fails ends its episode, reported, never the rollout."""
from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hybridflow import sandbox
from hybridflow import wire
from hybridflow.agents import env_worker, tool_worker
from hybridflow.agents.protocol import EnvironmentLoadError, Info, Observation, ToolResult
from hybridflow.agents.registry import ToolSpec
from hybridflow.sandbox import Limits

TOOL_MODULE, ENV_MODULE = tool_worker.__name__, env_worker.__name__
LOAD_SECONDS = 60.0  # what an environment session gives its file to load (a tool call's file: the call's deadline)
WORKER_CHECK = (sys.executable, "-c", f"import {TOOL_MODULE}, {ENV_MODULE}; print('ok')")


@dataclass(frozen=True)
class EnvironmentCode:
    """Where an environment's class is: a built-in's "module:class", or a user's file (its source read once, so
    every session runs the same code even if the file changes) and class name."""

    target: str | None = None
    path: str | None = None
    source: str | None = None
    class_name: str = "Environment"

    @classmethod
    def from_file(cls, path: str | Path, class_name: str) -> "EnvironmentCode":
        p = Path(path).resolve()
        return cls(path=str(p), source=p.read_text(), class_name=class_name)

    def request(self) -> Info:
        if self.target:
            return {"target": self.target}
        return {"path": self.path, "source": self.source, "class": self.class_name}


class _Worker:
    """A sandboxed worker process and the driver's end of its pipes (tools, environment sessions, file checks, and
    agent programs: hybridflow.agents.program). `binds`: more paths bound in read-only, beside `code_path`'s
    (sandbox.code_binds of each: an agent program's endpoint socket); `name`: the worker as its errors call it;
    `stderr`: where its stderr goes (a pipe: the caller reads it, as an agent program's runner does)."""

    def __init__(self, module: str, limits: Limits, layers: sandbox.Layers, code_path: str | None,
                 private: Sequence[str], binds: Sequence[str] = (), name: str = "the worker",
                 stderr: int = subprocess.DEVNULL) -> None:
        bound = [b for path in (code_path, *binds) if path for b in sandbox.code_binds(path)]
        self.name = name
        self.box = sandbox.spawn(sandbox.python_module(module), limits, layers, env=sandbox.clean_env(),
                                 binds=sorted(set(bound)), private=private,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        assert self.box.popen.stdin is not None and self.box.popen.stdout is not None
        self.reader = wire.LineReader(self.box.popen.stdout.fileno())

    def call(self, message: Info, timeout: float) -> Info:
        assert self.box.popen.stdin is not None
        try:
            wire.send(self.box.popen.stdin, message)
        except OSError as err:
            raise wire.WireError(f"{self.name} is gone ({err})") from None
        return self.reader.receive(timeout)

    def death(self, grace: float = 2.0) -> str:
        """How the worker ended, for the report, once its pipe failed: a worker whose code exited closed its pipe a
        moment before the sandbox's launcher exits with its status, so that status is waited for up to `grace`
        seconds (under load the launcher ends later than the pipe closes, and the report said "it stopped
        answering" of a worker that had exited: the flake of test_agent_bad_input's sandbox-killing file)."""
        try:
            rc = self.box.popen.wait(grace)
        except subprocess.TimeoutExpired:
            rc = None
        if rc is None:
            return "it stopped answering"
        sig = self.box.signal_of(rc)
        return f"it was killed by signal {sig} (a sandbox limit)" if sig else f"it exited with status {rc}"

    def kill(self) -> None:
        self.box.kill(wait=2)
        for stream in (self.box.popen.stdin, self.box.popen.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


def _probe(require: bool | None, what: str, check: Sequence[str] = WORKER_CHECK) -> sandbox.Layers:
    """The sandbox's layers on this machine, found by running `check` (a worker's imports) in one; refused as
    SandboxUnavailable where `require` (or the environment's HYBRIDFLOW_SANDBOX) requires them all."""
    layers = sandbox.probe(check)
    sandbox.check_required(layers, what, require)
    return layers


class LocalTools:
    """The job's tools, each call in a fresh sandbox with `timeout_seconds`; `private`: the job's paths the tools
    must not read (data_files.job_private_paths: its prompt files and checkpoints)."""

    def __init__(self, tools: dict[str, ToolSpec], timeout_seconds: float = 10.0, limits: Limits | None = None,
                 require_sandbox: bool | None = None, layers: sandbox.Layers | None = None,
                 private: Sequence[str] = ()) -> None:
        self.tools, self.timeout, self.private = tools, timeout_seconds, tuple(private)
        self.limits = limits or Limits(cpu_seconds=max(2, int(2 * timeout_seconds)), memory_bytes=2 << 30,
                                       processes=32)
        self.layers = layers or _probe(require_sandbox, "the agent's tools")
        self._sources = {n: Path(t.path).read_text() for n, t in tools.items() if t.path}

    def call(self, name: str, arguments: Info, session: str | None = None) -> ToolResult:
        t0 = time.monotonic()
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"Error: no tool named {name!r}; the tools are {', '.join(sorted(self.tools))}.",
                              error=f"unknown tool {name!r}")
        request: Info = {"arguments": arguments}
        request.update({"target": tool.target} if tool.target else
                       {"path": tool.path, "source": self._sources[name], "function": name})
        # Whether the call crashed is decided here, not by the sandboxed process (it runs the model's code too: the
        # python built-in, a user's tool that runs code). Only a user's tool can crash (ToolResult.crashed): its file
        # did not load (no "loaded" line came first, or its sandbox died before one), or its call raised what the
        # worker marks `broken` (NameError, or ImportError at an import line, of the file itself). That mark is the
        # one thing read from the reply: a user's tool that runs the model's code in its own process lets it forge it
        user = not tool.target
        try:
            worker = _Worker(TOOL_MODULE, self.limits, self.layers, tool.path, self.private)
        except OSError as err:  # the machine could not start a sandbox (no processes or files left): not the tool's
            return ToolResult(f"Error: the {name} tool could not start: {err}.", error=f"could not start: {err}",
                              seconds=time.monotonic() - t0, unavailable=True)
        deadline, loaded = time.monotonic() + self.timeout, False  # loading the file and the call: one deadline
        try:
            reply = worker.call(request, self.timeout)
            if reply.get("loaded") is True:
                loaded = True
                reply = worker.reader.receive(max(0.0, deadline - time.monotonic()))
        except wire.WireTimeout:
            return ToolResult(f"Error: the {name} tool timed out after {self.timeout:g} s"
                              f"{'' if loaded else ' (its file was still loading)'}.", error="timed out",
                              timed_out=True, seconds=time.monotonic() - t0)
        except wire.WireError as err:
            why = f"{err}; {worker.death()}" + ("" if loaded else " while its file was loading")
            return ToolResult(f"Error: the {name} tool failed: {why}.", error=why, seconds=time.monotonic() - t0,
                              crashed=user and not loaded)
        finally:
            worker.kill()
        seconds = time.monotonic() - t0
        if loaded and "ok" in reply:  # cut again: the tool's code may have written this reply itself
            return ToolResult(tool_worker.cut(str(reply["ok"])), seconds=seconds)
        error = tool_worker.cut(str(reply.get("error")))  # before "loaded": the file's load failure
        return ToolResult(f"Error: {error}", error=error, seconds=seconds,
                          crashed=user and (not loaded or reply.get("broken") is True))

    def close(self) -> None:
        """Nothing lives between calls."""


class LocalSessions:
    """Environment sessions, each a sandbox of its own for its episode's life."""

    def __init__(self, code: EnvironmentCode, step_timeout_seconds: float = 10.0,
                 load_timeout_seconds: float = LOAD_SECONDS,
                 limits: Limits | None = None, require_sandbox: bool | None = None,
                 layers: sandbox.Layers | None = None, private: Sequence[str] = ()) -> None:
        self.code, self.timeout, self.load_timeout = code, step_timeout_seconds, load_timeout_seconds
        self.private = tuple(private)
        self.limits = limits or Limits(cpu_seconds=600, memory_bytes=2 << 30, processes=32)
        self.layers = layers or _probe(require_sandbox, "the agent's environment")
        self._open: dict[str, _Worker] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def open(self, sample: Info) -> tuple[str, Observation]:
        worker = _Worker(ENV_MODULE, self.limits, self.layers, self.code.path, self.private)
        with self._lock:
            sid = f"s{next(self._ids)}"
            self._open[sid] = worker
        try:
            try:
                loaded = worker.call(self.code.request(), self.load_timeout)
            except wire.WireError as err:  # its file hangs or kills its sandbox loading: this episode's reset fails
                why = (f"took more than {self.load_timeout:g} s" if isinstance(err, wire.WireTimeout) else
                       f"failed: {err}; {worker.death()}")
                self.close(sid)
                return sid, Observation("", done=True, error=f"loading the environment's file {why}")
            if "error" in loaded:
                raise EnvironmentLoadError(f"the environment could not be loaded: {loaded['error']}")
            first = self._call(sid, {"op": "reset", "sample": sample}, "reset")
        except BaseException:
            self.close(sid)
            raise
        if first.error:
            self.close(sid)
        return sid, first

    def step(self, session: str, action: str) -> Observation:
        out = self._call(session, {"op": "step", "action": action}, "step")
        if out.done:
            self.close(session)
        return out

    def _call(self, session: str, message: Info, what: str) -> Observation:
        worker = self._open.get(session)
        if worker is None:
            return Observation("", done=True, error=f"session {session} is closed")
        try:
            reply = worker.call(message, self.timeout)
        except wire.WireTimeout:
            self.close(session)
            return Observation("", done=True, error=f"the environment's {what} timed out after {self.timeout:g} s")
        except wire.WireError as err:
            why = worker.death()
            self.close(session)
            return Observation("", done=True, error=f"the environment's {what} failed: {err}; {why}")
        if "error" in reply:
            self.close(session)
            return Observation("", done=True, error=f"the environment's {what} raised {reply['error']}")
        try:
            return Observation.from_json(reply)
        except Exception as err:  # noqa: BLE001 - whatever the worker answered, it ends that episode only
            self.close(session)
            return Observation("", done=True, error=f"the environment's {what} answered something unusable: {err}")

    def close(self, session: str) -> None:
        with self._lock:
            worker = self._open.pop(session, None)
        if worker is not None:
            worker.kill()

    def shutdown(self) -> None:
        for sid in list(self._open):
            self.close(sid)
