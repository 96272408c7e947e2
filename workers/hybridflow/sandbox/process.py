"""A running sandbox: starting one (`spawn`), killing it with everything it started (`Sandboxed.kill`), and finding
which kinds this machine runs (`probe`, by starting trial sandboxes: hence in this module). Kept apart from the
command line (launcher.py, pure) because this side owns processes, a host directory and the one long-lived thread
every sandbox is started from."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Sequence

from hybridflow.sandbox import cgroup as cgroups
from hybridflow.sandbox import launcher, reaper, seccomp
from hybridflow.sandbox.limits import WORKDIR, Layers, Limits, Private


@dataclass
class Sandboxed:
    """A running sandbox: its process (bwrap, or the launcher without it), the host directory it runs in (only
    without bwrap: with it, its directory is a tmpfs of its own) and its cgroup (where one was delegated)."""

    popen: subprocess.Popen
    host_dir: str | None = None
    layers: Layers = field(default_factory=Layers)
    cgroup: str | None = None

    def signal_of(self, returncode: int) -> int:
        """The signal that ended the sandboxed program (0: it exited): bwrap exits 128 + the signal of what it ran,
        Popen reports a signal of its own child as a negative status."""
        if returncode < 0:
            return -returncode
        return returncode - 128 if self.layers.bwrap is not None and returncode > 128 else 0

    def kill(self, wait: float = 10.0) -> None:
        """SIGKILL it and everything it started. With bwrap: its PID namespace's init, which takes every process
        in the namespace along, and bwrap then exits by itself (so nothing is left to the machine's init to reap);
        then, and without bwrap, its process group; with a cgroup of its own, everything in that cgroup too."""
        if self.cgroup and self.popen.poll() is None:
            cgroups.kill(self.cgroup)
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
        if self.cgroup:
            cgroups.kill(self.cgroup)  # what a process of it left (none with bwrap: its PID namespace is gone)
            cgroups.remove(self.cgroup, wait=min(wait, 2.0))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def spawn(argv: Sequence[str], limits: Limits, layers: Layers | None = None, *, env: dict[str, str] | None = None,
          binds: Sequence[str] = (), hidden: Sequence[str] | None = None, needed: Sequence[str] | None = None,
          private: Sequence[str] = (), **popen: Any) -> Sandboxed:
    """Start `argv` in a sandbox (`probe()`'s layers unless given); `popen` goes to subprocess.Popen (stdin,
    stdout, ...). The caller kills it (`Sandboxed.kill`) at its deadline. `private`: the job's paths (data,
    checkpoints) the program must not read; they need bwrap's mounts (without bwrap only its uid's permissions
    hold, and the policy's warning says the filesystem layer is missing)."""
    if layers is None:
        layers = probe()
    uid = launcher.fresh_uid() if layers.other_uid else None
    host_dir = None
    workdir = WORKDIR
    if layers.bwrap is None:  # no mount namespace: a fresh directory of the machine's, its own uid's when it has one
        host_dir = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
        workdir = host_dir
        if uid is not None:
            os.chown(host_dir, uid, uid)
    env = dict(env) if env is not None else launcher.clean_env(workdir=workdir)
    if layers.bwrap is None:
        env.update({"HOME": workdir, "TMPDIR": workdir})
    hidden = launcher.default_hidden() if hidden is None else hidden
    mine = private_paths(private)
    if needed is None:
        needed = launcher.default_needed([*hidden, *mine.dirs])
    group = filter_fd = None
    try:
        group = cgroups.make(layers.cgroup, limits) if layers.cgroup else None
        filter_fd = seccomp.filter_fd() if layers.seccomp and layers.bwrap else None
        cmd = launcher.command(argv, limits, layers, env=env, workdir=workdir, uid=uid, parent=os.getpid(),
                               binds=binds, hidden=hidden, needed=needed, private=mine, seccomp_fd=filter_fd,
                               cgroup=group)
        fds = (*popen.pop("pass_fds", ()), *((filter_fd,) if filter_fd is not None else ()))
        with reaper.starting() as track:  # a sandbox pool's reaper (if one runs) leaves what it starts alone
            proc = _popen(cmd, env=env, cwd="/", start_new_session=True, close_fds=True, pass_fds=fds, **popen)
            track(proc)
    except BaseException:
        if host_dir:
            shutil.rmtree(host_dir, ignore_errors=True)
        if group:
            cgroups.remove(group, wait=0)
        raise
    finally:
        if filter_fd is not None:  # bwrap holds its own copy
            os.close(filter_fd)
    return Sandboxed(proc, host_dir, layers, group)


def private_paths(paths: Sequence[str]) -> Private:
    """The job's paths as the launcher hides them: real paths (a symlink's target is what a program would open),
    directories apart from files; what does not exist here (a glob's pattern, a path of another machine) is left."""
    dirs, files = set(), set()
    for p in paths:
        real = os.path.realpath(p)
        if os.path.isdir(real):
            dirs.add(real)
        elif os.path.isfile(real):
            files.add(real)
    return Private(tuple(sorted(dirs)), tuple(sorted(files)))


_spawner: tuple[int, ThreadPoolExecutor] | None = None


def _popen(cmd: list[str], **kw: Any) -> subprocess.Popen:
    """Popen from one long-lived thread: the parent-death signal (bwrap's --die-with-parent, the launcher's
    PR_SET_PDEATHSIG) fires when the thread that started a sandbox ends, so a sandbox started from a short-lived
    thread would die with that thread instead of with the driver."""
    global _spawner
    if _spawner is None or _spawner[0] != os.getpid():  # none yet, or a forked child's copy without its thread
        _spawner = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="hybridflow-sandbox"))
    return _spawner[1].submit(subprocess.Popen, cmd, **kw).result()


