"""Checkpoints that survive `kill -9`, full disks, other jobs and hostile files: how one is written, sealed,
verified, pruned and chosen for a resume.

Each checkpoint is built in a hidden temp directory, sealed with a manifest of SHA-256 digests, then renamed into
place; a save that fails (a full disk) removes its temp directory and leaves the previous checkpoints as they were.
A checkpoint whose manifest is missing or whose files do not match is skipped with a warning, and the previous one
is used; it never counts toward `keepCheckpoints`. The manifest also records whose checkpoint it is
(`identity`), so that a directory shared by mistake is refused on resume instead of loading another job's weights.
Store functions are called through the module (`store.sha256`), so that a test can count or fail them."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from hybridflow.checkpoint import store
from hybridflow.checkpoint.identity import model_mismatch, other_job, read_identity, refuse_other_jobs
from hybridflow.checkpoint.store import MANIFEST, TRAINER_STATE, CheckpointError, StoragePath, is_remote, step_dir

log = logging.getLogger("hybridflow.checkpoint")


def staging_dir(root: StoragePath, step: int) -> StoragePath:
    """Where checkpoint `step` is written: a hidden directory renamed into place when sealed; on object storage
    (no rename) the checkpoint's own directory, which counts only once its manifest is written."""
    d = step_dir(root, step) if is_remote(root) else root / f".step_{step:08d}.tmp"
    store.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def writing(root: Path, step: int, ident: dict[str, Any] | None = None,
            staging: Path | None = None) -> Iterator[Path]:
    """The staging directory of checkpoint `step`, for the roles to write into and `seal` to finish (`staging`: go
    on with the one an asynchronous save started). Refuses up front (before hours of writes) a directory holding
    another job's checkpoints. On any failure the staging directory is removed, so a full disk keeps only complete
    checkpoints; an OSError becomes a CheckpointError that names the directory, the reason and the checkpoint
    kept."""
    if ident is not None and staging is None:
        refuse_other_jobs(root, ident)
    try:
        staging = staging or staging_dir(root, step)
        yield staging
    except BaseException as err:
        cause = _os_error(err)
        if cause is None and _nearly_full(root):  # torch.save reports a full disk as "iostream error", not ENOSPC
            cause = OSError(errno.ENOSPC, f"No space left on device ({str(err).splitlines()[0][:200]})")
        if staging is not None:
            store.rmtree(staging)
        if cause is None:
            raise
        raise CheckpointError(_save_failure(root, step, cause)) from err


LOW_SPACE_BYTES = 256 << 20


def _nearly_full(root: Path) -> bool:
    """Whether the volume had (almost) no space left when a save failed: measured before the partial checkpoint is
    removed, which frees it again."""
    if is_remote(root):
        return False
    try:
        return shutil.disk_usage(root).free < LOW_SPACE_BYTES
    except OSError:
        return False


