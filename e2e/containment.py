"""The containment probe of the e2e scenarios: Python source (standard library only) appended to a user's reward
function, sent as model-written code to the built-in `python` tool, and run by an environment's step. Wherever it
runs it tries what user code on Kubernetes must not be able to do, and reports what it got:

- `credentials_seen`: a Ray token, an object-storage key or a tracking token, in its own environment or in any
  /proc/<pid>/environ it can read (its parent's: where a partial sandbox runs beside the driver, that is the Ray
  token and the checkpoint keys);
- `head_connected`: a TCP connection to the head pod's Ray GCS (port 6379 at the head's pod address, found in
  /etc/hosts by the pod's name; `head_target` says it was found), which the job's own pods reach by design;
- a daemon that leaves its sandbox's session (double fork, setsid) and sleeps with MARKER in its command line: the
  scenario checks that none outlives the call (`daemons_outliving`).

Run in the head pod instead of the sandbox pool (a partial sandbox beside the driver), it sees the Ray token and
connects: the scenarios fail.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

MARKER = "hybridflow-containment-daemon"
CREDENTIALS = ("RAY_AUTH_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_TOKEN",
               "MLFLOW_TRACKING_PASSWORD")

SOURCE = '''
def _containment(head_pod):
    import os as _os, socket as _socket, sys as _sys
    wanted = %(credentials)r
    seen = any(k in _os.environ for k in wanted)
    for pid in _os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%%s/environ" %% pid, "rb") as f:
                    names = [e.split(b"=", 1)[0].decode(errors="replace") for e in f.read().split(b"\\0")]
            except OSError:
                continue
            seen = seen or any(k in names for k in wanted)
    address = None
    try:
        with open("/etc/hosts") as f:
            found = [line.split()[0] for line in f if line.split()[1:2] == [head_pod]]
        address = found[0] if found else None
    except OSError:
        pass
    connected = 0.0
    if address:
        try:
            _socket.create_connection((address, 6379), timeout=2).close()
            connected = 1.0
        except OSError:
            pass
    try:  # a daemon out of the sandbox's session and process tree: double fork, setsid
        child = _os.fork()
        if child == 0:
            try:
                _os.setsid()
                if _os.fork() == 0:
                    _os.execv(_sys.executable, [_sys.executable, "-c", "import time; time.sleep(600)", %(marker)r])
            finally:
                _os._exit(0)
        _os.waitpid(child, 0)
    except OSError:
        pass
    return {"credentials_seen": float(seen), "head_target": float(address is not None),
            "head_connected": connected}
''' % {"credentials": CREDENTIALS, "marker": MARKER}


def daemons_outliving(seconds: float = 3.0) -> list[int]:
    """The probe's daemons (this machine's processes with MARKER in their command line) started more than `seconds`
    ago: with the sandbox pool's reaper each is gone within a second of its sandbox's call."""
    ticks, boot = os.sysconf("SC_CLK_TCK"), time.time() - float(Path("/proc/uptime").read_text().split()[0])
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if MARKER.encode() not in (proc / "cmdline").read_bytes():
                continue
            started = boot + int((proc / "stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        except (OSError, IndexError, ValueError):
            continue
        if time.time() - started > seconds:
            out.append(int(proc.name))
    return out
