"""A user's agent program (spec.rollout.agent.program) run in OS sandboxes on this machine: each episode's run in a
fresh sandbox (hybridflow.sandbox: no network, another uid, rlimits, a PID namespace that takes everything started in
it along), with the job's OpenAI-compatible endpoint reachable through one thing only, its Unix socket, bound into
the sandbox read-only, and the episode's bearer token. The run is killed at its deadline; what the program does
wrong (raises, returns no finite reward, hangs, meets a sandbox limit) is the episode's error, counted against
spec.rollout.agent.maxFailedFraction (loop.PROGRAM); a sandbox that cannot start is the machine's (loop.NOT_RUN).
A failed run's error ends with the last lines the program wrote to stderr (its print()s and logging: program_worker
keeps stdout for the reply), at most TAIL_LINES lines and TAIL_CHARS characters, control characters and terminal
escapes removed; a run that succeeds logs nothing of it.

The socket must be reachable by the sandbox's uid: where the sandbox runs as a fresh uid (the driver is root), the
socket must be writable by others (connect(2) needs write permission on it; its token is the authentication) and
its directory searchable; a read-only bind does not stop a connection (the mount's read-only flag applies to files,
directories and links, never to a socket)."""
from __future__ import annotations

import os
import re
import select
import stat
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Protocol, Sequence

from hybridflow import sandbox, wire
from hybridflow.agents import program_worker
from hybridflow.agents.local import _probe, _Worker
from hybridflow.agents.loop import NOT_RUN, PROGRAM
from hybridflow.agents.protocol import AgentSettings, EndpointAddress, Info, ProgramResult
from hybridflow.sandbox import Limits

PROGRAM_MODULE = program_worker.__name__
WORKER_CHECK = (sys.executable, "-c", f"import {PROGRAM_MODULE}, openai, httpx; print('ok')")
FIELD = "spec.rollout.agent.programTimeoutSeconds"
TAIL_LINES, TAIL_CHARS = 20, 2048  # of the program's stderr, in a failed run's error
KEEP_BYTES = 16 << 10  # what is kept of the stderr while the program runs (its last bytes)
DRAIN_SECONDS = 2.0  # after the sandbox is killed: how long its stderr's last bytes are waited for
# terminal escapes (CSI, OSC, two-character), then what else would move the cursor or reorder text on a console:
# C0 and C1 controls but the tab, Unicode line and paragraph separators, bidirectional overrides and isolates
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-_])")
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


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
                          name="the program's sandbox", stderr=subprocess.PIPE)
        except OSError as err:  # the machine could not start a sandbox (no processes or files left): not the program's
            return ProgramResult(error=f"the agent program's sandbox could not start: {err}", failure=NOT_RUN)
        tail = StderrTail(box.box.popen.stderr)
        with self._lock:
            self._live.add(box)
        t0 = time.monotonic()
        request = {"path": self.path, "source": self.source, "sample": sample, "socket_path": endpoint.socket_path,
                   "token": endpoint.token}
        try:
            try:
                result = _result(box.call(request, timeout))
            except wire.WireTimeout:
                result = ProgramResult(error=f"the agent program {Path(self.path).name} timed out after {timeout:g} "
                                       f"s ({FIELD})", failure=PROGRAM)
            except wire.WireError as err:
                result = ProgramResult(error=f"the agent program {Path(self.path).name} failed after "
                                       f"{time.monotonic() - t0:.1f} s: {err}; {box.death()}", failure=PROGRAM)
            finally:
                box.kill()
                with self._lock:
                    self._live.discard(box)
            if result.error is None:
                return result
            return replace(result, error=with_stderr(result.error, tail.text(DRAIN_SECONDS)))
        finally:  # a process that outlived the kill may hold the pipe open: neither the thread nor the pipe waits on it
            tail.close()

    def close(self) -> None:
        """Kills the runs still going (their episodes report them failed); later runs start as before (a rollout
        whose engine failed closes its programs: program_loop.run_program_episodes)."""
        with self._lock:
            live, self._live = list(self._live), set()
        for box in live:
            box.kill()


class StderrTail:
    """The last KEEP_BYTES a sandbox wrote to its stderr (a pipe, or None: nothing), read by a thread of its own so
    that a program that prints much never blocks on a full pipe; the thread ends, closing the pipe, when the sandbox
    is gone (every writer of it killed) or when `close` stops it (a writer that outlived the kill)."""

    POLL_SECONDS = 0.05  # how soon the thread sees `close`

    def __init__(self, stream: IO[bytes] | None) -> None:
        self._stream, self._data, self._cut = stream, bytearray(), False
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._drain, name="agent-program-stderr", daemon=True)
        if stream is not None:
            try:
                self._thread.start()
            except RuntimeError:  # no thread left on the machine: the run goes on without its stderr
                stream.close()
                self._stream = None

    def _drain(self) -> None:
        assert self._stream is not None
        try:
            fd, ready = self._stream.fileno(), select.poll()  # poll, not select: any fd number
            ready.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
            while not self._stop.is_set():
                if not ready.poll(int(self.POLL_SECONDS * 1000)):
                    continue
                if not (chunk := os.read(fd, 1 << 16)):
                    break
                with self._lock:
                    self._data += chunk
                    if len(self._data) > 2 * KEEP_BYTES:
                        del self._data[:-KEEP_BYTES]
                        self._cut = True
        except (OSError, ValueError):
            pass
        finally:
            self._stream.close()

    def text(self, wait: float) -> str:
        """Its last lines (tail_text), once the pipe ended or after `wait` seconds (what came by then)."""
        if self._stream is not None:
            self._thread.join(wait)
        with self._lock:
            return tail_text(bytes(self._data[-KEEP_BYTES:]), self._cut or len(self._data) > KEEP_BYTES)

    def close(self, wait: float = 1.0) -> None:
        """Stops reading: the thread ends within POLL_SECONDS, closing the pipe (waited for at most `wait` s)."""
        self._stop.set()
        if self._stream is not None:
            self._thread.join(wait)


def tail_text(raw: bytes, cut: bool = False) -> str:
    """The last TAIL_LINES lines of `raw` (a program's stderr; `cut`: its beginning is gone, so its first line is
    partial and dropped) within TAIL_CHARS characters: decoded (bad bytes replaced), terminal escapes removed, each
    line as a console shows it after a carriage return, other controls as "?", tabs as spaces, trailing blanks off."""
    lines = _ESCAPES.sub("", raw.decode("utf-8", "replace")).split("\n")
    if cut:
        lines = lines[1:]
    shown = [_CONTROLS.sub("?", line.rstrip("\r").rsplit("\r", 1)[-1]).replace("\t", "    ").rstrip()
             for line in lines]
    while shown and not shown[-1]:
        shown.pop()
    text = "\n".join(shown[-TAIL_LINES:]).strip("\n")
    if len(text) > TAIL_CHARS:
        text = "..." + text[len(text) - TAIL_CHARS + 3:]
    return text


def with_stderr(error: str, tail: str) -> str:
    """A failed run's error, then its stderr's last lines (none: the error alone), each indented under it."""
    if not tail:
        return error
    lines = tail.split("\n")
    return (f"{error} (the program's stderr, its last {len(lines)} line{'s' if len(lines) > 1 else ''}:\n"
            + "".join(f"  | {line}\n" for line in lines) + ")")


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