# Which layers this machine offers (`probe`, the default of `spawn`): found by starting a trial sandbox of each kind,
# best first. Trying is the only reliable test: whether bwrap, user namespaces or a fresh /proc work depends on the
# container runtime, seccomp and sysctls, none of which can be read reliably from inside.


@lru_cache(maxsize=None)
def bwrap_version(bwrap: str) -> tuple[int, ...]:
    """bwrap's version, (0,) where it does not say (`bwrap --version`: "bubblewrap 0.8.0")."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(x) for x in out.split()[-1].split(".")[:3])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return (0,)


DISABLE_USERNS_SINCE = (0, 8)  # bwrap --disable-userns


def candidates(bwrap: str | None) -> list[Layers]:
    """The kinds of sandbox worth trying here, best first (the root-only kinds only as root), each with the seccomp
    filter where one can be built, --disable-userns where bwrap has it, and a cgroup where one is delegated."""
    root = os.geteuid() == 0
    filtered = seccomp.unavailable() is None
    group = cgroups.delegated()[0]
    nested = bool(bwrap) and bwrap_version(bwrap) >= DISABLE_USERNS_SINCE
    out = []
    if bwrap:
        if root:
            out += [Layers(bwrap, privileged=True, how="bwrap as root, a fresh uid"),
                    Layers(bwrap, privileged=True, proc=False, how="bwrap as root, a fresh uid, an empty /proc")]
        out += [Layers(bwrap, userns=True, disable_userns=nested, how="bwrap in a user namespace"),
                Layers(bwrap, userns=True, proc=False, disable_userns=nested,
                       how="bwrap in a user namespace, an empty /proc")]
    out = [replace(c, seccomp=filtered) for c in out]
    if root:
        out.append(Layers(None, drop_uid=True, how="no bwrap, a fresh uid"))
    out.append(Layers(None, how="no bwrap"))
    return [replace(c, cgroup=group) for c in out]


def weaker(layers: Layers) -> list[tuple[Layers, str]]:
    """The same kind with its optional parts given up one at a time, the first given up first: (the kind, what
    it gave up). Tried when the whole kind fails to start, so that a cgroup, --disable-userns or a filter that
    fails here costs that part (reported) and not the kind."""
    out: list[tuple[Layers, str]] = []
    for part, name, off in (("cgroup", "cgroup", None), ("disable_userns", "--disable-userns", False),
                            ("seccomp", "syscalls", False)):
        if getattr(layers, part):
            layers = replace(layers, **{part: off})
            out.append((layers, name))
    return out


def try_layers(layers: Layers, check: Sequence[str], limits: Limits) -> str | None:
    """None when `check` runs and prints 'ok' in a sandbox of these layers, else why not."""
    try:
        box = spawn(check, limits, layers, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE)
    except (OSError, seccomp.SeccompUnavailable) as err:
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
    for cand in candidates(bwrap):
        why = first = try_layers(cand, check, limits)
        lost: dict[str, str] = {}  # an optional part given up -> what failed with it
        for less, gave_up in weaker(cand) if why is not None else ():
            lost[gave_up] = why
            why = try_layers(less, check, limits)
            if why is None:
                cand = less
                break
        if why is None:
            return replace(cand, missing=missing_layers(cand, bwrap, failures, lost), notes=notes(cand, lost))
        failures[cand.how] = first or why
    # Not even the bare launcher ran the check: report it; the caller's start fails with the program's own error.
    bare = Layers(None, how="no bwrap")
    return replace(bare, missing=missing_layers(bare, bwrap, failures))


def missing_layers(layers: Layers, bwrap: str | None, failures: dict[str, str],
                   lost: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """(layer, why) for each layer `layers` leave out, why being what failed when the better kinds were tried (or,
    `lost`, when this kind was tried with an optional part it then gave up)."""
    lost = lost or {}
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
    if not layers.seccomp:
        if layers.bwrap is None:
            why = "no seccomp filter without bwrap (bwrap --seccomp loads it)"
        elif "syscalls" in lost:
            why = f"the seccomp filter failed to load: {lost['syscalls']}"
        else:
            why = seccomp.unavailable() or "no seccomp filter was asked for"
        out.append(("syscalls", why))
    if not layers.cgroup:
        why = f"a sandbox's cgroup failed: {lost['cgroup']}" if "cgroup" in lost else cgroups.delegated()[1]
        out.append(("cgroup", why or "no cgroup was asked for"))
    return tuple(out)


def notes(layers: Layers, lost: dict[str, str] | None = None) -> tuple[str, ...]:
    """What `layers` give weaker than they could, without a layer missing: a user namespace without
    --disable-userns (the seccomp filter alone refuses the program user namespaces of its own)."""
    if not (layers.bwrap and layers.userns) or layers.disable_userns:
        return ()
    lost = lost or {}
    why = (f"--disable-userns failed: {lost['--disable-userns']}" if "--disable-userns" in lost else
           f"bwrap {'.'.join(map(str, bwrap_version(layers.bwrap)))} has no --disable-userns (since "
           f"{'.'.join(map(str, DISABLE_USERNS_SINCE))})")
    holds = "only the seccomp filter refuses" if layers.seccomp else "nothing refuses"
    return (f"{why}: {holds} the program user namespaces of its own",)
