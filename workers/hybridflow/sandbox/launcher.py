"""The sandbox's command line: the launcher that runs first inside it and the bwrap arguments around it, with the
environment and the mounts they get. Pure functions of their arguments (and of this machine's paths for the
defaults), so that what a sandbox is made of can be read and tested without starting one."""
from __future__ import annotations

import os
import secrets
import sys
from pathlib import PurePosixPath
from typing import Sequence

import hybridflow
from hybridflow.sandbox.cgroup import enter_command as cgroup_enter
from hybridflow.sandbox.limits import (FRESH_UIDS, INSIDE_UID, PRIVATE_TMP, SECRET_DIRS, THREADS_ENV, WORKDIR, Layers,
                                       Limits, Private)

# The launcher: runs first inside the sandbox, sets the rlimits (soft = hard), drops to the sandbox's uid when it
# starts as root, arms the parent-death signal when there is no bwrap to do it, makes the working directory and
# execs the program. Inline and stdlib-only (-I -S), so it needs nothing but the interpreter.
_LAUNCHER = r"""
import os, resource, sys
i = sys.argv.index("--")
opts, argv = dict(a.split("=", 1) for a in sys.argv[1:i]), sys.argv[i + 1:]
for k, v in opts.items():
    if k.startswith("RLIMIT_"):
        r, v = getattr(resource, k), int(v)
        hard = resource.getrlimit(r)[1]
        v = v if hard == resource.RLIM_INFINITY else min(v, hard)
        resource.setrlimit(r, (v, v))
if "parent" in opts:
    import ctypes  # before the uid drop: the interpreter's own files may be out of that uid's reach
if "uid" in opts:
    u = int(opts["uid"])
    os.setgroups([]); os.setresgid(u, u, u); os.setresuid(u, u, u)
    if os.getuid() != u or os.geteuid() != u: os._exit(126)
if "parent" in opts:  # after the uid drop, which clears it
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL: the driver's death kills it
    if os.getppid() != int(opts["parent"]): os._exit(1)
d = opts["dir"]
os.makedirs(d, 0o700, exist_ok=True)
os.chdir(d)
try:
    os.execv(argv[0], argv)
except OSError as e:
    sys.stderr.write(f"sandbox: cannot run {argv[0]} as uid {os.getuid()}: {e.strerror}\n")
    os._exit(127)
"""


# How a sandboxed Python worker starts (`python -P -m module`): without its working directory (or a script's) first
# on sys.path. That directory is the sandbox's own private one, but where a node gives no other uid and no mount
# namespace (a default cluster's pods), other sandboxes of the pod (a tool running the model's code) can write into
# it, and a module planted there (a `hybridflow/` package) would run inside the worker, before any of its code.
# Python 3.10 has no -P: -I (isolated) leaves the directory out too, with PYTHONPATH and the user's site.
PYTHON_FLAGS = ("-P",) if sys.version_info >= (3, 11) else ("-I",)


def python_module(module: str, *args: str) -> list[str]:
    """The command that runs `module` with this interpreter inside a sandbox (PYTHON_FLAGS)."""
    return [sys.executable, *PYTHON_FLAGS, "-m", module, *args]


def is_under(path: str, root: str) -> bool:
    return path == root or root == "/" or path.startswith(root.rstrip("/") + "/")


def _ancestors(path: str, below: str) -> list[str]:
    """The directories strictly between `below` and `path`: /a/b/c/d below /a -> [/a/b, /a/b/c]."""
    depth = len(PurePosixPath(below).parts)
    return [str(a) for a in reversed(PurePosixPath(path).parents) if len(a.parts) > depth]


