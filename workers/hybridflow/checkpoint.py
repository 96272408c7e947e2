"""Checkpoints that survive `kill -9`, full disks, other jobs and hostile files.

Each checkpoint is built in a hidden temp directory, sealed with a manifest of SHA-256 digests, then renamed into
place; a save that fails (a full disk) removes its temp directory and leaves the previous checkpoints as they were.
A checkpoint whose manifest is missing or whose files do not match is skipped with a warning, and the previous one
is used; it never counts toward `keepCheckpoints`. The manifest also records whose checkpoint it is (job and model
architecture), so that a directory shared by mistake is refused on resume instead of loading another job's weights.
Weight files are read with `torch.load(weights_only=True)`: they live on shared storage, and unpickling runs code.
The step log is rewound to the checkpoint on resume, so the final log lists every step exactly once."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Union

log = logging.getLogger("hybridflow.checkpoint")

MANIFEST = "MANIFEST.json"
STEP_LOG = "steps.jsonl"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# HF config fields that fix every parameter's name and shape (what makes a checkpoint loadable into a model)
_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be used, or one that could not be written; the message says what to do."""


# --- where checkpoints live: a local (or mounted) directory, or object storage ---
# Object storage (s3://bucket/prefix, or any fsspec protocol) is reached through a UPath, which has Path's interface.
# It has no rename and no append, and a PUT replaces an object whole: a checkpoint there is written in place (its
# manifest, written last, is what seals it) and the step log is rewritten whole.
StoragePath = Union[Path, Any]


def storage_path(location: str | os.PathLike) -> StoragePath:
    """A local Path, or for a URL a UPath whose credentials and endpoint come from the environment, as every AWS
    tool reads them (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION)."""
    if is_url(str(location)):
        from upath import UPath

        # no listings cache: other processes (every rank) write into the same prefixes
        return UPath(str(location), use_listings_cache=False)
    return Path(location)


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# The object stores a checkpointDir or resumeFrom may name. Not file:// or local:// (a path in URL clothes, which
# would escape the per-namespace confinement of paths on a shared claim) and not http(s) (requests to anywhere).
OBJECT_STORES = ("s3", "gs", "gcs", "az", "abfs", "abfss")
# The environment variables object-storage clients read credentials and endpoints from: on Kubernetes, the keys of
# kubernetes.checkpointSecret the pods get (only these: a Secret's other keys could set PYTHONPATH or LD_PRELOAD).
STORAGE_CREDENTIAL_KEYS = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
)


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


def is_url(location: str) -> bool:
    """`<scheme>://...` (s3://bucket/prefix): object storage, no volume; anything else is a local path."""
    return bool(_URL.match(location))


def location_problem(location: str) -> str | None:
    """Why `location` cannot be a checkpointDir or resumeFrom, or None: a URL must name one of OBJECT_STORES."""
    m = _URL.match(location)
    if m and m.group(1).lower() not in OBJECT_STORES:
        return (f"'{location}': {m.group(1)}:// is not object storage; use a plain path, or one of "
                f"{', '.join(s + '://' for s in OBJECT_STORES)}")
    if not m and "://" in location:
        return f"'{location}' is neither a path nor a URL (scheme://...)"
    return None


def is_remote(p: StoragePath) -> bool:
    return getattr(p, "protocol", "") not in ("", "file", "local")


