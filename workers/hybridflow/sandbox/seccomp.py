"""The seccomp filter a sandbox runs under (bwrap --seccomp FD loads it last, just before the program: bwrap's own
namespace and mount calls come before it). Built once per process with libseccomp (the `pyseccomp` package: ctypes
over libseccomp.so.2) and handed to each bwrap as BPF in a memfd.

Default allow; the calls a reward function, a tool or an environment never needs and that widen what of the kernel
it can reach are refused with EPERM: making or entering namespaces (unshare, setns, clone with a CLONE_NEW* flag),
mounting (mount, umount2, pivot_root, the new mount API), keyrings, ptrace and reading or writing other processes'
memory, bpf, perf_event_open, userfaultfd, io_uring, kernel modules and kexec, file handles (open_by_handle_at),
personality, and pushing input into a terminal (ioctl TIOCSTI, TIOCLINUX). clone3 answers ENOSYS: its flags are in
memory a filter cannot read, and glibc then falls back to clone, whose flags it can (fork, threads, subprocess and
posix_spawn keep working). Only the machine's native ABI is allowed: a call through another one (int 0x80 on
x86_64, x32) kills the process (libseccomp's bad-arch action).
"""
from __future__ import annotations

import errno
import os
from functools import lru_cache

REFUSED = (
    # namespaces and mounts
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount",
    "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    # keyrings
    "keyctl", "add_key", "request_key",
    # other processes' memory and tracing
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # kernel surface a sandboxed program has no use for
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "open_by_handle_at",
    "name_to_handle_at", "personality", "lookup_dcookie", "quotactl", "quotactl_fd", "acct", "swapon", "swapoff",
    "reboot", "syslog", "vhangup", "iopl", "ioperm", "uselib", "fanotify_init",
)
# clone's namespace flags (its first argument on x86_64 and aarch64); CLONE_NEWTIME is left out: in clone it is
# the low byte, the exit signal's (unshare and clone3, which could ask for a time namespace, are refused anyway).
CLONE_NEW = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
             "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
             "CLONE_NEWNET": 0x40000000}
TERMINAL_IOCTLS = {"TIOCSTI": 0x5412, "TIOCLINUX": 0x541C}


class SeccompUnavailable(RuntimeError):
    """No filter can be built here (pyseccomp or libseccomp.so.2 missing); the message says which."""


@lru_cache(maxsize=None)
def filter_bpf() -> bytes:
    """The filter as BPF, built once per process. Raises SeccompUnavailable."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError) as err:  # RuntimeError: pyseccomp found no libseccomp.so.2
        raise SeccompUnavailable(f"no seccomp filter: pyseccomp cannot load libseccomp ({type(err).__name__}: "
                                 f"{err}; apt-get install libseccomp2, pip install pyseccomp)") from None
    f = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    for name in REFUSED:
        if sc.resolve_syscall(sc.Arch.NATIVE, name) < 0:
            continue  # not a call of this architecture (iopl on aarch64: a negative pseudo number), or unknown
        f.add_rule(eperm, name)
    for flag in CLONE_NEW.values():  # one rule per flag: libseccomp compares (arg & mask) == value
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for request in TERMINAL_IOCTLS.values():
        f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    fd = os.memfd_create("hybridflow-seccomp-export")
    try:
        with open(fd, "w+b", closefd=False) as out:
            f.export_bpf(out)
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    finally:
        os.close(fd)
    if not data or len(data) % 8:
        raise SeccompUnavailable(f"libseccomp exported {len(data)} bytes, not a BPF program")
    return data


def unavailable() -> str | None:
    """Why no filter can be built here (None: it can)."""
    try:
        filter_bpf()
    except SeccompUnavailable as err:
        return str(err)
    return None


def filter_fd() -> int:
    """A new fd holding the filter, read from its start (bwrap --seccomp reads it to its end and closes it): the
    caller passes it to bwrap (pass_fds) and closes its own copy once bwrap started."""
    data = filter_bpf()
    try:
        fd = os.memfd_create("hybridflow-seccomp")
    except (AttributeError, OSError):  # no memfd: a pipe holds it (the filter is far below a pipe's buffer)
        r, w = os.pipe()
        try:
            os.write(w, data)
        finally:
            os.close(w)
        return r
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