def _os_error(err: BaseException) -> OSError | None:
    """The OSError behind `err`, also when a worker raised it (Ray re-raises it wrapped; `cause` is the original).
    Only explicit causes are followed: an error merely raised while handling an OSError is not a disk failure, nor
    is a wait that ran out (a TimeoutError is an OSError: Ray's GetTimeoutError for a rank that stopped answering
    mid-save was reported as the disk's, hiding the RankFailure that names the rank)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        for candidate in (cause, e):
            if isinstance(candidate, OSError) and not isinstance(candidate, TimeoutError):
                return candidate
        e = cause if isinstance(cause, BaseException) else e.__cause__
    return None


def _save_failure(root: Path, step: int, err: OSError) -> str:
    reason = "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
    prev = _newest_intact(root)
    kept = f"the previous checkpoint {prev.name} is kept" if prev else "there is no earlier checkpoint"
    return (f"{reason} while saving checkpoint step {step} to {root} ({err}); {kept}. Free space on that volume (or "
            f"lower spec.trainer.keepCheckpoints) and resume")


def remove_unsealed(root: Path) -> int:
    """Delete the staging directories of saves that never sealed (the job was killed while writing); returns how
    many. Only at start-up: a directory is never shared by two running jobs."""
    if is_remote(root):  # written in place: an unsealed one has no manifest, is skipped and then pruned
        return 0
    stale = [p for p in root.glob(".step_*.tmp") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        store.rmtree(p)  # (a link planted under that name: the link itself)
    return len(stale)


def seal(root: Path, staging: Path, step: int, trainer_state: dict[str, Any], keep: int,
         ident: dict[str, Any] | None = None, digests: dict[str, str] | None = None) -> Path:
    """Write trainer state and manifest (with `ident`) into `staging`, rename it to step_N, prune (`_prune`).

    `digests` are the SHA-256s the ranks computed of the shards they wrote (in parallel, as they wrote them); the
    rest (trainer state, model config files) is hashed here. The manifest lists every file, subdirectories
    included, by its path relative to the checkpoint."""
    store.write_json(staging / TRAINER_STATE, {"step": step, **trainer_state})
    known = digests or {}
    files = {}
    for p in store.files(staging):
        name = store.relative(p, staging)
        files[name] = known.get(name) or store.sha256(p)
    missing = sorted(set(known) - set(files))
    if missing:
        raise CheckpointError(f"checkpoint step {step} in {staging} lacks files its writers reported ({missing[:3]})")
    manifest: dict[str, Any] = {"step": step, "files": files}
    if ident is not None:
        manifest["identity"] = ident
    if is_remote(staging):  # written in place; the manifest, written last, seals it
        store.write_json(staging / MANIFEST, manifest)
        _after_seal(root, staging, ident, keep)
        return staging
    _fsync_subdirectories(staging)
    tmp = staging / (MANIFEST + ".tmp")
    store.write_json(tmp, manifest)
    os.replace(tmp, staging / MANIFEST)
    store.fsync_dir(staging)
    final = step_dir(root, step)
    old = root / f".{final.name}.old"
    if final.exists() or final.is_symlink():  # a step redone after a fallback: set the old one aside until the new
        store.rmtree(old)  # one is in place (a link under the name: the link itself)
        os.replace(final, old)
    os.replace(staging, final)
    store.fsync_dir(root)
    store.rmtree(old)
    _after_seal(root, final, ident, keep)
    return final


def _after_seal(root: StoragePath, sealed: StoragePath, ident: dict[str, Any] | None, keep: int) -> None:
    """Remember the sealed checkpoint as intact and prune older ones; best effort: the checkpoint is sealed, and a
    failure here must not fail the save (on object storage the caller would remove what it wrote, the sealed
    checkpoint itself)."""
    try:
        _remember_intact(sealed)
        _prune(root, sealed, ident, keep)
    except OSError as err:
        log.warning("checkpoint %s is sealed, but pruning older ones failed (%s); they are pruned at the next save",
                    sealed, err)


def _fsync_subdirectories(directory: Path) -> None:
    """fsync the entries of every subdirectory (`<role>/`): the files in them are fsync'd by their writers, but
    their names are only durable once their directory is, and the rename that seals the checkpoint must not come
    first (a crash could leave a sealed checkpoint with a shard missing)."""
    for p in sorted(directory.rglob("*")):
        if p.is_dir():
            store.fsync_dir(p)


# Checkpoints this process sealed or verified, with the size and change times (or ETag) of each of their files then.
# Pruning runs at every save and must count only intact checkpoints; re-hashing the kept ones each time would read
# every byte of them again (on object storage: download them). A file written since no longer matches, and is hashed.
_known_intact: dict[str, tuple[tuple[str, int, str], ...]] = {}
# what object stores report as a stored object's version (names differ: s3fs, gcsfs, adlfs)
_OBJECT_VERSION_KEYS = ("etag", "generation", "version_id", "last_modified", "lastmodified", "mtime")


def _object_version(info: dict[str, Any]) -> str | None:
    lowered = {k.lower(): v for k, v in info.items()}
    return next((str(lowered[k]) for k in _OBJECT_VERSION_KEYS if lowered.get(k) is not None), None)


def _fingerprint(ckpt: StoragePath) -> tuple[tuple[str, int, str], ...] | None:
    """The checkpoint's files with their sizes and versions; None when the store does not say which version of a
    file it holds (then nothing is trusted without hashing)."""
    if is_remote(ckpt):
        prefix = ckpt.path.rstrip("/") + "/"
        files = [(k[len(prefix):], int(i.get("size") or 0), _object_version(i))
                 for k, i in ckpt.fs.find(ckpt.path, detail=True).items() if k.startswith(prefix)]
        if any(version is None for *_, version in files):
            return None
        return tuple(sorted((name, size, str(version)) for name, size, version in files))
    if store.is_link(ckpt):
        return None  # never trusted: verify refuses it
    stats = [(store.relative(p, ckpt), p.lstat()) for p in store.files(ckpt)]  # a file made a link: another one
    # the inode change time too: a file rewritten in place and given back its old mtime still differs
    return tuple(sorted((name, st.st_size, f"{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}") for name, st in stats))


def _remember_intact(ckpt: StoragePath, fingerprint: tuple[tuple[str, int, str], ...] | None = None) -> None:
    fingerprint = fingerprint if fingerprint is not None else _fingerprint(ckpt)
    if fingerprint is not None:
        _known_intact[str(ckpt)] = fingerprint


def _fingerprint_or_none(ckpt: StoragePath) -> tuple[tuple[str, int, str], ...] | None:
    try:
        return _fingerprint(ckpt)
    except OSError:  # verify says what is wrong
        return None


def verify_once(ckpt: StoragePath, trust_known: bool = True) -> str | None:
    """`verify`, trusting this process's own earlier verification (or seal) while none of the files changed
    (`trust_known`; either way an intact checkpoint is remembered as such)."""
    before = _fingerprint_or_none(ckpt)
    if trust_known and before is not None and _known_intact.get(str(ckpt)) == before:
        return None
    problem = verify(ckpt)
    if problem is None and before is not None:
        _remember_intact(ckpt, before)  # taken before hashing: a file changed meanwhile is hashed again next time
    return problem


def _prune(root: Path, newest: Path, ident: dict[str, Any] | None, keep: int) -> None:
    """Keep `newest` and the keep-1 newest intact checkpoints of the same job and model before it. Delete the rest:
    corrupt or half-written ones (they never count, else a bad one could push out the last good one), this job's
    checkpoints of another model, and ones after `newest` (a run this one replaced: resume: never, or steps redone
    after a fallback). Another job's checkpoints are never touched."""
    kept = 1
    for c in reversed(store.list_checkpoints(root)):
        if c == newest:
            continue
        found = read_identity(c)
        if ident is not None and other_job(found, c, ident):
            continue
        if (kept < keep and c.name < newest.name and (ident is None or not model_mismatch(found, ident))
                and verify_once(c) is None):
            kept += 1
        else:
            store.rmtree(c)