def _rmtree(p: StoragePath) -> None:
    if is_remote(p):
        if p.exists():
            p.fs.rm(p.path, recursive=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


def job_checkpoint_dir(root: str, namespace: str | None, job: str) -> str:
    """`<root>/<namespace>/<job>` (`<root>/<job>` without a namespace): the directory of one job's checkpoints and
    step log under a volume that many jobs may share. Pruning and resuming only ever look inside it, so jobs
    cannot delete or resume each other's checkpoints. Names are used as path components, so a name that could
    leave `root` ('', '.', '..', or one with '/') is refused."""
    parts = [p for p in (namespace, job) if p is not None]
    for p in parts:
        if p in ("", ".", "..") or "/" in p or "\0" in p:
            raise ValueError(f"{p!r} cannot name a checkpoint directory (job {namespace}/{job})")
    return str(PurePosixPath(root, *parts))


def job_checkpoint_url(url: str, namespace: str | None, job: str) -> str:
    """`<url>/<namespace>/<job>`: `job_checkpoint_dir` for object storage, whose `scheme://` a path join would
    collapse to `scheme:/`. The names are checked the same way; idempotent (a URL already ending in the job's own
    directory is kept), as the operator resolves the accepted spec again when it compares it with the live one."""
    scheme = _URL.match(url)
    if not scheme:
        raise ValueError(f"{url!r} is not a URL (scheme://...)")
    own = job_checkpoint_dir("/", namespace, job)  # "/<namespace>/<job>", the names checked
    base = url[scheme.end():].rstrip("/")
    return url[:scheme.end()] + (base if base.endswith(own) else base + own)


def namespace_url(url: str, namespace: str, job: str) -> str:
    """`<base>/<namespace>/`: where the checkpoints of every job of `namespace` live under the base prefix that a
    checkpointDir URL names (given as written, or already resolved to the job's own directory)."""
    return job_checkpoint_url(url, namespace, job)[:-len(job)]


# What trainer.resumeFrom names on Kubernetes, below its namespace's directory: another job of the namespace (its
# newest intact checkpoint) or one checkpoint of it. Job names are DNS-1035 labels; nothing here can climb ('..').
_RESUME_SOURCE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?(/step_\d{8})?")


def resume_source(location: str, prefixes: tuple[str, ...]) -> str | None:
    """The `<job>` or `<job>/step_<N>` that `location` names, as it is or below one of `prefixes` (each ending in
    '/': a namespace's directory); None when it names anything else (another namespace's, a path that climbs, a
    URL elsewhere)."""
    for prefix in prefixes:
        if location.startswith(prefix):
            location = location[len(prefix):]
            break
    rel = location.rstrip("/")
    return rel if _RESUME_SOURCE.fullmatch(rel) else None


def model_architecture(source: Any) -> dict[str, Any]:
    """What must match for a checkpoint to load into a model built from `source` (a spec ModelSource).

    Cheap and known before any worker starts: the tiny model's config (it fixes every shape), the shape fields of
    config.json for a model directory, the source's name for the built-in SmolLM2. Not the weights (training
    changes them) and not the dtype (`load_state_dict` casts, so a resume may switch between float32 and bfloat16).
    """
    if source.source == "tiny":
        return {"source": "tiny", **source.tiny.model_dump()}
    if source.source == "path":
        try:
            config = json.loads((Path(source.path) / "config.json").read_text())
        except (OSError, ValueError):
            return {"source": "path", "path": source.path}
        return {"source": "path", **{k: config[k] for k in _ARCH_KEYS if k in config}}
    return {"source": source.source}


def identity(job: str, namespace: str | None, models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Whose checkpoint this is: the job, and each saved role's `model_architecture`."""
    return {"job": job, "namespace": namespace, "models": models}


def _label(ident: dict[str, Any]) -> str:
    return f"{ident['namespace']}/{ident['job']}" if ident.get("namespace") else str(ident.get("job"))


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def staging_dir(root: StoragePath, step: int) -> StoragePath:
    """Where checkpoint `step` is written: a hidden directory renamed into place when sealed; on object storage
    (no rename) the checkpoint's own directory, which counts only once its manifest is written."""
    d = step_dir(root, step) if is_remote(root) else root / f".step_{step:08d}.tmp"
    _rmtree(d)
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
        _refuse_other_jobs(root, ident)
    try:
        staging = staging or staging_dir(root, step)
        yield staging
    except BaseException as err:
        cause = _os_error(err)
        if cause is None and _nearly_full(root):  # torch.save reports a full disk as "iostream error", not ENOSPC
            cause = OSError(errno.ENOSPC, f"No space left on device ({str(err).splitlines()[0][:200]})")
        if staging is not None:
            _rmtree(staging)
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
    Only explicit causes are followed: an error merely raised while handling an OSError is not a disk failure."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(cause, OSError):
            return cause
        if isinstance(e, OSError):
            return e
        e = cause if isinstance(cause, BaseException) else e.__cause__
    return None


def _save_failure(root: Path, step: int, err: OSError) -> str:
    reason = "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
    prev = _newest_intact(root)
    kept = f"the previous checkpoint {prev.name} is kept" if prev else "there is no earlier checkpoint"
    return (f"{reason} while saving checkpoint step {step} to {root} ({err}); {kept}. Free space on that volume (or "
            f"lower spec.trainer.keepCheckpoints) and resume")


def sha256(path: StoragePath) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: StoragePath) -> None:
    if is_remote(path):
        return  # an object is durable once its PUT returns
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    """Write and fsync, so that a sealed checkpoint's small files are on disk before its rename is."""
    if is_remote(path):
        path.write_text(json.dumps(obj, indent=1))
        return
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=1))
        f.flush()
        os.fsync(f.fileno())


