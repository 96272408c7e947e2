"""What a sandbox leaves behind where it has no PID namespace of its own: the process that serves user code becomes
the child subreaper of everything it starts, and kills whatever is reparented to it.

With bubblewrap a sandbox is a PID namespace: its init's death takes every process in it along (setsid and double
forks included). Where the node refuses namespaces (a default cluster's seccomp profile), a sandbox is a process
group and a session, and a program that calls setsid() in a double fork leaves both: killing the sandbox at its
deadline would leave that daemon running, with the rest of its CPU and memory limits, beside the next calls. A
child subreaper (prctl PR_SET_CHILD_SUBREAPER) is the one ancestor such a daemon cannot leave: when its parent
exits the kernel gives it to us, not to the pod's init. So every direct child that is not a live sandbox we started
(`track`) is a process some sandbox left, and `sweep` kills it; `start` sweeps every `period` seconds from a thread.

Only for a process whose every child is a sandbox (the sandbox pool's server, `hybridflow environments serve`):
anything else it started is killed too. Linux only; elsewhere `start` says it could not (False).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
from typing import Callable, Iterator

log = logging.getLogger("hybridflow.sandbox")

PR_SET_CHILD_SUBREAPER = 36
_live: dict[int, subprocess.Popen] = {}  # pid -> the sandbox started there (process.spawn tracks each)
_lock = threading.Lock()
_started = threading.Event()


_starting = 0  # sandboxes being started: forked, not yet tracked; no sweep meanwhile


@contextlib.contextmanager
def starting() -> Iterator[Callable[[subprocess.Popen], None]]:
    """Around a sandbox's start: `with starting() as track: track(Popen(...))`. A sweep between the fork and the
    tracking would take the new sandbox for a leftover, so none runs until it is tracked."""
    global _starting
    with _lock:
        _starting += 1
    try:
        yield track
    finally:
        with _lock:
            _starting -= 1


def track(proc: subprocess.Popen) -> None:
    """A sandbox this process started: its pid is one of ours while it runs."""
    with _lock:
        _live[proc.pid] = proc


def children(pid: int | None = None) -> list[int]:
    """The direct children of `pid` (default: this process), from every thread's /proc children list."""
    pid = os.getpid() if pid is None else pid
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                continue
    except OSError:
        return []
    return out


def sweep() -> list[int]:
    """Kill (SIGKILL) and reap every direct child that is not a running sandbox of ours; their pids."""
    with _lock:
        if _starting:
            return []
        for pid, proc in list(_live.items()):
            if proc.poll() is not None:
                del _live[pid]
        keep = set(_live)
        found = children()  # under the lock: no sandbox starts between this list and `keep`
    killed = []
    for pid in found:
        if pid in keep:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            continue
    for pid in killed:  # ours to reap: nothing else waits for an orphan (one still dying is reaped next sweep)
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    if killed:
        log.warning("killed %d process(es) a sandbox left behind (started outside its session): %s", len(killed),
                    killed)
    return killed


def start(period: float = 0.5) -> bool:
    """Become this process's subreaper and sweep every `period` seconds (once per process); False where the kernel
    does not offer it."""
    if _started.is_set():
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    _started.set()

    def loop() -> None:
        while True:
            try:
                sweep()
            except Exception:  # noqa: BLE001 - the sweep must go on whatever one round met
                log.exception("sweeping a sandbox's leftovers failed")
            threading.Event().wait(period)

    threading.Thread(target=loop, name="sandbox-reaper", daemon=True).start()
    return True
