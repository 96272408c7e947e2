"""The grammar of where checkpoints live: a local (or mounted) path, or an object-storage URL, and the per-job and
per-namespace directories under either. Pure string work, no I/O and no torch: the operator confines a job's
checkpointDir and resumeFrom with it before any pod exists, and the runtime opens the same locations
(`hybridflow.checkpoint.store`)."""
from __future__ import annotations

import re
from pathlib import PurePosixPath

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# The object stores a checkpointDir or resumeFrom may name. Not file:// or local:// (a path in URL clothes, which
# would escape the per-namespace confinement of paths on a shared claim) and not http(s) (requests to anywhere).
OBJECT_STORES = ("s3", "gs", "gcs", "az", "abfs", "abfss")
# The environment variables object-storage clients read credentials and endpoints from: on Kubernetes, the keys of
# kubernetes.checkpointSecret the pods get (only these: a Secret's other keys could set PYTHONPATH or LD_PRELOAD).
# Where a job's pods see its directory on kubernetes.checkpointPvc: <CHECKPOINT_MOUNT>/<namespace>/<job> (the claim's
# subPath <namespace>/<job>, mounted there by the operator); the spec the pods run names that path, and the progress
# they report (status.lastCheckpoint) too.
CHECKPOINT_MOUNT = "/var/lib/hybridflow/checkpoints"
# The keys of kubernetes.trackingSecret the head pod gets (the experiment trackers' credentials; only these).
TRACKING_CREDENTIAL_KEYS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                            "WANDB_API_KEY")
STORAGE_CREDENTIAL_KEYS = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
)


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