def remove_unsealed(root: Path) -> int:
    """Delete the staging directories of saves that never sealed (the job was killed while writing); returns how
    many. Only at start-up: a directory is never shared by two running jobs."""
    if is_remote(root):  # written in place: an unsealed one has no manifest, is skipped and then pruned
        return 0
    stale = [p for p in root.glob(".step_*.tmp") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return len(stale)


def _files(directory: StoragePath) -> list[StoragePath]:
    if is_remote(directory):
        keys = directory.fs.find(directory.path)
        return sorted(directory / k[len(directory.path.rstrip("/")) + 1:] for k in keys)
    return sorted(p for p in directory.rglob("*") if p.is_file())


def relative(p: StoragePath, directory: StoragePath) -> str:
    """`p`'s path inside `directory`, '/'-separated (the name a manifest lists it under)."""
    return str(p)[len(str(directory).rstrip("/")) + 1:]


def seal(root: Path, staging: Path, step: int, trainer_state: dict[str, Any], keep: int,
         ident: dict[str, Any] | None = None, digests: dict[str, str] | None = None) -> Path:
    """Write trainer state and manifest (with `ident`) into `staging`, rename it to step_N, prune (`_prune`).

    `digests` are the SHA-256s the ranks computed of the shards they wrote (in parallel, as they wrote them); the
    rest (trainer state, model config files) is hashed here. The manifest lists every file, subdirectories
    included, by its path relative to the checkpoint."""
    _write_json(staging / TRAINER_STATE, {"step": step, **trainer_state})
    known = digests or {}
    files = {}
    for p in _files(staging):
        name = relative(p, staging)
        files[name] = known.get(name) or sha256(p)
    missing = sorted(set(known) - set(files))
    if missing:
        raise CheckpointError(f"checkpoint step {step} in {staging} lacks files its writers reported ({missing[:3]})")
    manifest: dict[str, Any] = {"step": step, "files": files}
    if ident is not None:
        manifest["identity"] = ident
    if is_remote(staging):  # written in place; the manifest, written last, seals it
        _write_json(staging / MANIFEST, manifest)
        _after_seal(root, staging, ident, keep)
        return staging
    _fsync_subdirectories(staging)
    tmp = staging / (MANIFEST + ".tmp")
    _write_json(tmp, manifest)
    os.replace(tmp, staging / MANIFEST)
    _fsync_dir(staging)
    final = step_dir(root, step)
    old = root / f".{final.name}.old"
    if final.exists():  # a step redone after a fallback: set the old one aside until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
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
            _fsync_dir(p)


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
    stats = [(relative(p, ckpt), p.stat()) for p in _files(ckpt)]
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
    for c in reversed(list_checkpoints(root)):
        if c == newest:
            continue
        found = read_identity(c)
        if ident is not None and _other_job(found, c, ident):
            continue
        if (kept < keep and c.name < newest.name and (ident is None or not _model_mismatch(found, ident))
                and verify_once(c) is None):
            kept += 1
        else:
            _rmtree(c)


def size_bytes(ckpt: Path) -> int:
    """Bytes of the files in a checkpoint directory, its roles' shard directories included."""
    if is_remote(ckpt):
        return int(ckpt.fs.du(ckpt.path, total=True))
    return sum(p.stat().st_size for p in _files(ckpt))


def list_checkpoints(root: StoragePath) -> list[StoragePath]:
    if is_remote(root):  # step directories that hold objects (some stores list emptied prefixes as directories)
        prefix = root.path.rstrip("/") + "/"
        names = {k[len(prefix):].split("/", 1)[0] for k in root.fs.find(root.path) if k.startswith(prefix)}
        return [root / n for n in sorted(names) if _STEP_DIR.match(n)]
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=lambda p: p.name)


