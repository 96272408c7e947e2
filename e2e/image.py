"""What the kubelet double takes from a container's image. Every "image" runs this machine's Python environment and
this checkout (no image is pulled), but each keeps what its Dockerfile under images/ says about the process: its
USER (worker-cpu: uid 1000, which runAsNonRoot lets run), that user's HOME and the WORKDIR. An image this
repository does not build runs as root, as an image without USER does.

Running as that user here means the files of "the image" must be reachable by it: the Python environment lives
where a user of this machine put it (pyenv under /root, 0700), unlike an image's /usr/local. `reachable` gives the
mount-script lines that show each such path inside the pod's mount namespace under a stand-in for the directory that
hides it (a tmpfs holding only that path), so the host's own permissions stay as they are.
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the image's files: this checkout (the editable install points into it), the virtualenv and the Python under it
IMAGE_PATHS = sorted({ROOT, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()})


@dataclass(frozen=True)
class ImageConfig:
    uid: int = 0
    gid: int = 0
    home: str = "/root"
    home_made: bool = True  # the image has its user's home (useradd --create-home), empty
    workdir: str = "/"


def image_config(image: str, dockerfiles: Path = ROOT / "images") -> ImageConfig:
    """USER, its home and WORKDIR of `image` (e.g. hybridflow/worker-cpu:0.1.0 -> images/worker-cpu/Dockerfile):
    the last USER (uid[:gid]; without a gid, the user's own group, which `useradd` gives the same number) and WORKDIR
    instructions; the home `useradd` gives that uid (/home/<name>)."""
    name = image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]
    path = dockerfiles / name / "Dockerfile"
    if not name or not path.is_file():
        return ImageConfig()
    text = path.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    workdirs = re.findall(r"^WORKDIR\s+(\S+)", text, re.M)
    workdir = workdirs[-1] if workdirs else "/"
    if not users or users[-1].split(":")[0] in ("0", "root"):
        return ImageConfig(workdir=workdir)
    uid, _, gid = users[-1].partition(":")
    home, made = "/", False
    for line in re.findall(r"useradd\s+([^\n&;]+)", text):
        words = shlex.split(line)
        if "--uid" in words and words[words.index("--uid") + 1] == uid:
            home, made = f"/home/{words[-1]}", "--create-home" in words or "-m" in words
    return ImageConfig(int(uid), int(gid or uid), home, made, workdir)


def _hiding(path: Path) -> Path | None:
    """The outermost directory above `path` that others may not search (mode without o+x), if any."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not parent.stat().st_mode & 0o001:
            return parent
    return None


def reachable(staging: Path) -> list[str]:
    """Mount-script lines (run as root in the pod's mount namespace) that keep every image path reachable by any
    uid: the path is bound aside into `staging` (a directory of the pod's), a tmpfs (mode 0711) replaces the
    directory that hides it, and the path is moved back into place inside that tmpfs."""
    lines, hidden = [], {}
    for path in IMAGE_PATHS:
        if (outer := _hiding(path)) is not None:
            hidden.setdefault(outer, []).append(path)
    for n, (outer, paths) in enumerate(sorted(hidden.items())):
        paths = [p for p in paths if not any(q in p.parents for q in paths)]
        aside = [staging / f"{n}.{i}" for i in range(len(paths))]
        for path, there in zip(paths, aside):
            there.mkdir(parents=True, exist_ok=True)
            lines.append(f"mount --bind {shlex.quote(str(path))} {shlex.quote(str(there))}")
        lines.append(f"mount -t tmpfs -o mode=0711,size=1m tmpfs {shlex.quote(str(outer))}")
        for path, there in zip(paths, aside):
            lines += [f"mkdir -p {shlex.quote(str(path))}", f"mount --move {shlex.quote(str(there))} "
                      f"{shlex.quote(str(path))}"]
    return lines
