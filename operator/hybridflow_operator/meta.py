"""The names, labels and owner of every object the operator makes for a job: what every manifest module builds on.

Pods carry the gang *generation* (the restart count) in their names and labels, so a restarted gang never
collides with the terminating pods of the previous one, and the operator only looks at the current generation.
"""
from __future__ import annotations

from typing import Any

from hybridflow.api import API_GROUP as GROUP
from hybridflow.api import RLHFJob
from hybridflow.api.names import LABEL_JOB, names
from hybridflow.api.sections import DEFAULT_METRICS_PORT

MANAGED_BY = {"app.kubernetes.io/managed-by": "hybridflow-operator", "app.kubernetes.io/name": "hybridflow"}

RAY_PORT = 6379
SPEC_MOUNT = "/etc/hybridflow"
SPEC_KEY = "job.json"  # JSON, not YAML: no aliases or tags in what the operator and the driver read back
# The checkpoint claim is never mounted whole: the job's own directory on it (subPath <namespace>/<job>) is mounted
# read-write at CHECKPOINT_MOUNT/<namespace>/<job>, and the job a trainer.resumeFrom on it names (<namespace>/<job>,
# also when it names one of its checkpoints, <job>/step_N) read-only at RESUME_MOUNT/<namespace>/<job>; the resolved
# spec names those paths (RESUME_MOUNT/<namespace>/<job>[/step_N]).
RESUME_MOUNT = "/var/lib/hybridflow/resume-from"
MODEL_CACHE = "/var/cache/hybridflow/models"
MODELS_MOUNT = "/models"
RAY_AGENT_PORT = 52365  # Ray's per-node dashboard agent (job submission); refused without the token
# The restricted Pod Security Standard: a read-only root filesystem, so everything Ray, vLLM and torch write goes
# to bounded emptyDirs (HOME points into /tmp for the caches that follow it).
SCRATCH_MOUNT = "/tmp"
SCRATCH_SIZE = "16Gi"
MODEL_CACHE_SIZE = "64Gi"
FS_GROUP = 1000  # group of what pods write to volumes (the images' users are 1000 and 1001: their own USER runs)
# spec.environments: the environment pool's pods (role ENVIRONMENT_ROLE, no gang generation: they outlive gang
# restarts), each reachable as env-<index>.<job>-env.<namespace>.svc (hostname + subdomain of a headless Service)
# on ENVIRONMENT_PORT; the head and pool pods get the replicas' URLs in ENVIRONMENT_URLS_ENV (and REWARD_URLS_ENV for
# replicas set apart for reward functions), the names hybridflow.sandbox_pool reads.
ENVIRONMENT_ROLE = "environment"
ENVIRONMENT_PORT = 8100
# A job's agent program (spec.rollout.agent.program) runs in the pool and calls the rollout's OpenAI-compatible
# endpoint back: each rollout's endpoint listens on the first free port of this range at its pod's address
# (hybridflow.sandbox_pool.ENDPOINT_PORTS_ENV), and the pool's pods may reach the gang's pods on these ports only.
AGENT_ENDPOINT_PORTS = (8400, 8463)
# hybridflow.sandbox's switch: "require" refuses to run user code without every layer of the sandbox. The
# sandbox pods exist to run untrusted code; a pod whose runtime refuses user namespaces fails, saying so, instead
# of running it with fewer layers, unless spec.sandbox.allowPartial says the pod's own containment is enough.
SANDBOX_ENV, SANDBOX_REQUIRED, SANDBOX_PARTIAL = "HYBRIDFLOW_SANDBOX", "require", "partial"
# The sandbox pool's bearer token (hybridflow.sandbox_pool.TOKEN_ENV; test_environment_manifests checks the
# two agree), from the job's own Secret (names()["sandbox_token"]): it opens the pool and nothing else, so a pod
# that spoofs the pool's labels to receive its requests learns no credential of the job's.
SANDBOX_TOKEN_ENV, SANDBOX_TOKEN_KEY = "HYBRIDFLOW_SANDBOX_TOKEN", "token"



def job_labels(name: str) -> dict[str, str]:
    return {**MANAGED_BY, LABEL_JOB: name}


def selector(name: str, **extra: str) -> str:
    """Label selector for the job's children, e.g. selector('j', role='head')."""
    parts = [f"{LABEL_JOB}={name}"] + [f"{GROUP}/{k}={v}" for k, v in extra.items()]
    return ",".join(parts)


def owner_reference(job: RLHFJob, uid: str) -> dict[str, Any]:
    """The job as its children's controller. `uid`, the job object's, is the one fact a child needs that the spec
    does not hold (neither the live spec nor the accepted one read back carries it)."""
    return {
        "apiVersion": job.api_version,
        "kind": job.kind,
        "name": job.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_namespace(job: RLHFJob) -> str:
    """Where the job and its children live (a manifest without one is the default namespace's, as kubectl's)."""
    return job.metadata.namespace or "default"


def metrics_port(job: RLHFJob) -> int:
    """The port a job's driver serves its metrics on in a pod: spec.metrics.port, and the default for 0. On
    Kubernetes the driver always serves: the operator follows the job's steps, ETA and deadlines there (and would
    find a job it cannot poll Stalled at every deadline). 0 turns metrics off for a local run, where the examples
    set it so that several jobs run side by side; the same YAML applied to a cluster runs there. The head pod's
    command line (--metrics-port) says it to the driver; the spec the pods read keeps the author's value, so the
    accepted spec's digest is the one an older operator recorded."""
    return job.spec.metrics.port or DEFAULT_METRICS_PORT


def object_meta(job: RLHFJob, uid: str, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job_namespace(job),
        "labels": {**job_labels(job.metadata.name), **(labels or {})},
        "ownerReferences": [owner_reference(job, uid)],
    }


def ray_token_secret_name(job: RLHFJob) -> str:
    """The user's Secret when the spec names one, else the one the operator creates for the job."""
    return job.spec.kubernetes.ray_auth_secret or names(job.metadata.name)["ray_token"]



# The Secrets the operator makes for a job (key in names) -> the status field holding the uid its create returned:
# the operator never reads a Secret, so that uid is how `cleanup` deletes the job's own and no other.
SECRET_UID_KEYS = {"ray_token": "rayTokenSecretUid", "sandbox_token": "sandboxTokenSecretUid"}