def verify(ckpt: Path) -> str | None:
    """None when intact, else what is wrong. Locally a checkpoint is read without following a symbolic link at its
    step directory or below (store.open_below): one that is, or holds, a link is refused, naming it (a link planted
    on a shared claim could lead to another job's checkpoint or a path of the node)."""
    if links := store.links_in(ckpt):
        return str(store.link_refused(links[0]))
    if not (ckpt / MANIFEST).is_file():
        return "no manifest (interrupted while writing?)"
    try:
        manifest = store.read_manifest(ckpt)
    except (ValueError, OSError) as err:
        return f"unreadable manifest: {err}"
    for name, digest in manifest.get("files", {}).items():
        if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
            return f"manifest names a file outside the checkpoint: {name!r}"
        try:
            if _sha256_in(ckpt, name) != digest:
                return f"file {name} does not match its checksum"
        except FileNotFoundError:
            return f"missing file {name}"
        except store.LinkRefused as err:
            return str(err)
        except OSError as err:
            return f"unreadable file {name}: {err}"
    return None


def _sha256_in(ckpt: StoragePath, name: str) -> str:
    """The digest of file `name` of `ckpt`, read without following a link (on object storage: store.sha256, which
    tests count)."""
    if is_remote(ckpt):
        return store.sha256(ckpt / name)
    h = hashlib.sha256()
    with store.open_in(ckpt, name) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _newest_intact(root: Path, warn: bool = False) -> Path | None:
    for ckpt in reversed(store.list_checkpoints(root)):
        problem = verify_once(ckpt, trust_known=False)  # in full: what a job resumes from is read again
        if problem is None:
            return ckpt
        if warn:
            log.warning("skipping corrupt checkpoint %s: %s; falling back to the previous one", ckpt, problem)
    return None


def latest_good(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint and its trainer state; corrupt newer ones are reported and skipped."""
    ckpt = _newest_intact(root, warn=True)
    return None if ckpt is None else (ckpt, json.loads(store.read_text_in(ckpt, TRAINER_STATE)))


def checkpoint_at(source: Path) -> tuple[Path, dict[str, Any]] | None:
    """`source` itself when it is an intact checkpoint (a step_* directory), else the newest intact checkpoint of
    `source` as a checkpointDir; with its trainer state. A step directory that is a symbolic link is refused, naming
    it (a checkpointDir given as a link, on this machine, is the caller's own choice: its step directories are
    checked)."""
    if store.is_link(source) and (store.is_step_dir_name(source.name) or (source / MANIFEST).exists()):
        raise CheckpointError(str(store.link_refused(source)))
    if (source / MANIFEST).is_file():
        problem = verify(source)
        if problem is not None:
            raise CheckpointError(f"{source} is not an intact checkpoint ({problem}); name an intact one, or its "
                                  f"checkpointDir to take the newest intact one")
        return source, json.loads(store.read_text_in(source, TRAINER_STATE))
    return latest_good(source)
