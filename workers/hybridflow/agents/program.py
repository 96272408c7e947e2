"""A user's agent program (spec.rollout.agent.program) run in OS sandboxes on this machine: each episode's run in a
fresh sandbox (hybridflow.sandbox: no network, another uid, rlimits, a PID namespace that takes everything started in
it along), with the job's OpenAI-compatible endpoint reachable through one thing only, its Unix socket, bound into
the sandbox read-only, and the episode's bearer token. The run is killed at its deadline; what the program does
wrong (raises, returns no finite reward, hangs, meets a sandbox limit) is the episode's error, counted against
spec.rollout.agent.maxFailedFraction (loop.PROGRAM); a sandbox that cannot start is the machine's (loop.NOT_RUN).

The socket must be reachable by the sandbox's uid: where the sandbox runs as a fresh uid (the driver is root), the
socket must be writable by others (connect(2) needs write permission on it; its token is the authentication) and
its directory searchable; a read-only bind does not stop a connection (the mount's read-only flag applies to files,
directories and links, never to a socket)."""
from __future__ import annotations

import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Protocol, Sequence

from hybridflow import sandbox, wire
from hybridflow.agents import program_worker
from hybridflow.agents.local import _probe, _Worker
from hybridflow.agents.loop import NOT_RUN, PROGRAM
from hybridflow.agents.protocol import AgentSettings, EndpointAddress, Info, ProgramResult
from hybridflow.sandbox import Limits

PROGRAM_MODULE = program_worker.__name__
WORKER_CHECK = (sys.executable, "-c", f"import {PROGRAM_MODULE}, openai, httpx; print('ok')")
FIELD = "spec.rollout.agent.programTimeoutSeconds"


class ProgramSettings(AgentSettings, Protocol):
    """The agent's settings with its program (spec.rollout.agent.program: hybridflow.api.agents.Agent)."""

    @property
    def program(self) -> str | None: ...


def socket_problem(socket_path: str, layers: sandbox.Layers) -> str | None:
    """Why a sandbox with `layers` could not connect to the endpoint's socket, or None: it is not there, or (the
    sandbox running as a uid of its own) not writable by others or in a directory others cannot search."""
    try:
        st = os.stat(socket_path)
    except OSError as err:
        return f"the endpoint's socket {socket_path} is not there ({err.strerror})"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{socket_path} is not a socket"
    if layers.other_uid:
        if not st.st_mode & stat.S_IWOTH:
            return f"the endpoint's socket {socket_path} is not writable by others (mode {st.st_mode & 0o777:o})"
        d = os.stat(os.path.dirname(socket_path) or ".")
        if not d.st_mode & stat.S_IXOTH:
            return f"the endpoint's socket's directory is not searchable by others (mode {d.st_mode & 0o777:o})"
    return None


class LocalPrograms:
    """The job's agent program, each run in a fresh sandbox; `private`: the job's paths the program must not read
    (its prompt files and checkpoints: the answers it is scored on). `limits`: per run (default: 2 GiB, 32
    processes, CPU seconds twice the run's deadline, as a tool call's)."""

    def __init__(self, path: str | Path, private: Sequence[str] = (), limits: Limits | None = None,
                 require_sandbox: bool | None = None, layers: sandbox.Layers | None = None) -> None:
        p = Path(path).resolve()
        self.path, self.source = str(p), p.read_text()  # read once: every run runs the same code
        self.private, self.limits = tuple(private), limits
        self.layers = layers or _probe(require_sandbox, "the agent program", WORKER_CHECK)
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()

    def run(self, sample: Info, endpoint: EndpointAddress, timeout: float) -> ProgramResult:
        problem = socket_problem(endpoint.socket_path, self.layers)
        if problem:
            return ProgramResult(error=f"the agent program could not run: {problem}", failure=NOT_RUN)
        limits = self.limits or Limits(cpu_seconds=max(10, int(2 * timeout)), memory_bytes=2 << 30, processes=32)
        try:
            box = _Worker(PROGRAM_MODULE, limits, self.layers, self.path, self.private, binds=[endpoint.socket_path],
                          name="the program's sandbox")
        except OSError as err:  # the machine could not start a sandbox (no processes or files left): not the program's
            return ProgramResult(error=f"the agent program's sandbox could not start: {err}", failure=NOT_RUN)
        with self._lock:
            self._live.add(box)
        t0 = time.monotonic()
        request = {"path": self.path, "source": self.source, "sample": sample, "socket_path": endpoint.socket_path,
                   "token": endpoint.token}
        try:
            reply = box.call(request, timeout)
        except wire.WireTimeout:
            return ProgramResult(error=f"the agent program {Path(self.path).name} timed out after {timeout:g} s "
                                 f"({FIELD})", failure=PROGRAM)
        except wire.WireError as err:
            return ProgramResult(error=f"the agent program {Path(self.path).name} failed after "
                                 f"{time.monotonic() - t0:.1f} s: {err}; {box.death()}", failure=PROGRAM)
        finally:
            box.kill()
            with self._lock:
                self._live.discard(box)
        return _result(reply)

    def close(self) -> None:
        """Kills the runs still going (their episodes report them failed); later runs start as before (a rollout
        whose engine failed closes its programs: program_loop.run_program_episodes)."""
        with self._lock:
            live, self._live = list(self._live), set()
        for box in live:
            box.kill()


def _result(reply: Info) -> ProgramResult:
    """The worker's reply as a ProgramResult; what no worker may answer (a forged or garbled reply) is the
    program's error too: its code is the only code in that sandbox."""
    if "error" in reply:
        return ProgramResult(error=str(reply["error"])[:2000], failure=PROGRAM)
    try:
        answer = program_worker.plain_result({**dict(reply.get("metrics") or {}), "reward": reply.get("reward")})
    except (program_worker.BadReturn, TypeError, ValueError) as err:
        return ProgramResult(error=f"the agent program's reply is unusable: {err}", failure=PROGRAM)
    return ProgramResult(reward=answer["reward"], metrics=answer["metrics"])
