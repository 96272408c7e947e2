"""Ending what a test or a check left running: one definition for tests/conftest.py, the GPU suite (tests/gpu) and
bench/gpu_check.sh's cleanup after a timed-out run; and `running`, a subprocess ended with the block that runs it."""
from __future__ import annotations

import contextlib
import os
import time


def kill_processes_mentioning(text: str, grace: float = 5.0) -> int:
    """SIGKILL every process whose command line contains `text` (a per-test or per-run temp dir, e.g. a private
    Ray's), after `grace` seconds for them to end by themselves; returns how many had to be killed. This process
    and its ancestors (what runs it, whose command line may name the dir too) are spared."""
    import psutil

    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}

    def left() -> list:
        out = []
        for p in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if p.pid not in spared and text in " ".join(p.info["cmdline"] or []):
                    out.append(p)
        return out

    deadline = time.time() + grace
    while (procs := left()) and time.time() < deadline:
        time.sleep(0.5)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return len(procs)


@contextlib.contextmanager
def running(cmd: list[str], **kwargs):
    """A subprocess in its own session for the length of a block; its whole process group is ended however the
    block ends (SIGTERM, then SIGKILL after 10 s), so a failing test leaves nothing running."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)  # the group outlives its leader while any member is alive
            except ProcessLookupError:
                pass
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass


if __name__ == "__main__":  # python tests/support/processes.py TEXT [GRACE]: bench/gpu_check.sh's cleanup
    import sys

    n = kill_processes_mentioning(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 2.0)
    if n:
        print(f"cleanup: ended {n} leftover process(es) of {sys.argv[1]}", flush=True)
