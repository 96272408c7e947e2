"""A cgroup v2 of its own per sandbox, where this process was delegated one: memory.max and pids.max bound the
sandbox's processes together (the rlimits bound each process alone), and cgroup.kill ends all of them at once.

Delegated means a cgroup v2 directory this uid may write whose children get the memory and pids controllers:
HYBRIDFLOW_SANDBOX_CGROUP names one; otherwise this process's own cgroup, then its parent, are tried (cgroup v2 lets
only a cgroup without processes of its own give its children controllers, so the own one serves only where it is
the root or was prepared so). Where none is, the layer is missing (an advisory one: Layers, limits.ADVISORY) and the
rlimits and the pod's own cgroup remain the bound.

A sandbox's process enters its cgroup before anything of the sandbox runs: the command starts with a shell that
writes its own pid into the cgroup's cgroup.procs and then execs bwrap (or the launcher), so every process the
sandbox makes is born inside it.
"""
from __future__ import annotations

import errno
import itertools
import os
import secrets
import time
from functools import lru_cache

from hybridflow.sandbox.limits import CGROUP_ENV, Limits

CONTROLLERS = ("memory", "pids")
PREFIX = "hybridflow-sandbox-"
_count = itertools.count()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def own_cgroup(mountinfo: str = "/proc/self/mountinfo", cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup v2 directory (None: no cgroup v2 mounted, or its cgroup is outside the mount)."""
    try:
        path = next((line[3:].strip() for line in _read(cgroup).splitlines() if line.startswith("0::")), None)
        mounts = [line.split() for line in _read(mountinfo).splitlines()]
    except OSError:
        return None
    if path is None:
        return None
    for fields in mounts:
        sep = fields.index("-") if "-" in fields else -1
        if sep < 0 or fields[sep + 1] != "cgroup2":
            continue
        root, point = fields[3], fields[4]
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return os.path.normpath(point + "/" + path[len(root):])
    return None


def usable(directory: str) -> str | None:
    """None when sandboxes' cgroups can be made under `directory`, else why not. Enables the memory and pids
    controllers for its children where they are not yet (which fails where it holds processes)."""
    if not os.path.isfile(os.path.join(directory, "cgroup.controllers")):
        return f"{directory} is not a cgroup v2 directory"
    if not (os.access(directory, os.W_OK) and os.access(os.path.join(directory, "cgroup.procs"), os.W_OK)):
        return f"{directory} is not writable by uid {os.geteuid()} (not delegated)"
    offered = _read(os.path.join(directory, "cgroup.controllers")).split()
    lacking = [c for c in CONTROLLERS if c not in offered]
    if lacking:
        return (f"{directory} offers the controllers [{' '.join(offered)}], not {' and '.join(lacking)} (on cgroup v1, "
                "or not delegated)")
    control = os.path.join(directory, "cgroup.subtree_control")
    if any(c not in _read(control).split() for c in CONTROLLERS):
        try:
            _write(control, " ".join(f"+{c}" for c in CONTROLLERS))
        except OSError as err:
            return (f"{directory} cannot give its children the memory and pids controllers ({err.strerror}: cgroup "
                    "v2 allows that only to a cgroup without processes of its own)")
    return None


@lru_cache(maxsize=None)
def delegated() -> tuple[str | None, str]:
    """(the directory sandboxes' cgroups are made in, "") or (None, why there is none). Once per process."""
    named = os.environ.get(CGROUP_ENV, "").strip()
    if named:
        why = usable(named)
        return (None, f"{CGROUP_ENV}={named}: {why}") if why else (named, "")
    own = own_cgroup()
    if own is None:
        return None, "no cgroup v2 holds this process (cgroup v1 only, or none mounted)"
    whys = []
    for candidate in (own, os.path.dirname(own)):
        why = usable(candidate)
        if why is None:
            return candidate, ""
        whys.append(why)
        if candidate == os.path.dirname(candidate) or not os.path.isfile(
                os.path.join(os.path.dirname(candidate), "cgroup.controllers")):
            break  # the top of the hierarchy this process sees
    return None, f"no delegated cgroup v2: {'; '.join(whys)} ({CGROUP_ENV} may name one)"


def make(parent: str, limits: Limits) -> str:
    """A new cgroup for one sandbox under `parent`, its limits written; the caller removes it (`remove`)."""
    path = os.path.join(parent, f"{PREFIX}{os.getpid()}-{next(_count)}-{secrets.token_hex(3)}")
    os.mkdir(path, 0o755)
    try:
        _write(os.path.join(path, "memory.max"), str(limits.cgroup_memory_bytes))
        _write(os.path.join(path, "pids.max"), str(limits.processes))
        for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):  # where the kernel has them
            if os.path.exists(os.path.join(path, name)):
                _write(os.path.join(path, name), value)
    except BaseException:
        remove(path)
        raise
    return path


def enter_command(path: str) -> list[str]:
    """What runs first: a shell that moves itself into the cgroup at `path` and execs the rest of the command."""
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', path]


def kill(path: str) -> None:
    """SIGKILL every process in it (cgroup.kill, Linux 5.14+); best effort."""
    try:
        _write(os.path.join(path, "cgroup.kill"), "1")
    except OSError:
        pass


def remove(path: str, wait: float = 2.0) -> bool:
    """Remove the (emptied) cgroup; whether it is gone. Its last processes may take a moment to leave it."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() >= deadline:  # EBUSY: processes still leaving it
                return False
            time.sleep(0.02)
