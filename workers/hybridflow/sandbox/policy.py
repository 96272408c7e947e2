"""What a caller does when the machine's sandbox lacks a layer: refuse to run user code (when the sandbox is
required) or say so once per process and go on with the layers that remain. Its own module because it holds the
process-wide state of which warnings were given."""
from __future__ import annotations

import logging
import os

from hybridflow.sandbox.limits import REQUIRE_ENV, Layers, SandboxUnavailable

log = logging.getLogger("hybridflow.sandbox")  # the package's name: what operators (and tests) filter on

LAYER_TEXT = {"network": "no network", "processes": "its own PID namespace and /proc",
              "filesystem": "a read-only view of the machine with a private /tmp", "user": "another uid",
              "limits": "rlimits", "environment": "a clean environment",
              "syscalls": "a seccomp filter (no namespaces, mounts, ptrace, bpf, io_uring, keyrings of its own)",
              "cgroup": "a cgroup of its own (memory.max, pids.max)"}
_warned: set[tuple[tuple[str, str], ...]] = set()


def warn_once(layers: Layers, what: str) -> None:
    """One warning per process (per set of missing layers): which layers `what` (e.g. 'the reward function') runs
    without, and why, and which it keeps. Only advisory layers missing (no delegated cgroup): said once at info."""
    if not layers.missing or layers.missing in _warned:
        return
    _warned.add(layers.missing)
    if layers.complete:
        log.info("%s runs without %s", what, "; ".join(f"{name} ({why})" for name, why in layers.missing))
        return
    by_why: dict[str, list[str]] = {}
    for name, why in layers.missing:
        by_why.setdefault(why, []).append(name)
    gone = "; ".join(f"{', '.join(names)} ({why})" for why, names in by_why.items())
    kept = ", ".join(LAYER_TEXT[x] for x in layers.present)
    log.warning("%s runs in a partial sandbox (%s): missing %s; it keeps %s, a new session and a private temporary "
                "directory. Set %s=require to refuse to start without the whole sandbox.",
                what, layers.how, gone, kept, REQUIRE_ENV)


def required(explicit: bool | None = None) -> bool:
    """Whether user code must not run without every layer: `explicit`, else HYBRIDFLOW_SANDBOX=require."""
    return explicit if explicit is not None else os.environ.get(REQUIRE_ENV, "").strip().lower() == "require"


def check_required(layers: Layers, what: str, require: bool | None = None) -> None:
    """Raise SandboxUnavailable when the sandbox is required and `layers` lack some layer (but an advisory one: a
    cgroup of its own); warn once otherwise."""
    if layers.required_missing and required(require):
        raise SandboxUnavailable(
            f"{what} must run in the whole sandbox ({REQUIRE_ENV}=require) but this machine lacks "
            + "; ".join(f"{name} ({why})" for name, why in layers.required_missing))
    warn_once(layers, what)
