"""User code in an OS sandbox: reward functions now, an agent's tools and environments later.

`spawn(argv, limits)` starts `argv` (a program of the user's, or a worker that loads the user's code) in separate
processes that the operating system contains, each layer stopping something of its own:

- network: bwrap --unshare-net, a network namespace with only a loopback of its own. Stops any connection: to the
  job's Ray (GCS, raylets, dashboard), to the pod's 127.0.0.1 services, to the cloud's metadata endpoint, outside.
- processes: bwrap --unshare-pid with a --proc of its own, --die-with-parent, --new-session. Stops seeing or
  signalling the driver or any other process and reading their /proc/<pid>/environ; stops outliving the sandbox:
  every process in it (setsid and double forks included) is killed when its PID namespace's init dies, which it
  does when the sandbox is killed, when its parent dies and when the driver is killed (kill -9 included). And
  TIOCSTI on a terminal.
- filesystem: bwrap --ro-bind / /, a fresh --dev, tmpfs (sized) over /tmp and /dev/shm, an empty tmpfs over the
  driver's home, /root and the secrets directories. Stops writing anything of the machine's (checkpoints, the code,
  the user's own files, /var/tmp); reading what the driver keeps in /tmp (Ray's session and sockets) or in its home
  (~/.ray, ~/.aws, tokens) and a Kubernetes service-account token. Everything else stays readable, read-only: it is
  what a program needs (Python, its packages).
- user: started as root, a uid of its own (a fresh one per sandbox, no capability left); not root, a user namespace
  (uid 65534 inside, the caller's uid outside). Stops, as root: reading root's files (/root, 0600 keys), signalling
  or tracing the driver, any capability; everywhere: gaining privileges (no_new_privs).
- limits: rlimits set before the program runs, soft = hard so that they cannot be raised: CPU seconds, address
  space, file size, processes (and threads), open files, no core dumps. Stops a busy loop past its CPU budget
  (SIGKILL), a memory blow-up (MemoryError, a failed mmap), a disk filler (EFBIG), a fork bomb (fork fails, EAGAIN).
- environment: a new, clean one (bwrap --clearenv, and the process is started with it too). Stops the job's
  credentials from reaching it: RAY_AUTH_TOKEN, AWS_*, anything in the driver's environment.

The caller adds the wall-clock deadline (the reward pool kills a sandbox past its call's deadline; the PID
namespace takes everything in it along).

`probe()` finds which layers this machine or pod offers, by starting a sandbox of each kind, best first: bwrap as
root (namespaces made without a user namespace, the launcher then drops to a fresh uid), bwrap in a user namespace,
no bwrap; where a fresh /proc cannot be mounted (a container's masked /proc in a user namespace), an empty one.
Where a layer is missing (bwrap not installed; user namespaces refused, as under seccomp RuntimeDefault or
`kernel.unprivileged_userns_clone=0`) the others still hold: rlimits, the clean environment, a new session, a
private temporary directory, a fresh uid when root can hand one the Python; the caller says so once (`warn_once`)
or refuses to run (`check_required`: its argument, or HYBRIDFLOW_SANDBOX=require).

What it does not stop: reading world-readable files of the machine (read-only); using CPU and memory up to its
limits (RLIMIT_AS bounds each process, so a sandbox can hold up to processes x memory: the pod's cgroup is the outer
bound, and nothing here uses cgroups); kernel exploits (no seccomp filter: bwrap sets no_new_privs only);
connecting to a Unix socket of the machine that is outside /tmp and the hidden directories and writable by its uid.
Without a user namespace or root, the process-count limit is not set (RLIMIT_NPROC counts every process of the uid,
the driver's threads included).
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import PurePosixPath
from typing import Any, Sequence

log = logging.getLogger("hybridflow.sandbox")

# Inside a sandbox: its private directories (tmpfs), and where the program runs (HOME, TMPDIR and the working
# directory: made empty by the launcher).
PRIVATE_TMP = ("/tmp", "/dev/shm")
WORKDIR = "/tmp/sandbox"
INSIDE_UID = 65534  # a user namespace's uid for the program ("nobody")
# A uid of its own per sandbox when started as root: high enough to own nothing on the machine, and fresh each time
# so that RLIMIT_NPROC (which counts every process of the uid) counts that sandbox's processes only.
FRESH_UIDS = (1_000_000_000, 2_000_000_000)
# Hidden from the program (an empty tmpfs over them) when they exist: the driver's home and the secrets mounts.
SECRET_DIRS = ("/root", "/run/secrets", "/var/run/secrets")
REQUIRE_ENV = "HYBRIDFLOW_SANDBOX"  # "require": refuse to run user code without every layer
LAYERS = ("network", "processes", "filesystem", "user", "limits", "environment")
# Numeric libraries start one thread per core (each a process for RLIMIT_NPROC, each with its own buffers for
# RLIMIT_AS); a sandboxed worker is one of several running side by side.
THREADS_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxUnavailable(RuntimeError):
    """The sandbox was required (`require`, HYBRIDFLOW_SANDBOX=require) but this machine lacks some of its layers."""


@dataclass(frozen=True)
class Limits:
    """Per-process rlimits of a sandbox (soft = hard: the program cannot raise them), and the size of its /tmp.
    The wall-clock deadline is the caller's (it kills the sandbox)."""

    cpu_seconds: int = 600  # RLIMIT_CPU: CPU time of each process over its life, then SIGKILL
    memory_bytes: int = 4 << 30  # RLIMIT_AS: address space of each process
    file_size_bytes: int = 64 << 20  # RLIMIT_FSIZE: the largest file it may write
    processes: int = 64  # RLIMIT_NPROC: processes and threads of the sandbox's uid
    open_files: int = 1024  # RLIMIT_NOFILE
    tmp_bytes: int = 256 << 20  # the size of each private tmpfs (/tmp, /dev/shm)

    def rlimits(self, count_processes: bool = True) -> list[tuple[str, int]]:
        out = [("RLIMIT_CPU", self.cpu_seconds), ("RLIMIT_AS", self.memory_bytes),
               ("RLIMIT_FSIZE", self.file_size_bytes), ("RLIMIT_NOFILE", self.open_files), ("RLIMIT_CORE", 0)]
        if count_processes:
            out.append(("RLIMIT_NPROC", self.processes))
        return out