def command(argv: Sequence[str], limits: Limits, layers: Layers, *, env: dict[str, str], workdir: str,
            uid: int | None = None, parent: int | None = None, binds: Sequence[str] = (),
            hidden: Sequence[str] = (), needed: Sequence[str] = (), private: Private = Private(),
            python: str = sys.executable, seccomp_fd: int | None = None, cgroup: str | None = None) -> list[str]:
    """The command line that runs `argv` sandboxed with `layers`. A pure function of its arguments.

    binds: host paths the program sees read-only (the user's code); hidden: directories replaced by an empty tmpfs
    (the driver's home, secrets), except for the `needed` paths under them (the interpreter and its packages),
    which are bound back read-only; private: the job's own files (its data, its checkpoints), hidden wherever they
    are, even inside a bound directory: a directory by an empty tmpfs (the user's code under it bound back), a file
    by /dev/null (on bwrap's nodev bind it cannot even be opened); workdir: where the program runs (made by the launcher); uid: the uid the
    launcher drops to (started as root); parent: the pid whose death kills the program (without bwrap); seccomp_fd:
    the fd bwrap reads the seccomp filter from (layers.seccomp); cgroup: the sandbox's own cgroup, which the command
    enters first (cgroup.enter_command)."""
    opts = [f"{k}={v}" for k, v in limits.rlimits(count_processes=layers.userns or layers.other_uid)]
    if uid is not None:
        opts.append(f"uid={uid}")
    if parent is not None and layers.bwrap is None:
        opts.append(f"parent={parent}")
    opts.append(f"dir={workdir}")
    launch = [python, "-I", "-S", "-c", _LAUNCHER, *opts, "--", *argv]
    enter = cgroup_enter(cgroup) if cgroup else []
    if layers.bwrap is None:
        return [*enter, *launch]
    if layers.seccomp and seccomp_fd is None:
        raise ValueError("a sandbox with the seccomp layer needs the filter's fd (seccomp.filter_fd)")
    out = [layers.bwrap, "--die-with-parent", "--new-session",
           "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox",
           "--unshare-cgroup-try"]
    if layers.userns:
        out += ["--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID)]
        if layers.disable_userns:  # no user namespace of its own inside (the seccomp filter refuses one too)
            out += ["--disable-userns"]
    else:  # bwrap as root keeps every capability unless told: only what the launcher needs to drop to `uid`
        out += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    out += ["--ro-bind", "/", "/", "--dev", "/dev"]
    out += ["--proc", "/proc"] if layers.proc else ["--perms", "0555", "--size", "4096", "--tmpfs", "/proc"]
    # /dev read-only (a writable one is an unsized tmpfs, and device nodes could be made in it), after what --dev
    # mounts in it; its private /dev/shm (a PRIVATE_TMP, sized) is mounted below, after this, and stays writable.
    out += ["--remount-ro", "/dev"]
    # Mounts in order of depth, so that each lands on what its parent's mount left: a hidden directory's tmpfs
    # first, then what is bound back into it.
    mounts: list[tuple[str, str]] = [(p, "tmp") for p in PRIVATE_TMP]
    exposed = sorted({os.path.normpath(p) for p in (*binds, *needed)})
    for h in sorted({os.path.normpath(p) for p in hidden}):
        # A hidden directory the program's own code lives in stays; one inside a private tmp (a job pod's HOME is
        # its /tmp) is hidden by that fresh tmpfs already, and a read-only one over it would leave the program no
        # writable /tmp (not even its working directory: every kind of sandbox with bwrap failed to start).
        if not any(is_under(h, e) for e in exposed) and not any(is_under(h, t) for t in PRIVATE_TMP):
            mounts.append((h, "hide"))
    for e in exposed:
        for root in PRIVATE_TMP:
            if is_under(root, e):
                raise ValueError(f"cannot bind {e} into a sandbox: it holds its private {root}")
    for d in sorted({os.path.normpath(p) for p in private.dirs}):
        if not any(is_under(d, t) for t in PRIVATE_TMP) and (d, "hide") not in mounts:
            mounts.append((d, "hide"))
    covered = [p for p, _ in mounts]
    bound = [e for e in exposed if e in binds or any(is_under(e, c) for c in covered)]
    for e in bound:  # needed paths elsewhere are in the read-only root
        mounts.append((e, "bind"))
    for f in sorted({os.path.normpath(p) for p in private.files}):
        # one under a hidden directory is gone with it, unless what is bound back into that directory holds it
        gone = any(is_under(f, c) for c in covered) and not any(is_under(f, e) for e in bound)
        if not gone and not any(is_under(f, t) for t in PRIVATE_TMP):
            mounts.append((f, "mask"))
    mounts.sort(key=lambda m: (len(PurePosixPath(m[0]).parts), m[1] != "tmp"))
    made: set[str] = set()
    rebound: set[str] = set()
    for path, kind in mounts:
        if kind == "tmp":
            out += ["--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", path]
        elif kind == "hide":
            out += ["--perms", "0755", "--size", "65536", "--tmpfs", path]
            rebound.add(path)
        elif kind == "mask":  # opening it fails: a device node on a nodev mount
            out += ["--ro-bind", "/dev/null", path]
        else:
            for tmpfs in covered:  # bwrap would make its mount point's parents 0700: make them 0755
                if is_under(path, tmpfs) and path != tmpfs:
                    for a in _ancestors(path, tmpfs):
                        if a not in made:
                            out += ["--perms", "0755", "--dir", a]
                            made.add(a)
            out += ["--ro-bind", path, path]
    for path in sorted(rebound):  # nothing may be written into a hidden directory either
        out += ["--remount-ro", path]
    out += ["--clearenv"]
    for k, v in sorted(env.items()):
        out += ["--setenv", k, v]
    if layers.seccomp:
        out += ["--seccomp", str(seccomp_fd)]
    out += ["--chdir", "/", "--", *launch]
    return [*enter, *out]


def clean_env(keep: Sequence[str] = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH"), workdir: str = WORKDIR,
              extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a sandboxed program starts with: only the driver's `keep` variables (no credentials), HOME
    and TMPDIR in its private directory, numeric libraries on one thread."""
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(THREADS_ENV)
    env.update({"HOME": workdir, "TMPDIR": workdir, "USER": "sandbox", "LOGNAME": "sandbox",
                "PYTHONDONTWRITEBYTECODE": "1"})
    env.update(extra or {})
    return env


def default_hidden() -> list[str]:
    """The driver's home and the secrets directories that exist here."""
    home = os.path.expanduser("~")
    out = [os.path.realpath(p) for p in (home, *SECRET_DIRS) if p and p != "/" and os.path.isdir(p)]
    return sorted(set(out))


def default_needed(hidden: Sequence[str] = ()) -> list[str]:
    """What a Python program needs to read: the interpreter, its prefixes and every directory on sys.path, and the
    directory holding this package (an editable install is not on sys.path); not "/" nor a directory that holds a
    hidden one (the driver's working directory on sys.path may be its home): those stay hidden."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(hybridflow.__file__)))  # the directory holding hybridflow/
    cands = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)), here,
             *sys.path]
    paths = sorted({os.path.realpath(p) for p in cands if p and os.path.isdir(p)})
    paths = [p for p in paths if not any(is_under(h, p) for h in (*hidden, *PRIVATE_TMP))]
    return [p for p in paths if not any(q != p and is_under(p, q) for q in paths)]  # outermost only


def code_binds(path: str) -> list[str]:
    """What of the machine a sandbox running a user's file sees beside the read-only root: the file's directory (its
    data files, by `__file__`), or the file alone where that directory holds the driver's home or the sandbox's own
    mounts."""
    d = os.path.dirname(path)
    special = [*default_hidden(), *PRIVATE_TMP, "/dev", "/proc"]
    return [path] if any(is_under(h, d) for h in special) else [d]


def fresh_uid() -> int:
    return FRESH_UIDS[0] + secrets.randbelow(FRESH_UIDS[1] - FRESH_UIDS[0])
