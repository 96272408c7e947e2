"""The container runtime's last step, for the kubelet double: what runc does between a container's mounts and its
command. The double's mount script (e2e/kubelet.py) execs into this as root once the pod's mounts are in place
(they need root); it gives the container a PID namespace of its own, sets the groups (supplementalGroups and
fsGroup), the gid and uid, the capabilities, no_new_privs and the seccomp filter, then execs the container's command
with the container's environment.

    python -I e2e/container_exec.py --pid-namespace --uid 1000 --gid 1000 --groups 1000 --caps '' --no-new-privs \
        --seccomp e2e/seccomp/runtime-default.json -- ARGV...

An exec into a running container (a preStop hook) joins that container's PID, mount and UTS namespaces instead
(`--join PID`), as the runtime's exec does: the hook sees the container's processes (Ray's client looks for its
node's raylet among them) and files.

The PID namespace: the command runs as its PID 1 with a /proc of its own, as in a container (without
shareProcessNamespace), so that it sees and signals no other pod's processes (or their /proc/<pid>/environ, which a
same-uid process could read); this launcher stays behind as its parent, outside it, ignoring SIGTERM and SIGINT
(the double signals every process of the pod), and exits as the command did (killed by a signal: by that signal).
As a container's PID 1, the command ignores the signals it has no handler for, except SIGKILL and SIGSTOP from
outside; what ends a pod here is the double's SIGKILL of every process in its network namespace.

Capabilities, as CRI runtimes set them: `--caps` (after the container's drop and add) is the bounding set; a
non-root uid keeps none in its effective, permitted and ambient sets (setuid away from root clears them); root keeps
exactly `--caps`. The seccomp filter is loaded last where no_new_privs is set (the kernel then lets an unprivileged
process load it), and before the uid changes otherwise (loading it then needs CAP_SYS_ADMIN), as runc orders it.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # -I leaves the script's directory out

from e2e.seccomp_profile import prepare  # noqa: E402

# The kernel's capability numbers (include/uapi/linux/capability.h), CAP_CHOWN = 0 onwards.
CAPS = ("CAP_CHOWN CAP_DAC_OVERRIDE CAP_DAC_READ_SEARCH CAP_FOWNER CAP_FSETID CAP_KILL CAP_SETGID CAP_SETUID "
        "CAP_SETPCAP CAP_LINUX_IMMUTABLE CAP_NET_BIND_SERVICE CAP_NET_BROADCAST CAP_NET_ADMIN CAP_NET_RAW "
        "CAP_IPC_LOCK CAP_IPC_OWNER CAP_SYS_MODULE CAP_SYS_RAWIO CAP_SYS_CHROOT CAP_SYS_PTRACE CAP_SYS_PACCT "
        "CAP_SYS_ADMIN CAP_SYS_BOOT CAP_SYS_NICE CAP_SYS_RESOURCE CAP_SYS_TIME CAP_SYS_TTY_CONFIG CAP_MKNOD "
        "CAP_LEASE CAP_AUDIT_WRITE CAP_AUDIT_CONTROL CAP_SETFCAP CAP_MAC_OVERRIDE CAP_MAC_ADMIN CAP_SYSLOG "
        "CAP_WAKE_ALARM CAP_BLOCK_SUSPEND CAP_AUDIT_READ CAP_PERFMON CAP_BPF CAP_CHECKPOINT_RESTORE").split()
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWPID = 0x00020000, 0x04000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int = 0) -> None:
    zero = ctypes.c_ulong(0)
    _check(_libc.prctl(option, ctypes.c_ulong(arg), zero, zero, zero), f"prctl({option}, {arg})")


def _capset(mask: int) -> None:
    """effective = permitted = `mask`, inheritable empty."""
    data = (_CapData * 2)()
    for i in (0, 1):
        part = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective, data[i].permitted, data[i].inheritable = part, part, 0
    _check(_libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), data), "capset")


def _drop_bounding(keep: set[str]) -> None:
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for number in range(last + 1):
        if number >= len(CAPS) or CAPS[number] not in keep:
            _prctl(PR_CAPBSET_DROP, number)


def _pid_namespace(join: int | None) -> None:
    """Returns in a child that is PID 1 of a new PID namespace, with a /proc of its own in a mount namespace of its
    own (private: never the caller's /proc), or with `join`, in the PID, mount and UTS namespaces of process `join`
    (a container's: an exec into it); the parent waits for it and exits as it did."""
    if join is None:
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    else:
        fds = {flag: os.open(f"/proc/{join}/ns/{name}", os.O_RDONLY)
               for name, flag in (("pid", CLONE_NEWPID), ("mnt", CLONE_NEWNS), ("uts", CLONE_NEWUTS))}
        _check(_libc.setns(fds[CLONE_NEWPID], CLONE_NEWPID), f"setns(pid of {join})")
    child = os.fork()
    if child == 0:
        if join is None:
            _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            _check(_libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None), "mount --make-rprivate /")
            _check(_libc.mount(b"proc", b"/proc", b"proc", ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC), None),
                   "mount /proc")
        else:
            for flag in (CLONE_NEWNS, CLONE_NEWUTS):
                _check(_libc.setns(fds[flag], flag), f"setns({flag:#x} of {join})")
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not end a process
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pid-namespace", action="store_true", help="run the command as PID 1 of a PID namespace")
    p.add_argument("--join", type=int, metavar="PID", help="run it in the PID, mount and UTS namespaces of PID")
    p.add_argument("--cwd", help="its working directory (made by the caller)")
    p.add_argument("--uid", type=int, required=True)
    p.add_argument("--gid", type=int, required=True)
    p.add_argument("--groups", default="", help="supplementary gids, comma-separated")
    p.add_argument("--caps", default="", help="the capability set, comma-separated (CAP_...); empty: none")
    p.add_argument("--no-new-privs", action="store_true")
    p.add_argument("--seccomp", type=Path, help="a seccomp profile (JSON) to load")
    p.add_argument("command", nargs="+")
    a = p.parse_args(argv)
    keep = {c for c in a.caps.split(",") if c}
    unknown = keep - set(CAPS)
    if unknown:
        sys.exit(f"container_exec: unknown capabilities {sorted(unknown)}")
    seccomp = prepare(a.seccomp, keep) if a.seccomp else None
    if a.pid_namespace or a.join:
        _pid_namespace(a.join)
    if a.cwd:
        os.chdir(a.cwd)
    if seccomp and not a.no_new_privs:
        seccomp.load()
    _drop_bounding(keep)
    os.setgroups([int(g) for g in a.groups.split(",") if g])
    os.setresgid(a.gid, a.gid, a.gid)
    os.setresuid(a.uid, a.uid, a.uid)  # to a non-root uid: permitted, effective and ambient sets emptied
    _capset(sum(1 << CAPS.index(c) for c in keep) if a.uid == 0 else 0)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    if a.no_new_privs:
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if seccomp:
            seccomp.load()
    try:
        os.execvp(a.command[0], a.command)
    except OSError as err:  # a runtime's start error: the container exits 128 (StartError)
        print(f"container_exec: exec {a.command[0]}: {err.strerror}", file=sys.stderr)
        sys.exit(128)


if __name__ == "__main__":
    main()