@dataclass(frozen=True)
class Layers:
    """How this machine sandboxes user code (from `probe`), and which layers that leaves out, with why."""

    bwrap: str | None = None  # the bwrap binary; None: no namespaces, no mounts
    privileged: bool = False  # bwrap runs as root, without a user namespace; the launcher drops to a fresh uid
    userns: bool = False  # bwrap makes a user namespace (uid 65534 inside, the caller's outside)
    proc: bool = True  # a /proc of its own is mounted (else an empty one: no /proc at all)
    drop_uid: bool = False  # without bwrap: the launcher (started as root) drops to a fresh uid
    missing: tuple[tuple[str, str], ...] = ()  # (layer, why) for each layer this machine does not give
    how: str = ""

    @property
    def present(self) -> tuple[str, ...]:
        gone = {name for name, _ in self.missing}
        return tuple(x for x in LAYERS if x not in gone)

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def other_uid(self) -> bool:
        """The program runs as a uid that is not the driver's (root dropped to a fresh one)."""
        return self.privileged or self.drop_uid

    def describe(self) -> str:
        gone = "; ".join(f"{name} ({why})" for name, why in self.missing)
        return (f"sandbox: {self.how}; layers: {', '.join(self.present)}"
                + (f"; missing: {gone}" if gone else ""))


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


def is_under(path: str, root: str) -> bool:
    return path == root or root == "/" or path.startswith(root.rstrip("/") + "/")


def _ancestors(path: str, below: str) -> list[str]:
    """The directories strictly between `below` and `path`: /a/b/c/d below /a -> [/a/b, /a/b/c]."""
    depth = len(PurePosixPath(below).parts)
    return [str(a) for a in reversed(PurePosixPath(path).parents) if len(a.parts) > depth]


