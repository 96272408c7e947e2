"""The machine's processes by command line, as the sandbox tests see them from outside any sandbox: which hold a
string, how many at most while a call runs, waiting for them to go, and killing what a failed sandbox left. Shared
by tests/rewards/test_reward_sandbox.py and tests/agents/test_agent_sandbox.py."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def pids_with(needle: str) -> list[int]:
    """Processes of the machine (not of a sandbox's view) whose command line holds `needle`."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if needle.encode() in f.read():
                        out.append(int(p))
            except OSError:
                pass
    return out


def python_pids_with(needle: str) -> list[int]:
    """Those of them that are Python (a worker and what it forked), not bwrap."""
    out = []
    for pid in pids_with(needle):
        try:
            if Path(f"/proc/{pid}/exe").resolve().name.startswith("python"):
                out.append(pid)
        except OSError:
            pass
    return out


class ProcessWatch:
    """Samples the machine's processes holding `needle` (Python ones only, with python=True) while a call runs:
    `seen` is the most at once."""

    def __init__(self, needle: str, python: bool = False) -> None:
        self.needle, self.python, self.seen = needle, python, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._done.is_set():
            found = python_pids_with(self.needle) if self.python else pids_with(self.needle)
            self.seen = max(self.seen, len(found))
            time.sleep(0.05)

    def __enter__(self) -> "ProcessWatch":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        self._thread.join()


def wait_gone(needle: str, seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := pids_with(needle)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_pids(pids):
    """Clean-up after a sandbox that failed to contain its processes (only the test's own, by pid)."""
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
