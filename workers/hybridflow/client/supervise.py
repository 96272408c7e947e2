"""`python -m hybridflow.client.supervise RUN_DIR -- COMMAND...`: runs a local job's `hybridflow run` and records
what any later client needs to know about it, whoever started it and whether that script still lives: `pid` (the
run's), `pgid` (the session's: this supervisor's, which the run and everything it starts, Ray, belong to), and at
the end `returncode`, written whole (a temporary file renamed over it). client.local starts one per job."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m hybridflow.client.supervise RUN_DIR -- COMMAND...", file=sys.stderr)
        return 2
    root, cmd = Path(argv[0]), argv[2:]
    # Same session and process group: ended together. Ctrl-C's signal as the run's default: a script started in the
    # background of a non-interactive shell (CI) has SIGINT ignored, which Python would keep, and `delete` stops the
    # run with it.
    proc = subprocess.Popen(cmd, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    write_whole(root / "pgid", str(os.getpgid(0)))
    write_whole(root / "pid", str(proc.pid))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the run, which decides how to stop
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    rc = proc.wait()
    write_whole(root / "returncode", str(rc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