def command(argv: Sequence[str], limits: Limits, layers: Layers, *, env: dict[str, str], workdir: str,
            uid: int | None = None, parent: int | None = None, binds: Sequence[str] = (),
            hidden: Sequence[str] = (), needed: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The command line that runs `argv` sandboxed with `layers`. A pure function of its arguments.

    binds: host paths the program sees read-only (the user's code); hidden: directories replaced by an empty tmpfs
    (the driver's home, secrets), except for the `needed` paths under them (the interpreter and its packages),
    which are bound back read-only; workdir: where the program runs (made by the launcher); uid: the uid the
    launcher drops to (started as root); parent: the pid whose death kills the program (without bwrap)."""
    opts = [f"{k}={v}" for k, v in limits.rlimits(count_processes=layers.userns or layers.other_uid)]
    if uid is not None:
        opts.append(f"uid={uid}")
    if parent is not None and layers.bwrap is None:
        opts.append(f"parent={parent}")
    opts.append(f"dir={workdir}")
    launch = [python, "-I", "-S", "-c", _LAUNCHER, *opts, "--", *argv]
    if layers.bwrap is None:
        return launch
    out = [layers.bwrap, "--die-with-parent", "--new-session",
           "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox",
           "--unshare-cgroup-try"]
    if layers.userns:
        out += ["--unshare-user", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID)]
    else:  # bwrap as root keeps every capability unless told: only what the launcher needs to drop to `uid`
        out += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    out += ["--ro-bind", "/", "/", "--dev", "/dev"]
    out += ["--proc", "/proc"] if layers.proc else ["--perms", "0555", "--size", "4096", "--tmpfs", "/proc"]
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
    covered = [p for p, _ in mounts]
    for e in exposed:
        if e in binds or any(is_under(e, c) for c in covered):  # needed paths elsewhere are in the read-only root
            mounts.append((e, "bind"))
    mounts.sort(key=lambda m: (len(PurePosixPath(m[0]).parts), m[1] != "tmp"))
    made: set[str] = set()
    rebound: set[str] = set()
    for path, kind in mounts:
        if kind == "tmp":
            out += ["--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", path]
        elif kind == "hide":
            out += ["--perms", "0755", "--size", "65536", "--tmpfs", path]
            rebound.add(path)
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
    out += ["--chdir", "/", "--", *launch]
    return out


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
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cands = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)), here,
             *sys.path]
    paths = sorted({os.path.realpath(p) for p in cands if p and os.path.isdir(p)})
    paths = [p for p in paths if not any(is_under(h, p) for h in (*hidden, *PRIVATE_TMP))]
    return [p for p in paths if not any(q != p and is_under(p, q) for q in paths)]  # outermost only


def fresh_uid() -> int:
    return FRESH_UIDS[0] + secrets.randbelow(FRESH_UIDS[1] - FRESH_UIDS[0])


@dataclass
class Sandboxed:
    """A running sandbox: its process (bwrap, or the launcher without it) and the host directory it runs in (only
    without bwrap: with it, its directory is a tmpfs of its own)."""

    popen: subprocess.Popen
    host_dir: str | None = None
    layers: Layers = field(default_factory=Layers)

    def kill(self, wait: float = 10.0) -> None:
        """SIGKILL it and everything it started. With bwrap: its PID namespace's init, which takes every process
        in the namespace along, and bwrap then exits by itself (so nothing is left to the machine's init to reap);
        then, and without bwrap, its process group."""
        if self.layers.bwrap is not None and self.popen.poll() is None:
            for pid in _children(self.popen.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.popen.wait(min(wait, 2.0))
            except subprocess.TimeoutExpired:
                pass
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(wait)
        except subprocess.TimeoutExpired:  # stuck in the kernel: it is SIGKILLed, leave it
            pass
        if self.host_dir:
            shutil.rmtree(self.host_dir, ignore_errors=True)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def spawn(argv: Sequence[str], limits: Limits, layers: Layers | None = None, *, env: dict[str, str] | None = None,
          binds: Sequence[str] = (), hidden: Sequence[str] | None = None, needed: Sequence[str] | None = None,
          **popen: Any) -> Sandboxed:
    """Start `argv` in a sandbox (`probe()`'s layers unless given); `popen` goes to subprocess.Popen (stdin,
    stdout, ...). The caller kills it (`Sandboxed.kill`) at its deadline."""
    layers = layers or probe()
    uid = fresh_uid() if layers.other_uid else None
    host_dir = None
    workdir = WORKDIR
    if layers.bwrap is None:  # no mount namespace: a fresh directory of the machine's, its own uid's when it has one
        host_dir = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
        workdir = host_dir
        if uid is not None:
            os.chown(host_dir, uid, uid)
    env = dict(env) if env is not None else clean_env(workdir=workdir)
    if layers.bwrap is None:
        env.update({"HOME": workdir, "TMPDIR": workdir})
    hidden = default_hidden() if hidden is None else hidden
    cmd = command(argv, limits, layers, env=env, workdir=workdir, uid=uid, parent=os.getpid(), binds=binds,
                  hidden=hidden, needed=default_needed(hidden) if needed is None else needed)
    try:
        proc = _popen(cmd, env=env, cwd="/", start_new_session=True, close_fds=True, **popen)
    except BaseException:
        if host_dir:
            shutil.rmtree(host_dir, ignore_errors=True)
        raise
    return Sandboxed(proc, host_dir, layers)


_spawner: tuple[int, ThreadPoolExecutor] | None = None


def _popen(cmd: list[str], **kw: Any) -> subprocess.Popen:
    """Popen from one long-lived thread: the parent-death signal (bwrap's --die-with-parent, the launcher's
    PR_SET_PDEATHSIG) fires when the thread that started a sandbox ends, so a sandbox started from a short-lived
    thread would die with that thread instead of with the driver."""
    global _spawner
    if _spawner is None or _spawner[0] != os.getpid():  # none yet, or a forked child's copy without its thread
        _spawner = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="hybridflow-sandbox"))
    return _spawner[1].submit(subprocess.Popen, cmd, **kw).result()


def _candidates(bwrap: str | None) -> list[Layers]:
    root = os.geteuid() == 0
    out = []
    if bwrap:
        if root:
            out += [Layers(bwrap, privileged=True, how="bwrap as root, a fresh uid"),
                    Layers(bwrap, privileged=True, proc=False, how="bwrap as root, a fresh uid, an empty /proc")]
        out += [Layers(bwrap, userns=True, how="bwrap in a user namespace"),
                Layers(bwrap, userns=True, proc=False, how="bwrap in a user namespace, an empty /proc")]
    if root:
        out.append(Layers(None, drop_uid=True, how="no bwrap, a fresh uid"))
    out.append(Layers(None, how="no bwrap"))
    return out


def _try(layers: Layers, check: Sequence[str], limits: Limits) -> str | None:
    """None when `check` runs and prints 'ok' in a sandbox of these layers, else why not."""
    try:
        box = spawn(check, limits, layers, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE)
    except OSError as err:
        return str(err)
    try:
        out, err = box.popen.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        box.kill()
        return "timed out starting"
    finally:
        box.kill(wait=1)
    if box.popen.returncode == 0 and out.strip() == b"ok":
        return None
    lines = [x for x in err.decode(errors="replace").strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else f"exit status {box.popen.returncode}"


@lru_cache(maxsize=None)
def probe(check: tuple[str, ...] = (sys.executable, "-I", "-S", "-c", "print('ok')"), bwrap: str | None = "",
          limits: Limits = Limits()) -> Layers:
    """The best sandbox this machine offers: each kind is tried, best first, by running `check` in it (it must
    print 'ok': pass the program's own start, e.g. its imports). bwrap="" finds it on PATH; None: do without."""
    if bwrap == "":
        bwrap = shutil.which("bwrap") or (os.path.exists("/usr/bin/bwrap") and "/usr/bin/bwrap") or None
    failures: dict[str, str] = {}
    for cand in _candidates(bwrap):
        why = _try(cand, check, limits)
        if why is None:
            return replace(cand, missing=_missing(cand, bwrap, failures))
        failures[cand.how] = why
    # Not even the bare launcher ran the check: report it; the caller's start fails with the program's own error.
    bare = Layers(None, how="no bwrap")
    return replace(bare, missing=_missing(bare, bwrap, failures))


def _missing(layers: Layers, bwrap: str | None, failures: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """(layer, why) for each layer `layers` leave out, why being what failed when the better kinds were tried."""
    tried_bwrap = [f"{how}: {why}" for how, why in failures.items() if how.startswith("bwrap")]
    out: list[tuple[str, str]] = []
    if layers.bwrap is None:
        why = "bwrap is not installed (apt-get install bubblewrap)" if bwrap is None else (
            "; ".join(tried_bwrap) if tried_bwrap else "bwrap failed")  # each kind: the best one may fail as expected
        out += [("network", why), ("processes", why), ("filesystem", why)]
    if not (layers.other_uid or layers.userns):
        if os.geteuid() == 0:
            why = failures.get("no bwrap, a fresh uid", "")
            why = f"a fresh uid cannot run the program: {why}" if why else "runs as root"
        else:
            why = "not root, and no user namespace"
        out.append(("user", why + "; nor a process-count limit (RLIMIT_NPROC would count the driver's processes)"))
    return tuple(out)


LAYER_TEXT = {"network": "no network", "processes": "its own PID namespace and /proc",
              "filesystem": "a read-only view of the machine with a private /tmp", "user": "another uid",
              "limits": "rlimits", "environment": "a clean environment"}
_warned: set[tuple[tuple[str, str], ...]] = set()


def warn_once(layers: Layers, what: str) -> None:
    """One warning per process (per set of missing layers): which layers `what` (e.g. 'the reward function') runs
    without, and why, and which it keeps."""
    if not layers.missing or layers.missing in _warned:
        return
    _warned.add(layers.missing)
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
    """Raise SandboxUnavailable when the sandbox is required and `layers` lack some layer; warn once otherwise."""
    if layers.missing and required(require):
        raise SandboxUnavailable(
            f"{what} must run in the whole sandbox ({REQUIRE_ENV}=require) but this machine lacks "
            + "; ".join(f"{name} ({why})" for name, why in layers.missing))
    warn_once(layers, what)
