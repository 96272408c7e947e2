"""Security contexts for the kubelet double, resolved as the kubelet and a CRI runtime resolve them, so that our pods
run as they would on a cluster (the job's pods ask for the restricted Pod Security Standard: runAsNonRoot, drop ALL,
no privilege escalation, seccomp RuntimeDefault, fsGroup): which uid, gid and groups a container runs as, which
capabilities it keeps, whether no_new_privs is set and which seccomp profile it gets, as the command line of
e2e/container_exec.py (which also gives each container its PID namespace, and an exec the container's); and
fsGroup's ownership of a volume (the kubelet's SetVolumeOwnership).
"""
from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.image import image_config
from e2e.seccomp_profile import PROFILE

LAUNCHER = Path(__file__).resolve().with_name("container_exec.py")
# What containerd (and CRI-O) give a container that neither drops nor adds any (oci.DefaultCapabilities)
DEFAULT_CAPS = frozenset({"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
                          "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
                          "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"})


class ContainerConfigError(Exception):
    """What the kubelet reports as CreateContainerConfigError (the container is not started)."""


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    groups: tuple[int, ...]
    caps: frozenset[str]
    no_new_privs: bool
    seccomp: Path | None  # the profile to load; None: Unconfined
    home: str  # HOME, where the container's env does not set it (the runtime takes it from the image's passwd)
    make_home: bool  # the image has that home (its Dockerfile made it)
    workdir: str


def _cap(name: str) -> str:
    name = name.upper()
    return name if name.startswith("CAP_") else f"CAP_{name}"


def capabilities(sc: dict[str, Any]) -> frozenset[str]:
    """A container's capability set: the runtime's defaults (all of them when privileged), less `drop` (ALL: every
    one), plus `add`."""
    if sc.get("privileged"):
        from e2e.container_exec import CAPS

        return frozenset(CAPS)
    spec = sc.get("capabilities") or {}
    drop = {_cap(c) for c in spec.get("drop") or []}
    caps = set() if "CAP_ALL" in drop else set(DEFAULT_CAPS) - drop
    return frozenset(caps | {_cap(c) for c in spec.get("add") or []} - {"CAP_ALL"})


def _seccomp(pod_sc: dict[str, Any], sc: dict[str, Any]) -> Path | None:
    profile = sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {"type": "Unconfined"}
    if sc.get("privileged") or profile["type"] == "Unconfined":
        return None
    if profile["type"] == "RuntimeDefault":
        return PROFILE
    raise ContainerConfigError(f"seccompProfile type {profile['type']} is not emulated")


def identity(pod: dict[str, Any], container: dict[str, Any]) -> Identity:
    """The container's identity: its securityContext over the pod's (runAsUser, runAsGroup, runAsNonRoot,
    seccompProfile), the image's USER where neither sets a uid, the pod's supplementalGroups and fsGroup as extra
    groups. runAsNonRoot with uid 0 is refused, as the kubelet refuses it."""
    spec = pod.get("spec") or {}
    pod_sc, sc = spec.get("securityContext") or {}, container.get("securityContext") or {}
    image = image_config(container.get("image", ""))

    def pick(key: str, default: Any = None) -> Any:
        return sc[key] if sc.get(key) is not None else pod_sc.get(key, default)

    uid = int(pick("runAsUser", image.uid))
    gid = int(pick("runAsGroup", image.gid if uid == image.uid else 0))
    if pick("runAsNonRoot") and uid == 0:
        raise ContainerConfigError("container has runAsNonRoot and image will run as root")
    groups = [int(g) for g in pod_sc.get("supplementalGroups") or []]
    if pod_sc.get("fsGroup") is not None:
        groups.append(int(pod_sc["fsGroup"]))
    return Identity(uid, gid, tuple(dict.fromkeys(groups)), capabilities(sc),
                    no_new_privs=sc.get("allowPrivilegeEscalation") is False, seccomp=_seccomp(pod_sc, sc),
                    home=image.home if uid == image.uid else "/", make_home=uid == image.uid and image.home_made,
                    workdir=container.get("workingDir") or image.workdir)


def launcher(ident: Identity, join: int | None = None) -> list[str]:
    """The argv prefix that runs a command as `ident` in its working directory (e2e/container_exec.py, with this
    Python: the runtime's): as PID 1 of its own PID namespace, or with `join` (a container's PID 1) in that
    container's namespaces, as an exec into it."""
    where = ["--pid-namespace"] if join is None else ["--join", str(join)]
    argv = [sys.executable, "-I", str(LAUNCHER), *where, "--cwd", ident.workdir, "--uid", str(ident.uid),
            "--gid", str(ident.gid), "--groups", ",".join(map(str, ident.groups)),
            "--caps", ",".join(sorted(ident.caps))]
    if ident.no_new_privs:
        argv.append("--no-new-privs")
    if ident.seccomp:
        argv += ["--seccomp", str(ident.seccomp)]
    return [*argv, "--"]


# The kubelet's SetVolumeOwnership (pkg/volume/volume_linux.go)
RW_MASK, RO_MASK, EXEC_MASK = 0o660, 0o440, 0o110


def _needs_change(root: Path, gid: int, readonly: bool) -> bool:
    st = root.stat()
    want = (RO_MASK if readonly else RW_MASK) | EXEC_MASK
    return st.st_gid != gid or not stat.S_ISDIR(st.st_mode) or st.st_mode & want != want \
        or not st.st_mode & stat.S_ISGID


def set_volume_ownership(root: Path, gid: int, policy: str | None = None, readonly: bool = False) -> None:
    """fsGroup on a volume, as the kubelet applies it before the pod's containers start: every file and directory
    gets group `gid` and group read-write (read-only volumes: read), directories also group search and the setgid
    bit, so that what is made in them later belongs to the group. With fsGroupChangePolicy OnRootMismatch nothing is
    done when the root already has that group and those bits."""
    if policy == "OnRootMismatch" and not _needs_change(root, gid, readonly):
        return
    mask = RO_MASK if readonly else RW_MASK
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [None, *filenames, *dirnames]:
            path = Path(dirpath) if name is None else Path(dirpath) / name
            try:
                st = path.lstat()
                os.lchown(path, -1, gid)
                if stat.S_ISLNK(st.st_mode) or (name in dirnames):
                    continue  # a symlink's target is not its to change; a directory is changed as its walk's root
                bits = mask | (EXEC_MASK | stat.S_ISGID if stat.S_ISDIR(st.st_mode) else 0)
                os.chmod(path, stat.S_IMODE(st.st_mode) | bits)
            except FileNotFoundError:  # removed meanwhile (a pod of the claim already running): nothing to own
                continue
