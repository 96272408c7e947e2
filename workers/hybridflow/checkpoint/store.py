"""Where checkpoints live and how their files are read: a local (or mounted) directory, or object storage.

Object storage (s3://bucket/prefix, or any fsspec protocol) is reached through a UPath, which has Path's interface.
It has no rename and no append, and a PUT replaces an object whole: a checkpoint there is written in place (its
manifest, written last, is what seals it) and the step log is written in parts. Everything here is the storage
both the controller (sealing, the step log) and the ranks (DCP shards) use; the URL grammar itself is
`hybridflow.api.storage`, which the operator imports without any of this."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import IO, Any, Union

from hybridflow.api.storage import is_url

MANIFEST = "MANIFEST.json"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be used, or one that could not be written; the message says what to do."""


class LinkRefused(OSError):
    """A symbolic link met at or below a checkpoint's step directory, which is never followed: a link planted on a
    shared claim (`step_N -> ../../other-namespace/their-job/step_N`, or a shard linked to a path of the node) must
    not make a job read another job's checkpoint or a host file. An OSError, so that what skips an unreadable
    checkpoint skips this one too; the message names the link."""


def link_refused(path: StoragePath) -> LinkRefused:
    try:
        target = f" (to {os.readlink(path)!r})"
    except OSError:
        target = ""
    return LinkRefused(f"{path} is a symbolic link{target}: a checkpoint's step directories and the files in them are "
                       f"never opened through a link, which could lead to another job's checkpoint or a path of the "
                       f"node; refusing it. Delete the link, or name a checkpoint that is a real directory")


def is_link(p: StoragePath) -> bool:
    """Whether `p` is a symbolic link itself (object storage has none)."""
    return not is_remote(p) and os.path.islink(p)


def _open_dir_below(fd: int, name: str, where: Path) -> int:
    """The directory `name` in the directory `fd` (closed), opened without following a link: a link is refused."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(os.stat(name, dir_fd=fd,
                                                                            follow_symlinks=False).st_mode):
            raise link_refused(where) from err
        raise
    finally:
        os.close(fd)


def open_below(base: StoragePath, rel: str) -> IO[bytes]:
    """`base/rel` opened for reading, where no component of `rel` may be a symbolic link: each directory of it is
    opened from the one above without following a link (O_NOFOLLOW with the directory's descriptor), and the file
    opened (O_NOFOLLOW) must be the very one found in the last of them, a regular file (no FIFO to hang on, no
    device). `base` is the caller's trusted directory (a checkpointDir, a resumeFrom job's directory: a mount);
    `rel` starts at a step directory. A link raises LinkRefused naming it; on object storage (no links) the object
    is opened as it is."""
    if is_remote(base):
        return (base / rel).open("rb")
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or any(p in (".", "..") for p in parts):
        raise ValueError(f"{rel!r} is not a path below a checkpoint directory")
    base, fd = Path(base), os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for i, part in enumerate(parts[:-1]):
        fd = _open_dir_below(fd, part, base.joinpath(*parts[:i + 1]))
    full = base.joinpath(*parts)
    try:
        found = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)
    if stat.S_ISLNK(found.st_mode):
        raise link_refused(full)
    if not stat.S_ISREG(found.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", str(full))
    # by its whole path (what audit hooks and error messages name), checked to be the file found above
    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (found.st_dev, found.st_ino):
        os.close(fd)
        raise LinkRefused(f"{full} changed while it was being opened (a directory on its path replaced by a symbolic "
                          f"link?); refusing it")
    return os.fdopen(fd, "rb")


def open_in(ckpt: StoragePath, name: str) -> IO[bytes]:
    """File `name` of checkpoint directory `ckpt` (a step_N), opened without following a link at `ckpt` or below
    (`open_below` from `ckpt`'s parent, the checkpointDir)."""
    return open_below(ckpt.parent, f"{ckpt.name}/{name}")


def open_tail(path: StoragePath, levels: int) -> IO[bytes]:
    """`path` opened without following a link in its last `levels` components (e.g. 3: step_N/<role>/<shard>)."""
    if is_remote(path):
        return path.open("rb")
    path = Path(path)
    base = path.parents[levels - 1] if len(path.parents) >= levels else Path(path.anchor or ".")
    return open_below(base, str(path.relative_to(base)))


def read_text_in(ckpt: StoragePath, name: str) -> str:
    """The text of file `name` of checkpoint `ckpt` (`open_in`)."""
    with open_in(ckpt, name) as f:
        return f.read().decode()


def links_in(ckpt: StoragePath) -> list[StoragePath]:
    """The symbolic links at and below checkpoint directory `ckpt` (itself first, if it is one), none followed."""
    if is_remote(ckpt):
        return []
    if os.path.islink(ckpt):
        return [ckpt]
    out, todo = [], [Path(ckpt)]
    while todo:
        d = todo.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in sorted(entries, key=lambda e: e.name):
            if e.is_symlink():
                out.append(d / e.name)
            elif e.is_dir(follow_symlinks=False):
                todo.append(d / e.name)
    return sorted(out)


StoragePath = Union[Path, Any]  # a Path, or a UPath (object storage) with the same interface


def storage_path(location: str | os.PathLike) -> StoragePath:
    """A local Path, or for a URL a UPath whose credentials and endpoint come from the environment, as every AWS
    tool reads them (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION)."""
    if is_url(str(location)):
        from upath import UPath

        # no listings cache: other processes (every rank) write into the same prefixes
        return UPath(str(location), use_listings_cache=False)
    return Path(location)


def open_root(location: str) -> StoragePath:
    """The job's checkpoint directory, created if missing. On object storage this is the first request: a missing
    bucket, refused or absent credentials or an unreachable endpoint become a CheckpointError that names the
    field and what to check, not a botocore traceback."""
    root = storage_path(location)
    try:
        root.mkdir(parents=True, exist_ok=True)
        list_checkpoints(root)
    except Exception as err:
        if not is_remote(root):
            raise
        raise CheckpointError(
            f"spec.trainer.checkpointDir: cannot use {location} ({type(err).__name__}: {str(err)[:300]}). Check that "
            f"the bucket exists and that AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL (on "
            f"Kubernetes: the keys of the Secret that kubernetes.checkpointSecret names) give access to it") from err
    return root


def is_remote(p: StoragePath) -> bool:
    """Whether `p` is on object storage (no rename, no append, no fsync), which several operations do otherwise."""
    return getattr(p, "protocol", "") not in ("", "file", "local")


def rmtree(p: StoragePath) -> None:
    """Remove a directory and everything in it, locally or on object storage (where a directory is a prefix). A
    symbolic link is removed itself, never what it points to."""
    if is_remote(p):
        if p.exists():
            p.fs.rm(p.path, recursive=True)
    elif os.path.islink(p):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    else:
        shutil.rmtree(p, ignore_errors=True)


def is_step_dir_name(name: str) -> bool:
    """Whether `name` is a checkpoint's directory name, `step_N` with 8 digits."""
    return bool(_STEP_DIR.match(name))


def step_dir(root: Path, step: int) -> Path:
    """Checkpoint `step`'s directory, `step_N` with 8 digits, so that names sort as steps do."""
    return root / f"step_{step:08d}"


def sha256(path: StoragePath) -> str:
    """A file's SHA-256, read in 1 MiB chunks (shards are gigabytes)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: StoragePath) -> None:
    """Make a directory's entries durable (names of files written into it), before a rename relies on them."""
    if is_remote(path):
        return  # an object is durable once its PUT returns
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """Write and fsync, so that a sealed checkpoint's small files are on disk before its rename is."""
    if is_remote(path):
        path.write_text(json.dumps(obj, indent=1))
        return
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=1))
        f.flush()
        os.fsync(f.fileno())