def _read_manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MANIFEST).read_text())


def verify(ckpt: Path) -> str | None:
    """None when intact, else what is wrong."""
    if not (ckpt / MANIFEST).is_file():
        return "no manifest (interrupted while writing?)"
    try:
        manifest = _read_manifest(ckpt)
    except (ValueError, OSError) as err:
        return f"unreadable manifest: {err}"
    for name, digest in manifest.get("files", {}).items():
        if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
            return f"manifest names a file outside the checkpoint: {name!r}"
        p = ckpt / name
        if not p.is_file():
            return f"missing file {name}"
        try:
            if sha256(p) != digest:
                return f"file {name} does not match its checksum"
        except OSError as err:
            return f"unreadable file {name}: {err}"
    return None


def read_identity(ckpt: Path) -> dict[str, Any] | None:
    """The manifest's identity; None for a checkpoint written before checkpoints recorded one."""
    try:
        found = _read_manifest(ckpt).get("identity")
    except (ValueError, OSError):
        return None
    if found is None:  # older checkpoints named their job in the trainer state only
        try:
            job = json.loads((ckpt / TRAINER_STATE).read_text()).get("job")
        except (ValueError, OSError):
            job = None
        return {"job": job, "namespace": None, "models": None} if job else None
    return found


def _other_job(found: dict[str, Any] | None, ckpt: Path, ident: dict[str, Any]) -> str | None:
    """The other job's name when `ckpt` is not `ident`'s job's (a namespace counts only where both record one)."""
    if found is None or not found.get("job"):
        return None
    ns_differ = found.get("namespace") and ident.get("namespace") and found["namespace"] != ident["namespace"]
    return _label(found) if found["job"] != ident["job"] or ns_differ else None


def _other_namespace(found: dict[str, Any] | None, ident: dict[str, Any]) -> str | None:
    """The checkpoint's namespace when both it and `ident` record one and they differ."""
    theirs, ours = (found or {}).get("namespace"), ident.get("namespace")
    return theirs if theirs and ours and theirs != ours else None


def _model_mismatch(found: dict[str, Any] | None, ident: dict[str, Any]) -> str | None:
    """How the checkpoint's models differ from `ident`'s, or None (also when the checkpoint recorded none)."""
    if found is None or found.get("models") is None:
        return None
    problems = []
    for role, want in ident["models"].items():
        have = found["models"].get(role)
        if have is None:
            problems.append(f"it has no {role}")
        elif have != want:
            diff = ", ".join(f"{k} {have.get(k)!r} there, {want.get(k)!r} here"
                             for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k))
            problems.append(f"{role}: {diff}")
    return "; ".join(problems) or None


def _refuse_other_jobs(root: Path, ident: dict[str, Any]) -> None:
    for c in list_checkpoints(root):
        other = _other_job(read_identity(c), c, ident)
        if other:
            raise CheckpointError(
                f"{root} holds checkpoints of job '{other}' ({c.name}), not of '{_label(ident)}': jobs must not share "
                f"a checkpoint directory. Point spec.trainer.checkpointDir at a directory of this job's own")


def check_compatible(ckpt: Path, ident: dict[str, Any], other_job_ok: bool = False) -> None:
    """Refuse to resume `ident`'s job from `ckpt` when it belongs to another job (unless `other_job_ok`: the job
    named it as trainer.resumeFrom, and that job is of the same namespace: another namespace's checkpoint is
    refused always), or to an incompatible model; a checkpoint written before identities were recorded is accepted
    with a warning (its model is unknown). Called before any weights are read."""
    found = read_identity(ckpt)
    other = _other_job(found, ckpt, ident)
    foreign = _other_namespace(found, ident)
    if foreign and other_job_ok:  # another job's, yes; another namespace's, never: namespaces are the tenants
        raise CheckpointError(
            f"spec.trainer.resumeFrom: {ckpt} belongs to job '{other}' of namespace {foreign}, not to this job's "
            f"namespace {ident['namespace']}: a job resumes only from checkpoints of its own namespace. Name a job "
            f"of namespace {ident['namespace']} (or one of its step_* checkpoints)")
    if other and not other_job_ok:
        raise CheckpointError(
            f"{ckpt} belongs to job '{other}', not to '{_label(ident)}': will not resume another job's training. "
            f"Point spec.trainer.checkpointDir at a directory of this job's own (the other job's checkpoints stay)")
    problem = _model_mismatch(found, ident)
    if problem:
        raise CheckpointError(
            f"{ckpt} was saved for a different model than job '{_label(ident)}' has now ({problem}). Point "
            f"spec.trainer.checkpointDir elsewhere, or set spec.trainer.resume: never to start over (this job's "
            f"checkpoints of the old model are then replaced)")
    if found is None or found.get("models") is None:
        log.warning("%s records no model (written by an older version): assuming it fits job '%s'", ckpt,
                    _label(ident))


