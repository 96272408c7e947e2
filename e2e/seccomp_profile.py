"""seccomp `RuntimeDefault` for the kubelet double: the published default profile (e2e/seccomp/runtime-default.json,
moby's; containerd's RuntimeDefault is generated from the same list and CRI-O's has the same format) turned into a
libseccomp filter the way the runtimes do it, so that a pod asking for RuntimeDefault meets what it would meet on a
cluster: above all, a process without CAP_SYS_ADMIN cannot make namespaces (no `unshare`, no `clone` with a
CLONE_NEW* flag), so bubblewrap's sandboxes cannot start in our pods.

The translation follows moby's `setupSeccomp` (which entries apply: `includes`/`excludes` by architecture, by the
container's capabilities, by kernel version) and runc's `InitSeccomp` (how an entry becomes rules: its action and
errnoRet, its argument conditions; names this libseccomp does not know are skipped, as runc skips them). Pure but
`build` and `prepare`, which make the libseccomp filter.
"""
from __future__ import annotations

import errno
import json
import os
import platform
from pathlib import Path
from typing import Any

PROFILE = Path(__file__).resolve().parent / "seccomp" / "runtime-default.json"
# the names the profile's `arches` use (Go's, through moby's goToNative) for this machine's
GO_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "i686": "x86", "ppc64le": "ppc64le", "s390x": "s390x",
           "riscv64": "riscv64"}
OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6,
       "SCMP_CMP_MASKED_EQ": 7}  # libseccomp's enum scmp_compare
SCMP_ARCH = {"SCMP_ARCH_X86_64": "amd64", "SCMP_ARCH_AARCH64": "arm64"}  # archMap's native entries we know


def native_arch() -> str:
    return GO_ARCH.get(platform.machine(), platform.machine())


def kernel_version() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _at_least(kernel: tuple[int, int], version: str) -> bool:
    major, minor = (int(x) for x in version.split(".")[:2])
    return kernel >= (major, minor)


def applies(entry: dict[str, Any], caps: frozenset[str] | set[str], arch: str, kernel: tuple[int, int]) -> bool:
    """Whether a `syscalls` entry of the profile is part of this container's filter (moby's setupSeccomp): not when
    an `excludes` matches (its arch is ours, any of its caps is the container's, the kernel is at least its
    minKernel); only when every `includes` holds (our arch among its arches, all its caps the container's, the
    kernel at least its minKernel). `caps`: the container's capability set after `drop` and `add` (drop ALL: none,
    so entries that need a cap are left out and entries for those without it apply)."""
    ex, inc = entry.get("excludes") or {}, entry.get("includes") or {}
    if arch in (ex.get("arches") or []) or any(c in caps for c in ex.get("caps") or []):
        return False
    if ex.get("minKernel") and _at_least(kernel, ex["minKernel"]):
        return False
    if inc.get("arches") and arch not in inc["arches"]:
        return False
    if not all(c in caps for c in inc.get("caps") or []):
        return False
    return not (inc.get("minKernel") and not _at_least(kernel, inc["minKernel"]))


def action(name: str, errno_ret: int | None) -> int:
    """libseccomp's action value for a profile's action name (runc's: ERRNO and TRACE default to EPERM)."""
    import pyseccomp as sc

    fixed = {"SCMP_ACT_ALLOW": sc.ALLOW, "SCMP_ACT_KILL": sc.KILL_THREAD, "SCMP_ACT_KILL_THREAD": sc.KILL_THREAD,
             "SCMP_ACT_KILL_PROCESS": sc.KILL_PROCESS, "SCMP_ACT_TRAP": sc.TRAP, "SCMP_ACT_LOG": sc.LOG}
    if name in fixed:
        return fixed[name]
    code = errno.EPERM if errno_ret is None else errno_ret
    if name == "SCMP_ACT_ERRNO":
        return sc.ERRNO(code)
    if name == "SCMP_ACT_TRACE":
        return sc.TRACE(code)
    raise ValueError(f"seccomp action {name} is not emulated")


def rules(profile: dict[str, Any], caps: frozenset[str] | set[str], arch: str | None = None,
          kernel: tuple[int, int] | None = None) -> list[tuple[str, int | None, str, tuple]]:
    """(action, errnoRet, syscall name, conditions) for every rule of the filter, in the profile's order; a rule's
    conditions (index, op, value, valueTwo) all hold at once, except where two name the same argument: then each is
    a rule of its own (runc's rule). Rules whose action is the default one are left out (they change nothing)."""
    arch, kernel = arch or native_arch(), kernel or kernel_version()
    default = (profile["defaultAction"], profile.get("defaultErrnoRet"))
    out = []
    for entry in profile["syscalls"]:
        if not applies(entry, caps, arch, kernel):
            continue
        act = (entry["action"], entry.get("errnoRet"))
        if act == default:
            continue
        conds = [(a["index"], a["op"], a["value"], a.get("valueTwo", 0)) for a in entry.get("args") or []]
        indexes = [c[0] for c in conds]
        groups = [(c,) for c in conds] if len(set(indexes)) < len(indexes) else [tuple(conds)]
        for name in entry.get("names") or [entry["name"]]:
            out += [(*act, name, group) for group in groups]
    return out


def build(profile: dict[str, Any], caps: frozenset[str] | set[str]):
    """The libseccomp filter: the default action, the native architecture and its archMap sub-architectures (x86 and
    x32 beside x86_64), and `rules`. The filter does not set no_new_privs itself (the caller decides, as runc)."""
    import pyseccomp as sc

    filt = sc.SyscallFilter(action(profile["defaultAction"], profile.get("defaultErrnoRet")))
    filt.set_attr(sc.Attr.CTL_NNP, 0)
    native = native_arch()
    for entry in profile.get("archMap") or []:
        if SCMP_ARCH.get(entry["architecture"]) == native:
            for sub in entry.get("subArchitectures") or []:
                known = getattr(sc.Arch, sub.removeprefix("SCMP_ARCH_"), None)
                if known is not None and not filt.exist_arch(known):
                    filt.add_arch(known)
    for act, errno_ret, name, conds in rules(profile, caps):
        number = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if number == -1:  # __NR_SCMP_ERROR: unknown to this libseccomp (newer than it), skipped as runc skips it
            continue
        filt.add_rule(action(act, errno_ret), number, *(sc.Arg(i, OPS[op], a, b) for i, op, a, b in conds))
    return filt


def prepare(path: Path, caps: frozenset[str] | set[str]):
    """The filter for the profile at `path`, ready for its `load()` (which installs it in the calling process,
    inherited across fork and exec). Made before the process drops its privileges: what it imports and reads may
    not be readable by the container's uid."""
    return build(json.loads(Path(path).read_text()), caps)