def files(directory: StoragePath) -> list[StoragePath]:
    """Every file below `directory`, subdirectories included, sorted (the order a manifest lists them in)."""
    if is_remote(directory):
        keys = directory.fs.find(directory.path)
        return sorted(directory / k[len(directory.path.rstrip("/")) + 1:] for k in keys)
    return sorted(p for p in directory.rglob("*") if p.is_file())


def relative(p: StoragePath, directory: StoragePath) -> str:
    """`p`'s path inside `directory`, '/'-separated (the name a manifest lists it under)."""
    return str(p)[len(str(directory).rstrip("/")) + 1:]


def size_bytes(ckpt: Path) -> int:
    """Bytes of the files in a checkpoint directory, its roles' shard directories included."""
    if is_remote(ckpt):
        return int(ckpt.fs.du(ckpt.path, total=True))
    return sum(p.stat().st_size for p in files(ckpt))


def list_checkpoints(root: StoragePath) -> list[StoragePath]:
    """The `step_N` directories of a checkpointDir, oldest first, intact or not (`sealing.verify` tells; a `step_N`
    that is a symbolic link to a directory is listed, and refused there, naming it)."""
    if is_remote(root):  # step directories that hold objects (some stores list emptied prefixes as directories)
        prefix = root.path.rstrip("/") + "/"
        names = {k[len(prefix):].split("/", 1)[0] for k in root.fs.find(root.path) if k.startswith(prefix)}
        return [root / n for n in sorted(names) if _STEP_DIR.match(n)]
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=lambda p: p.name)


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's MANIFEST.json (files and digests, identity), never through a symbolic link; raises when it is
    missing or unreadable (LinkRefused, an OSError, for a link)."""
    return json.loads(read_text_in(ckpt, MANIFEST))


def load_tensors(path: Path) -> Any:
    """A role's weight file, with `torch.load(weights_only=True)`: checkpoints sit on storage that other jobs and
    people can write, and a full unpickle would run any code a file names. Tensors, dicts, lists, tuples, numbers
    and strings (model and optimizer state) load; any other object is refused."""
    import pickle

    import torch

    try:
        with open_tail(path, 2) as f:  # <step_N>/<role>.pt, neither through a symbolic link
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing to load {path}: it holds Python objects other than tensors and plain values, which could run "
            f"code when loaded. Checkpoints are only loaded as data; delete this file's checkpoint or point "
            f"spec.trainer.checkpointDir elsewhere ({str(err).splitlines()[0]})") from err
