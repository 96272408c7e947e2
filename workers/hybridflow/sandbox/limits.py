"""What a sandbox is made of, as data: the limits a sandbox's processes get and the layers a machine gives (see the
package's docstring for what each layer stops). Plain dataclasses and constants, shared by the launcher, the
process side and the probe, so that none of those has to import another for its vocabulary."""
from __future__ import annotations

from dataclasses import dataclass

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
LAYERS = ("network", "processes", "filesystem", "user", "limits", "environment", "syscalls", "cgroup")
# Layers whose absence is recorded (Layers.missing, describe) but never makes a required sandbox refuse to start:
# a cgroup of its own needs a delegated cgroup v2, which most machines and pods do not give; the rlimits hold there.
ADVISORY = ("cgroup",)
CGROUP_ENV = "HYBRIDFLOW_SANDBOX_CGROUP"  # a delegated cgroup v2 directory to make the sandboxes' cgroups in
# Numeric libraries start one thread per core (each a process for RLIMIT_NPROC, each with its own buffers for
# RLIMIT_AS); a sandboxed worker is one of several running side by side.
THREADS_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxUnavailable(RuntimeError):
    """The sandbox was required (`require`, HYBRIDFLOW_SANDBOX=require) but this machine lacks some of its layers."""


@dataclass(frozen=True)
class Private:
    """What of the job's own a sandbox must not read although the machine's files are readable: its data and
    checkpoints, where a tool the model calls would find the answers it is scored on. Directories and files apart,
    because each is hidden its own way (process.private_paths sorts a job's paths)."""

    dirs: tuple[str, ...] = ()
    files: tuple[str, ...] = ()


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

    @property
    def cgroup_memory_bytes(self) -> int:
        """memory.max of a sandbox's cgroup (where there is one): what one process may map plus both its tmpfs, so
        that it bounds the sandbox's processes together and never trips before a single process's rlimit."""
        return self.memory_bytes + 2 * self.tmp_bytes

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
    seccomp: bool = False  # bwrap loads the seccomp filter (hybridflow.sandbox.seccomp) before the program runs
    disable_userns: bool = False  # bwrap --disable-userns (in a user namespace, bwrap >= 0.8)
    cgroup: str | None = None  # a delegated cgroup v2 directory: each sandbox gets a child of it (memory/pids.max)
    missing: tuple[tuple[str, str], ...] = ()  # (layer, why) for each layer this machine does not give
    how: str = ""
    notes: tuple[str, ...] = ()  # what is weaker than it could be without a layer missing (e.g. no --disable-userns)

    @property
    def present(self) -> tuple[str, ...]:
        gone = {name for name, _ in self.missing}
        return tuple(x for x in LAYERS if x not in gone)

    @property
    def required_missing(self) -> tuple[tuple[str, str], ...]:
        """The missing layers a required sandbox refuses to run without (all but the ADVISORY ones)."""
        return tuple((name, why) for name, why in self.missing if name not in ADVISORY)

    @property
    def complete(self) -> bool:
        """Every layer but the advisory ones (a machine without a delegated cgroup still gives the whole sandbox)."""
        return not self.required_missing

    @property
    def other_uid(self) -> bool:
        """The program runs as a uid that is not the driver's (root dropped to a fresh one)."""
        return self.privileged or self.drop_uid

    def describe(self) -> str:
        gone = "; ".join(f"{name} ({why})" for name, why in self.missing)
        return (f"sandbox: {self.how}; layers: {', '.join(self.present)}"
                + (f"; missing: {gone}" if gone else "") + "".join(f"; note: {n}" for n in self.notes))