def load_tensors(path: Path) -> Any:
    """A role's weight file, with `torch.load(weights_only=True)`: checkpoints sit on storage that other jobs and
    people can write, and a full unpickle would run any code a file names. Tensors, dicts, lists, tuples, numbers
    and strings (model and optimizer state) load; any other object is refused."""
    import pickle

    import torch

    try:
        with path.open("rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing to load {path}: it holds Python objects other than tensors and plain values, which could run "
            f"code when loaded. Checkpoints are only loaded as data; delete this file's checkpoint or point "
            f"spec.trainer.checkpointDir elsewhere ({str(err).splitlines()[0]})") from err


def _newest_intact(root: Path, warn: bool = False) -> Path | None:
    for ckpt in reversed(list_checkpoints(root)):
        problem = verify_once(ckpt, trust_known=False)  # in full: what a job resumes from is read again
        if problem is None:
            return ckpt
        if warn:
            log.warning("skipping corrupt checkpoint %s: %s; falling back to the previous one", ckpt, problem)
    return None


def latest_good(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint and its trainer state; corrupt newer ones are reported and skipped."""
    ckpt = _newest_intact(root, warn=True)
    return None if ckpt is None else (ckpt, json.loads((ckpt / TRAINER_STATE).read_text()))


def checkpoint_at(source: Path) -> tuple[Path, dict[str, Any]] | None:
    """`source` itself when it is an intact checkpoint (a step_* directory), else the newest intact checkpoint of
    `source` as a checkpointDir; with its trainer state."""
    if (source / MANIFEST).is_file():
        problem = verify(source)
        if problem is not None:
            raise CheckpointError(f"{source} is not an intact checkpoint ({problem}); name an intact one, or its "
                                  f"checkpointDir to take the newest intact one")
        return source, json.loads((source / TRAINER_STATE).read_text())
    return latest_good(source)


# Object storage has no append: there the log is a series of parts of STEP_LOG_PART records, each put whole, so a
# step's write stays small however long the job runs (one object put whole would grow with every step).
STEP_LOG_PARTS = "steps"
STEP_LOG_PART_RECORDS = 100


def _log_parts(root: StoragePath) -> list[StoragePath]:
    parts = root / STEP_LOG_PARTS
    return sorted(parts.glob("part-*.jsonl"), key=lambda p: p.name) if parts.exists() else []


def _part(root: StoragePath, index: int) -> StoragePath:
    return root / STEP_LOG_PARTS / f"part-{index:05d}.jsonl"


def _lines(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _split_legacy_log(root: StoragePath) -> None:
    """A whole `steps.jsonl` on object storage (written by an earlier version) becomes parts before the log is
    written to again; its records are kept. Until it is deleted, last, it is what the log holds: an interrupted
    split is simply done again."""
    legacy = root / STEP_LOG
    if legacy.exists():
        _write_log_parts(root, _parse_log(legacy.read_text()), 0)
        legacy.unlink()


def _read_log_parts(root: StoragePath) -> list[list[dict[str, Any]]]:
    return [_parse_log(p.read_text()) for p in _log_parts(root)]


def _write_log_parts(root: StoragePath, records: list[dict[str, Any]], first_part: int) -> None:
    """Parts `first_part`.. hold `records` (the log's records from that part on); later parts are deleted."""
    n = STEP_LOG_PART_RECORDS
    chunks = [records[i:i + n] for i in range(0, len(records), n)]
    for i, chunk in enumerate(chunks):
        _part(root, first_part + i).write_text(_lines(chunk))
    for p in _log_parts(root)[first_part + len(chunks):]:
        p.unlink()


def append_step_log(root: StoragePath, record: dict[str, Any]) -> None:
    if is_remote(root):
        _split_legacy_log(root)
        parts = _log_parts(root)
        last = _parse_log(parts[-1].read_text()) if parts else []
        if parts and len(last) < STEP_LOG_PART_RECORDS:
            parts[-1].write_text(_lines(last + [record]))
        else:
            _part(root, len(parts)).write_text(_lines([record]))
        return
    with open(root / STEP_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _parse_log(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by a crash ends the log
    return out


def read_step_log(root: StoragePath) -> list[dict[str, Any]]:
    """The job's step records, oldest first (`steps.jsonl`; on object storage, its parts in order)."""
    p = root / STEP_LOG
    if is_remote(root):
        if p.exists():  # written whole by an earlier version, and not yet split into parts
            return _parse_log(p.read_text())
        return [r for part in _read_log_parts(root) for r in part]
    return _parse_log(p.read_text()) if p.is_file() else []


def rewind_step_log(root: StoragePath, step: int) -> int:
    """Keep log records up to `step` (the checkpoint resumed from); returns how many were dropped."""
    if is_remote(root):  # each part was put whole: nothing torn to clean up
        _split_legacy_log(root)
        parts = _read_log_parts(root)
        # rewritten from the part holding the first record dropped (not necessarily at the end: steps go backwards
        # in a log that a run with `resume: never` continued); the parts before it are kept as they are
        first = next((i for i, part in enumerate(parts) if any(r.get("step", 0) > step for r in part)), None)
        if first is None:
            return 0
        later = [r for part in parts[first:] for r in part]
        kept_later = [r for r in later if r.get("step", 0) <= step]
        _write_log_parts(root, kept_later, first)
        return len(later) - len(kept_later)
    records = read_step_log(root)
    kept = [r for r in records if r.get("step", 0) <= step]
    tmp = root / (STEP_LOG + ".tmp")
    tmp.write_text(_lines(kept))
    os.replace(tmp, root / STEP_LOG)
    return len(records) - len(kept)


# --- the rollout log (trainer.rolloutLog): each step's trained samples, one JSON line per sample ---
# One file per step, put whole: a step redone after a resume replaces its file, and object storage needs no append.
ROLLOUTS = "rollouts"
_ROLLOUT_FILE = re.compile(r"^step_(\d{8})\.jsonl$")


def rollout_path(root: StoragePath, step: int) -> StoragePath:
    return root / ROLLOUTS / f"step_{step:08d}.jsonl"


def write_rollouts(root: StoragePath, step: int, records: list[dict[str, Any]]) -> StoragePath:
    """`step`'s samples as `rollouts/step_<N>.jsonl` (N with 8 digits, as checkpoints' `step_N`); locally written
    to a temporary file and renamed, so a crash never leaves a torn one."""
    p = rollout_path(root, step)
    if is_remote(root):
        p.write_text(_lines(records))
        return p
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(_lines(records))
    os.replace(tmp, p)
    return p


def read_rollouts(root: StoragePath, step: int) -> list[dict[str, Any]]:
    """`step`'s samples, in the order the actor trained on them ([] when the step wrote none)."""
    p = rollout_path(root, step)
    return _parse_log(p.read_text()) if p.exists() else []


def rollout_steps(root: StoragePath) -> list[int]:
    """The steps that have a rollout file, in order."""
    d = root / ROLLOUTS
    if not d.exists():
        return []
    return sorted(int(m.group(1)) for p in d.glob("step_*.jsonl") if (m := _ROLLOUT_FILE.match(p.name)))


def rewind_rollouts(root: StoragePath, step: int) -> int:
    """Delete the rollout files of steps after `step` (the checkpoint resumed from), as the step log is rewound:
    those steps are redone and write theirs again. Returns how many were deleted."""
    dropped = [s for s in rollout_steps(root) if s > step]
    for s in dropped:
        rollout_path(root, s).unlink()
    return len(dropped)
