"""Every object the operator creates, built by pure functions from the parsed job (and the job object's uid,
the one fact of its children the spec does not hold): the job in, dicts out, no I/O.

Pods carry the gang *generation* (the restart count) in their names and labels, so a restarted gang never
collides with the terminating pods of the previous one, and the operator only looks at the current generation.
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import shlex
from pathlib import PurePosixPath
from typing import Any

from hybridflow.api import API_GROUP as GROUP
from hybridflow.api import (
    DATA_MOUNT, REWARD_MOUNT, JobSpec, ModelSource, RLHFJob, ResourcePool, SpecError, dump_job, pool_resource,
    pool_slot_resource, reward_configmap_key,
)
from hybridflow.api.agents import (
    ENVIRONMENT_URLS_ENV, REWARD_URLS_ENV, SERVES_AGENTS, SERVES_ALL, SERVES_REWARDS, code_files, sandbox_pool,
    sandbox_replicas,
)
from hybridflow.api.rules import kubernetes_code_problems
from hybridflow.api.names import (
    LABEL_GENERATION, LABEL_INDEX, LABEL_JOB, LABEL_POOL, LABEL_ROLE, head_pod_name, names, worker_pod_name,
)
from hybridflow.api.scaling import sized
from hybridflow.api.storage import (
    CHECKPOINT_MOUNT, STORAGE_CREDENTIAL_KEYS, TRACKING_CREDENTIAL_KEYS, is_url, job_checkpoint_dir, job_checkpoint_url, namespace_url,
    resume_source,
)

from hybridflow_operator.policy import Egress

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


def _meta(job: RLHFJob, uid: str, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job_namespace(job),
        "labels": {**job_labels(job.metadata.name), **(labels or {})},
        "ownerReferences": [owner_reference(job, uid)],
    }


def ray_token_secret_name(job: RLHFJob) -> str:
    """The user's Secret when the spec names one, else the one the operator creates for the job."""
    return job.spec.kubernetes.ray_auth_secret or names(job.metadata.name)["ray_token"]


def resolved_job(job: RLHFJob) -> RLHFJob:
    """The spec as it runs in pods: metrics on all interfaces, checkpoints in the job's own directory (under the
    object-storage URL trainer.checkpointDir names, else on the PVC when one is given), trainer.resumeFrom, model
    paths and data.cacheDir confined to what this job may read or write, prompt files inside the data volume and
    the code files (reward function, tools, environment) inside the mount of the job's copy of its code ConfigMap.
    Idempotent (the accepted spec is resolved again when compared with the live one). A spec that names what its
    pods may not have (another namespace's checkpoint, a path outside its claims, object storage without
    kubernetes.checkpointSecret, a code file on the data claim) raises SpecError, naming the fields."""
    run = job.model_copy(deep=True)
    s, k8s = run.spec, run.spec.kubernetes
    s.metrics.address = "0.0.0.0"
    ns, name = run.metadata.namespace or "default", run.metadata.name
    # (parse_job refuses code on the data claim already: here too, for a spec changed since it was parsed)
    problems = _credential_problems(s) + kubernetes_code_problems(s)
    problems += _resolve_checkpoints(s, ns, name) + _resolve_models(s) + _resolve_cache_dir(s)
    if problems:
        raise SpecError("; ".join(problems))
    if k8s.data_pvc:
        s.data.train = [_inside(DATA_MOUNT, p) for p in s.data.train]
        s.data.eval = [_inside(DATA_MOUNT, p) for p in s.data.eval]
    if k8s.reward_config_map:  # every code file: inside the mount of the job's copy of its code ConfigMap
        if s.models.reward.function is not None:
            s.models.reward.function.path = _inside(REWARD_MOUNT, s.models.reward.function.path)
        if (agent := s.rollout.agent) is not None:
            if agent.environment_file:
                agent.environment_file = _inside(REWARD_MOUNT, agent.environment_file)
            if agent.tools_file:
                agent.tools_file = _inside(REWARD_MOUNT, agent.tools_file)
    return run


def _credential_problems(s: JobSpec) -> list[str]:
    """Object storage only with the job's own credentials: without a Secret the cloud SDKs in the pods would fall
    back to the node's identity (its instance role), which is the cluster's, not the job author's."""
    if s.kubernetes.checkpoint_secret:
        return []
    return [f"spec.kubernetes.checkpointSecret: spec.trainer.{field} '{where}' is on object storage, and no Secret "
            f"gives the pods its credentials; name one holding AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
            f"AWS_ENDPOINT_URL, AWS_REGION) or the AZURE_STORAGE_* keys (job pods never use the node's cloud identity)"
            for field, where in (("checkpointDir", s.trainer.checkpoint_dir), ("resumeFrom", s.trainer.resume_from))
            if where and is_url(where)]


def _resolve_checkpoints(s: JobSpec, ns: str, name: str) -> list[str]:
    """trainer.checkpointDir becomes the job's own directory, `<base>/<namespace>/<job>`; trainer.resumeFrom, another
    job of the namespace or one of its checkpoints, `<base>/<namespace>/<job>[/step_N]` (on the claim: below
    RESUME_MOUNT, where that job's directory, subPath `<namespace>/<job>`, is mounted read-only). Returns what
    cannot be resolved."""
    t, claim = s.trainer, s.kubernetes.checkpoint_pvc
    if is_url(t.checkpoint_dir):
        t.checkpoint_dir = job_checkpoint_url(t.checkpoint_dir, ns, name)
    elif claim:
        t.checkpoint_dir = job_checkpoint_dir(CHECKPOINT_MOUNT, ns, name)
    if not t.resume_from:
        return []
    if is_url(t.checkpoint_dir):
        base = namespace_url(t.checkpoint_dir, ns, name)
        where, rel = f"under {base}", resume_source(t.resume_from, (base,))
    elif is_url(t.resume_from):
        return [f"spec.trainer.resumeFrom: '{t.resume_from}' is on object storage, but spec.trainer.checkpointDir is "
                f"not: a job resumes only from checkpoints below its own checkpointDir's prefix and namespace; set "
                f"checkpointDir to that prefix (s3://bucket/prefix, whose jobs are s3://bucket/prefix/{ns}/<job>) "
                f"and name the old job"]
    elif claim:
        base = f"{RESUME_MOUNT}/{ns}/"
        # a path into the namespace's directory as the whole claim was once mounted: the same checkpoint
        where, rel = f"on kubernetes.checkpointPvc '{claim}'", resume_source(
            t.resume_from, (base, f"{CHECKPOINT_MOUNT}/{ns}/"))
    else:
        return []  # a path in the pod's own filesystem: nothing shared to confine
    if rel is None:
        return [f"spec.trainer.resumeFrom: '{t.resume_from}' is not a checkpoint of namespace {ns} {where}; name a "
                f"job of this namespace ('<job>': its newest intact checkpoint) or one of its checkpoints "
                f"('<job>/step_00000006'){f', or a URL under {base}' if is_url(base) else ''}"]
    t.resume_from = base + rel
    return []


def _model_sources(s: JobSpec) -> dict[str, ModelSource]:
    """The spec's models that may come from a directory, by field."""
    m = s.models
    found = {"spec.models.actor": m.actor, "spec.models.critic": m.critic, "spec.models.reward.model":
             m.reward.model, "spec.models.cost.model": m.cost.model if m.cost is not None else None}
    return {field: src for field, src in found.items() if src is not None}


def _resolve_models(s: JobSpec) -> list[str]:
    """With kubernetes.modelPvc, a model's path lies on that claim (relative to it, or below MODELS_MOUNT), where
    each model directory is mounted read-only by its own subPath."""
    if not s.kubernetes.model_pvc:
        return []
    out = []
    for field, src in _model_sources(s).items():
        if src.source != "path" or not src.path:
            continue
        rel = _below(MODELS_MOUNT, src.path)
        if rel is None:
            out.append(f"{field}.path: with kubernetes.modelPvc, give the model's directory on that claim (relative, "
                       f"or below {MODELS_MOUNT}/; no '..'), got '{src.path}'")
        else:
            src.path = f"{MODELS_MOUNT}/{rel}" if rel else MODELS_MOUNT
    return out


def _resolve_cache_dir(s: JobSpec) -> list[str]:
    """data.cacheDir is written by the job: inside its own checkpoint directory or the pod's scratch (a relative
    path is below the scratch, the containers' working directory), never a directory of the claim it shares."""
    d, own = s.data, s.trainer.checkpoint_dir
    if not d.cache_dir:
        return []
    path = str(PurePosixPath(SCRATCH_MOUNT, d.cache_dir))  # an absolute cacheDir stays as it is
    roots = [SCRATCH_MOUNT] + ([own] if own.startswith("/") else [])
    if ".." not in PurePosixPath(path).parts and any(_below(root, path) is not None for root in roots):
        d.cache_dir = path
        return []
    return [f"spec.data.cacheDir: '{d.cache_dir}' is outside this job's own directories; give a path inside "
            f"trainer.checkpointDir ({own}) or below {SCRATCH_MOUNT} (the pod's scratch), or leave it unset "
            f"(<checkpointDir>/data-cache)"]


def _below(mount: str, path: str) -> str | None:
    """`path` relative to `mount` ("" for the mount itself), given relative to it or as an absolute path below it;
    None when it is elsewhere or climbs ('..')."""
    p = PurePosixPath(path)
    if p.is_absolute():
        if p != PurePosixPath(mount) and PurePosixPath(mount) not in p.parents:
            return None
        p = p.relative_to(mount)
    if ".." in p.parts:
        return None
    return "" if str(p) == "." else str(p)


def _inside(mount: str, path: str) -> str:
    """A path the spec gives relative to a volume, as the pod sees it (idempotent: the accepted spec is resolved
    again when compared with the live one)."""
    return path if path.startswith(mount + "/") else f"{mount}/{path}"


def content_digest(text: str) -> str:
    """What status.acceptedSpecDigest, status.rewardDigest and status.codeDigests record: the spec ConfigMap's
    content, the reward file's, each code file's, as the pods read them."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def spec_text(job: RLHFJob) -> str:
    """What the spec ConfigMap holds under SPEC_KEY: the spec as it runs in pods, as JSON; status.acceptedSpecDigest
    is its digest."""
    doc = dump_job(resolved_job(job))
    doc["metadata"] = {"name": job.metadata.name, "namespace": job_namespace(job)}
    return json.dumps(doc, indent=1)


def configmap(job: RLHFJob, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, uid, names(job.metadata.name)["configmap"]),
        "data": {SPEC_KEY: spec_text(job)},
        "immutable": True,  # what the pods run cannot be edited under a live job
    }


# What a ConfigMap may hold (data and binaryData together), as the API server counts it.
MAX_CONFIGMAP_BYTES = 1 << 20


def reward_key(job: RLHFJob) -> str:
    """The reward file's key in kubernetes.rewardConfigMap and in the job's copy ("" without a reward function)."""
    fn = job.spec.models.reward.function
    return reward_configmap_key(fn.path) if fn is not None else ""


def code_keys(job: RLHFJob) -> dict[str, str]:
    """The job's code files in kubernetes.rewardConfigMap (the job's code ConfigMap), key -> the field naming it:
    the reward function's, the agent's tools file and environment file ({} without that ConfigMap). Each is copied
    into the job's own ConfigMap at acceptance, its digest recorded in status.codeDigests."""
    if not job.spec.kubernetes.reward_config_map:
        return {}
    out: dict[str, str] = {}
    for field, path in code_files(job.spec).items():
        out.setdefault(reward_configmap_key(path), field)
    return out


def reward_configmap(job: RLHFJob, uid: str, files: dict[str, str] | str) -> dict[str, Any]:
    """The job's own copy of its code files (`files`: key -> text; a str: the reward file alone), made when the
    operator first finds them in kubernetes.rewardConfigMap: immutable and owned by the job, and what the head and
    sandbox pods mount. The user's ConfigMap stays theirs to edit; an edit (anyone's who may update it) must not
    become code that the running job, or its next gang, executes."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, uid, names(job.metadata.name)["reward"]),
        "data": {reward_key(job): files} if isinstance(files, str) else dict(files),
        "immutable": True,
    }


def code_digests(files: dict[str, str]) -> dict[str, str]:
    """What status.codeDigests records: each code file's digest, by key."""
    return {key: content_digest(text) for key, text in sorted(files.items())}


def code_copy_problem(files: dict[str, str]) -> str:
    """Why the job's code files cannot be copied into one ConfigMap ("" if they can)."""
    size = sum(len(key.encode()) + len(text.encode()) for key, text in files.items())
    if size <= MAX_CONFIGMAP_BYTES:
        return ""
    what = (f"the file '{next(iter(files))}' is" if len(files) == 1
            else f"the job's code files ({', '.join(sorted(files))}) are")
    return (f"spec.kubernetes.rewardConfigMap: {what} {size} bytes with their keys; a ConfigMap holds at most "
            f"{MAX_CONFIGMAP_BYTES} (1 MiB); make {'it' if len(files) == 1 else 'them'} smaller")


def reward_copy_problem(key: str, text: str) -> str:
    """Why the reward file cannot be copied into a ConfigMap ("" if it can)."""
    return code_copy_problem({key: text})


def environment_service_name(job_name: str) -> str:
    """The environment pool's headless Service, the subdomain of its pods (<= 63 characters: job names are <= 58)."""
    return f"{job_name}-env"


def environment_pod_name(job_name: str, index: int) -> str:
    return f"{job_name}-env-{index}"


def environment_urls(job: RLHFJob, serving: str = SERVES_AGENTS) -> list[str]:
    """Where the job reaches each replica of its sandbox pool serving `serving` (SERVES_AGENTS: tools and
    environments; SERVES_REWARDS: reward functions): its pod's stable DNS name (hostname env-<i> in the pool's
    Service), the same across the pod's replacements; [] without a pool."""
    svc, ns = environment_service_name(job.metadata.name), job_namespace(job)
    return [f"http://env-{i}.{svc}.{ns}.svc:{ENVIRONMENT_PORT}"
            for i, serves in enumerate(sandbox_replicas(job.spec)) if serves in (serving, SERVES_ALL)]


def sandbox_urls_env(job: RLHFJob) -> list[dict[str, Any]]:
    """The gang's env for the sandbox pool: its replicas (those set apart for reward functions on their own
    variable) and the sandbox token; [] without a pool."""
    if not (agents := environment_urls(job)):
        return []
    out = [{"name": ENVIRONMENT_URLS_ENV, "value": ",".join(agents)}]
    if (rewards := environment_urls(job, SERVES_REWARDS)) != agents:
        out.append({"name": REWARD_URLS_ENV, "value": ",".join(rewards)})
    return [*out, sandbox_token_env(job)]


def head_service(job: RLHFJob, uid: str) -> dict[str, Any]:
    name = job.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, uid, names(name)["service"]),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # workers must resolve the head before it is Ready
            "selector": {LABEL_JOB: name, LABEL_ROLE: "head"},
            "ports": [
                {"name": "gcs", "port": RAY_PORT, "targetPort": RAY_PORT, "protocol": "TCP"},
                {"name": "metrics", "port": job.spec.metrics.port or 8000, "protocol": "TCP"},
            ],
        },
    }


def podgroup(job: RLHFJob, uid: str) -> dict[str, Any]:
    """Volcano gang: nothing starts until the head and every pool pod can be placed (an elastic rollout pool's
    minReplicas of them: pods past it join when they can)."""
    rp = job.spec.rollout_pool
    least = sized(job, rp.min_replicas if rp else None)
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": _meta(job, uid, names(job.metadata.name)["podgroup"]),
        "spec": {"minMember": 1 + sum(p.nodes for p in least.spec.resource_pools)},
    }


def sandbox_token_env(job: RLHFJob) -> dict[str, Any]:
    return {"name": SANDBOX_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": names(job.metadata.name)["sandbox_token"],
                                                                      "key": SANDBOX_TOKEN_KEY}}}


def _ray_env(job: RLHFJob) -> list[dict[str, Any]]:
    """Ray's token authentication is always on: GCS, the Ray client and every node's job agent refuse a caller
    without the job's token (the user's Secret, or the one the operator made for this job). The AWS SDKs never ask
    the instance metadata service for the node's credentials (only kubernetes.checkpointSecret's reach a job; the
    job's NetworkPolicy also denies egress to 169.254.0.0/16)."""
    return [
        {"name": "RAY_DEDUP_LOGS", "value": "1"},
        {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"},
        {"name": "HYBRIDFLOW_MODEL_CACHE", "value": MODEL_CACHE},
        {"name": "HOME", "value": SCRATCH_MOUNT},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": ray_token_secret_name(job),
                                                                   "key": "token"}}},
    ]


def _volumes(job: RLHFJob, shm: str, head: bool) -> tuple[list[dict], list[dict]]:
    vols = [
        {"name": "spec", "configMap": {"name": names(job.metadata.name)["configmap"]}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        {"name": "scratch", "emptyDir": {"sizeLimit": SCRATCH_SIZE}},
        {"name": "model-cache", "emptyDir": {"sizeLimit": MODEL_CACHE_SIZE}},
    ]
    mounts = [
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": SCRATCH_MOUNT},
        {"name": "model-cache", "mountPath": MODEL_CACHE},
    ]
    run = resolved_job(job)  # the paths the driver reads (also when `job` is the live spec, not yet accepted)
    k8s = run.spec.kubernetes
    if model_mounts := _model_mounts(run.spec):
        vols.append({"name": "models", "persistentVolumeClaim": {"claimName": k8s.model_pvc, "readOnly": True}})
        mounts += model_mounts
    if claim_mounts := _checkpoint_mounts(run.spec):
        vols.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": k8s.checkpoint_pvc}})
        mounts += claim_mounts
    if head and k8s.data_pvc:
        vols.append({"name": "data", "persistentVolumeClaim": {"claimName": k8s.data_pvc, "readOnly": True}})
        mounts.append({"name": "data", "mountPath": DATA_MOUNT, "readOnly": True})
    if head and k8s.reward_config_map:  # the job's own copy of the file, never the user's ConfigMap itself
        vols.append({"name": "reward", "configMap": {"name": names(job.metadata.name)["reward"]}})
        mounts.append({"name": "reward", "mountPath": REWARD_MOUNT, "readOnly": True})
    return vols, mounts


def _model_mounts(s: JobSpec) -> list[dict[str, Any]]:
    """kubernetes.modelPvc: each model directory the (resolved) spec names, read-only by its own subPath (a
    directory inside another one is seen through it); nothing of the claim's other models."""
    if not s.kubernetes.model_pvc:
        return []
    rels = {_below(MODELS_MOUNT, src.path) for src in _model_sources(s).values() if src.source == "path" and src.path}
    rels.discard(None)
    outer = sorted(r for r in rels if not any(o == "" or r.startswith(o + "/") for o in rels - {r}))
    return [{"name": "models", "mountPath": f"{MODELS_MOUNT}/{r}" if r else MODELS_MOUNT, "readOnly": True,
             **({"subPath": r} if r else {})} for r in outer]


def _checkpoint_mounts(s: JobSpec) -> list[dict[str, Any]]:
    """kubernetes.checkpointPvc, by subPath only, never whole: the job's own directory read-write, and the directory
    of the job a trainer.resumeFrom on the claim names (in the job's namespace) read-only, each at the path of the
    (resolved) spec. A resumeFrom naming one checkpoint of that job (`<job>/step_N`) still mounts `<namespace>/<job>`
    only, never a deeper subPath: the kubelet follows a symbolic link in a subPath within the volume, so a step_N
    planted as a link (by whoever may write the old job's directory) would bind another job's checkpoint, or another
    namespace's. Inside the mounted directory the runtime opens step_N itself, refusing a link there
    (hybridflow.checkpoint.store). A missing directory is created by the kubelet."""
    t, out = s.trainer, []
    if not s.kubernetes.checkpoint_pvc:
        return out
    if t.checkpoint_dir.startswith(CHECKPOINT_MOUNT + "/"):  # not when checkpoints go to object storage
        own = _below(CHECKPOINT_MOUNT, t.checkpoint_dir)
        out.append({"name": "checkpoints", "mountPath": t.checkpoint_dir, "subPath": own})
    if t.resume_from and t.resume_from.startswith(RESUME_MOUNT + "/"):
        source = PurePosixPath(_below(RESUME_MOUNT, t.resume_from) or "")
        if len(source.parts) >= 2:  # <namespace>/<job>[/step_N] (resolved_job refused anything else)
            job_dir = PurePosixPath(*source.parts[:2])
            out.append({"name": "checkpoints", "mountPath": f"{RESUME_MOUNT}/{job_dir}", "subPath": str(job_dir),
                        "readOnly": True})
    return out


# Pod Security Standard `restricted` (https://kubernetes.io/docs/concepts/security/pod-security-standards/).
# No runAsUser: each image runs as its own numeric USER (worker-cpu 1000, worker-gpu 1001), which runAsNonRoot
# makes the kubelet verify. OnRootMismatch: a checkpoint claim full of files is not re-chowned at every pod start.
# The claim's directories are mounted by subPath, which the kubelet creates when missing (a job's first start:
# <namespace>/<job>) as root, with the mode of the claim's root directory. What lets the job's user write there is
# that root: group-writable by FS_GROUP with the setgid bit, as the kubelet leaves it after applying fsGroup (volume
# types with ownership management; other claims, NFS say, must be provisioned that way), so the new directories
# inherit group FS_GROUP and group write. A directory the job cannot write fails it at start, naming
# trainer.checkpointDir.
POD_SECURITY: dict[str, Any] = {"runAsNonRoot": True, "fsGroup": FS_GROUP, "fsGroupChangePolicy": "OnRootMismatch",
                                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY: dict[str, Any] = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                      "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
                                      "seccompProfile": {"type": "RuntimeDefault"}}
EPHEMERAL_LIMIT = "96Gi"  # the scratch and model-cache emptyDirs, plus logs
EPHEMERAL_REQUEST = "1Gi"  # what scheduling reserves: a limit alone would become a 96Gi request


def _pod(
    job: RLHFJob,
    uid: str,
    name: str,
    labels: dict[str, str],
    containers: list[dict[str, Any]],
    init_containers: list[dict[str, Any]],
    pool: ResourcePool | None,
    shm: str,
    volumes_and_mounts: tuple[list[dict], list[dict]] | None = None,
    gang: bool = True,
) -> dict[str, Any]:
    """A pod of the job. `gang`: one of the gang (head and pool pods: object-storage credentials, the Volcano gang,
    the environment pool's URLs); an environment pod is not (it runs user code, and outlives gang restarts)."""
    k8s, policy = job.spec.kubernetes, job.spec.run_policy
    volumes, mounts = volumes_and_mounts or _volumes(job, shm, head=pool is None)
    sandbox_env = sandbox_urls_env(job) if gang else []
    for c in [*containers, *init_containers]:
        c.setdefault("image", k8s.image)
        c.setdefault("imagePullPolicy", k8s.image_pull_policy)
        c["volumeMounts"] = mounts
        # a sandbox pod gets none of the job's credentials: only its own env (the sandbox token among it). The
        # gang's pods run no user code (the sandbox pool does); were some path to try, it would be refused there.
        gang_env = [*_ray_env(job), {"name": SANDBOX_ENV, "value": SANDBOX_REQUIRED}] if gang else []
        c["env"] = gang_env + c.get("env", [])
        c["env"] += sandbox_env
        c["securityContext"] = copy.deepcopy(CONTAINER_SECURITY)
        c["workingDir"] = SCRATCH_MOUNT  # the root filesystem is read-only: relative paths (./checkpoints) land here
        resources = c.setdefault("resources", {})
        resources.setdefault("limits", {}).setdefault("ephemeral-storage", EPHEMERAL_LIMIT)
        resources.setdefault("requests", {}).setdefault("ephemeral-storage", EPHEMERAL_REQUEST)
    if k8s.checkpoint_secret and gang:  # object-storage credentials for the head's and the pools' main containers
        for c in containers:
            # by reference (the kubelet reads the Secret, never the operator), and only the credential variables:
            # a whole-Secret envFrom would let its author set anything (PYTHONPATH, LD_PRELOAD) in the job's pods
            c["env"] += [{"name": key, "valueFrom": {"secretKeyRef": {"name": k8s.checkpoint_secret, "key": key,
                                                                      "optional": True}}}
                         for key in STORAGE_CREDENTIAL_KEYS]
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a failed container fails the gang; the operator restarts it whole
        "containers": containers,
        "volumes": volumes,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # job code gets no Kubernetes credentials
        "securityContext": copy.deepcopy(POD_SECURITY),
        "terminationGracePeriodSeconds": 30,
    }
    if init_containers:
        spec["initContainers"] = init_containers
    if k8s.service_account_name and gang:  # a sandbox pod runs as the namespace's default one, without its token
        spec["serviceAccountName"] = k8s.service_account_name
    if policy.priority_class_name:
        spec["priorityClassName"] = policy.priority_class_name
    annotations: dict[str, str] = {}
    if policy.gang_scheduling and gang:
        spec["schedulerName"] = policy.scheduler_name or "volcano"
        annotations["scheduling.k8s.io/group-name"] = names(job.metadata.name)["podgroup"]
    elif policy.scheduler_name:
        spec["schedulerName"] = policy.scheduler_name
    if pool is not None:
        if pool.node_selector:
            spec["nodeSelector"] = dict(pool.node_selector)
        if pool.tolerations:
            spec["tolerations"] = [dict(t) for t in pool.tolerations]
        if pool.affinity:
            spec["affinity"] = dict(pool.affinity)
    meta = _meta(job, uid, name, labels)
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def head_pod(job: RLHFJob, uid: str, generation: int) -> dict[str, Any]:
    """Ray head (no devices of its own) plus the single controller; the pod's exit code is the job's."""
    name = job.metadata.name
    port = job.spec.metrics.port or 8000
    script = "\n".join([
        "set -eu",
        f"ray start --head --port={RAY_PORT} --node-ip-address=\"$POD_IP\" --num-cpus=0 "
        "--include-dashboard=false --disable-usage-stats",
        # The driver's exit code is the pod's. No `ray stop` first: it would end the worker pods' raylets (and
        # their pods, with an error) before this pod reports Succeeded, and the operator would see a failed worker
        # of a running gang and restart it. Ray ends with this container.
        f"exec hybridflow driver {SPEC_MOUNT}/{SPEC_KEY} --address=127.0.0.1:{RAY_PORT} --metrics-port={port}",
    ])
    k8s = job.spec.kubernetes
    container = {
        "name": "controller",
        "command": ["bash", "-c", script],
        # The driver's last words ("error: spec.data.train: ...") become the container's termination message,
        # which the operator puts into the job's Failed condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "ports": [{"name": "gcs", "containerPort": RAY_PORT}, {"name": "metrics", "containerPort": port}],
        "resources": {
            "requests": {"cpu": k8s.head_cpu, "memory": k8s.head_memory},
            "limits": {"memory": k8s.head_memory},
        },
    }
    if k8s.tracking_secret:  # the trackers' credentials, for the driver alone (by reference, only those keys)
        container["env"] = [{"name": key, "valueFrom": {"secretKeyRef": {"name": k8s.tracking_secret, "key": key,
                                                                         "optional": True}}}
                            for key in TRACKING_CREDENTIAL_KEYS]
    labels = {LABEL_ROLE: "head", LABEL_GENERATION: str(generation)}
    return _pod(job, uid, head_pod_name(name, generation), labels, [container], [], None, "1Gi")


def worker_pod(job: RLHFJob, uid: str, pool: ResourcePool, index: int, generation: int) -> dict[str, Any]:
    """A Ray worker node advertising the pool's devices as the custom resource the controller asks for."""
    name = job.metadata.name
    head = f"{names(name)['service']}.{job_namespace(job)}.svc"
    advertised = {pool_resource(pool.name): pool.devices_per_node}
    if job.spec.replica_pool(pool.name):  # this pod's own slot: its replicas' placement group asks for it
        advertised[pool_slot_resource(pool.name, index)] = pool.devices_per_node
    resources = json.dumps(advertised)
    gpus = pool.devices_per_node if pool.device == "gpu" else 0
    cpus = max(1, int(round(pool.devices_per_node * pool.cpus_per_device)))
    start = (
        f"ray start --address={head}:{RAY_PORT} --node-ip-address=\"$POD_IP\" --num-cpus={cpus} "
        f"--num-gpus={gpus} --resources={shlex.quote(resources)} --disable-usage-stats --block"
    )
    wait = (
        "import socket, sys, time\n"
        "deadline = time.time() + 600\n"
        "while time.time() < deadline:\n"
        "    try:\n"
        f"        socket.create_connection(({head!r}, {RAY_PORT}), 2).close(); sys.exit(0)\n"
        "    except OSError:\n"
        "        time.sleep(2)\n"
        "sys.exit('the Ray head did not come up within 600 s')\n"
    )
    resources_req: dict[str, Any] = {
        "requests": {"cpu": str(cpus), "memory": pool.memory_per_node},
        "limits": {"memory": pool.memory_per_node},
    }
    if gpus:
        resources_req["limits"]["nvidia.com/gpu"] = str(gpus)
        resources_req["requests"]["nvidia.com/gpu"] = str(gpus)
    container = {"name": "ray-worker", "command": ["bash", "-c", start], "resources": resources_req}
    grace = None
    if job.spec.replica_pool(pool.name):
        # A termination notice (scale-down, eviction, drain, preemption) first hands the pod's rollout replicas
        # back to the controller, which lets them finish the call they are in (single_controller.membership); a pod
        # killed outright is a lost replica instead, rebuilt in its replacement.
        grace = leave_grace_seconds(job)
        container["lifecycle"] = {"preStop": {"exec": {"command": [
            "hybridflow", "leave-pool", f"--address={head}:{RAY_PORT}", f"--pool={pool.name}", f"--index={index}",
            f"--timeout={grace - 10}"]}}}
    init = {"name": "wait-for-head", "command": ["python3", "-c", wait],
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                          "limits": {"memory": "64Mi", "ephemeral-storage": "1Gi"}}}
    labels = {LABEL_ROLE: "worker", LABEL_POOL: pool.name, LABEL_INDEX: str(index), LABEL_GENERATION: str(generation)}
    shm = "2Gi" if pool.device == "cpu" else "16Gi"
    pod = _pod(job, uid, worker_pod_name(name, pool.name, index, generation), labels, [container], [init], pool,
               shm)
    if grace is not None:
        pod["spec"]["terminationGracePeriodSeconds"] = grace
    return pod


def leave_grace_seconds(job: RLHFJob) -> int:
    """How long a rollout pod given notice may take to hand its replicas back: the generation call in flight and a
    weight sync may each take up to rollout.weightSyncTimeoutSeconds, plus a margin to connect."""
    return int(job.spec.rollout.weight_sync_timeout_seconds) + 40


def gang_pods(job: RLHFJob, uid: str, generation: int) -> list[dict[str, Any]]:
    """The head and every pool pod of a generation, an elastic rollout pool at its size now."""
    job = sized(job)
    pods = [head_pod(job, uid, generation)]
    for pool in job.spec.resource_pools:
        pods += [worker_pod(job, uid, pool, i, generation) for i in range(pool.nodes)]
    return pods


def token_secret(job: RLHFJob, uid: str, kind: str, token: str) -> dict[str, Any]:
    """A token of the job's own (`kind`: "ray_token", "sandbox_token"), under key `token`: owned by the job, so it
    goes with it. Created once by name; a later create with another token is refused (409) and the first one
    stays."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(job, uid, names(job.metadata.name)[kind]),
        "data": {"token": base64.b64encode(token.encode()).decode()},
        "immutable": True,  # the job's pods hold this token for their lives: it is never changed under them
    }


def ray_token_secret(job: RLHFJob, uid: str, token: str) -> dict[str, Any]:
    """The job's own Ray token (when the spec names no Secret)."""
    return token_secret(job, uid, "ray_token", token)


def network_policy(job: RLHFJob, uid: str, metrics_namespaces: list[str],
                   egress: Egress | None = None) -> dict[str, Any]:
    """Ingress to the job's pods only from the job's own pods, plus the driver's metrics port from the namespaces
    that scrape it (Prometheus, and the operator, which polls progress there). Egress from them only to the job's
    own pods, the cluster's DNS, the object store when the job checkpoints to one, and the platform's extra rules
    (`egress`, from the chart's networkPolicy values); no ipBlock reaches the link-local range (the cloud's metadata
    service), and nothing reaches the Kubernetes API (the pods hold no token either). The policy keeps the name it
    had when it was ingress only (`<job>-ingress`), so jobs running across an upgrade keep one policy each."""
    name = job.metadata.name
    own = {"podSelector": {"matchLabels": {LABEL_JOB: name}}}
    rules: list[dict[str, Any]] = [{"from": [own]}]
    if job.spec.metrics.port and metrics_namespaces:
        rules.append({
            "from": [{"namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name",
                                                                  "operator": "In",
                                                                  "values": sorted(set(metrics_namespaces))}]}}],
            "ports": [{"protocol": "TCP", "port": job.spec.metrics.port}],
        })
    trainer = job.spec.trainer
    object_storage = is_url(trainer.checkpoint_dir) or bool(trainer.resume_from and is_url(trainer.resume_from))
    out_rules = [{"to": [own]}, *(egress or Egress()).rules(object_storage)]
    selected: dict[str, Any] = {"matchLabels": {LABEL_JOB: name}}
    if sandbox_pool(job.spec) is not None:
        # Policies add up: selecting the environment pods here too would grant them this policy's egress. Theirs
        # (environments.environment_policy) denies all of it.
        selected["matchExpressions"] = [{"key": LABEL_ROLE, "operator": "NotIn", "values": [ENVIRONMENT_ROLE]}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, uid, names(name)["network_policy"]),
        "spec": {"podSelector": selected, "policyTypes": ["Ingress", "Egress"],
                 "ingress": rules, "egress": out_rules},
    }


def pod_references(pods: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(kind, name) of every object the pods would use: ConfigMaps, Secrets and PersistentVolumeClaims (volumes, env,
    envFrom) and their ServiceAccount. A volume of any other kind but emptyDir counts as a reference of that kind."""
    out: set[tuple[str, str]] = set()
    for pod in pods:
        spec = pod["spec"]
        if spec.get("serviceAccountName"):
            out.add(("ServiceAccount", spec["serviceAccountName"]))
        for v in spec.get("volumes") or []:
            source = next(k for k in v if k != "name")
            if source == "configMap":
                out.add(("ConfigMap", v["configMap"]["name"]))
            elif source == "secret":
                out.add(("Secret", v["secret"]["secretName"]))
            elif source == "persistentVolumeClaim":
                out.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
            elif source != "emptyDir":
                out.add((f"{source} volume", v["name"]))
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for ref in [(e.get("valueFrom") or {}) for e in c.get("env") or []] + (c.get("envFrom") or []):
                for key, kind in (("secretKeyRef", "Secret"), ("secretRef", "Secret"),
                                  ("configMapKeyRef", "ConfigMap"), ("configMapRef", "ConfigMap")):
                    if key in ref:
                        out.add((kind, ref[key]["name"]))
    return out


def accepted_references(job: RLHFJob) -> set[tuple[str, str]]:
    """What pods of this spec may use: the job's own spec and reward ConfigMaps (never the user's reward ConfigMap:
    its copy), its Ray token Secret (its own, or kubernetes.rayAuthSecret), kubernetes.checkpointSecret, its PVCs and
    its ServiceAccount."""
    k8s, own = job.spec.kubernetes, names(job.metadata.name)
    refs = {("ConfigMap", own["configmap"]), ("Secret", ray_token_secret_name(job))}
    if sandbox_pool(job.spec) is not None:
        refs.add(("Secret", own["sandbox_token"]))
    if k8s.reward_config_map:
        refs.add(("ConfigMap", own["reward"]))
    if k8s.checkpoint_secret:
        refs.add(("Secret", k8s.checkpoint_secret))
    if k8s.tracking_secret:
        refs.add(("Secret", k8s.tracking_secret))
    refs |= {("PersistentVolumeClaim", c) for c in (k8s.checkpoint_pvc, k8s.model_pvc, k8s.data_pvc) if c}
    if k8s.service_account_name:
        refs.add(("ServiceAccount", k8s.service_account_name))
    return refs


def foreign_references(pods: list[dict[str, Any]], accepted: RLHFJob) -> list[str]:
    """The objects the pods would use that the accepted spec does not name ("Secret x"), checked at every gang
    start: whatever was edited into the live spec, or however a pod came to be built, the pods get only what the
    job was accepted with."""
    return [f"{kind} {name}" for kind, name in sorted(pod_references(pods) - accepted_references(accepted))]


def static_children(job: RLHFJob, uid: str, ray_token: str, metrics_namespaces: list[str],
                    egress: Egress | None = None, accepted: RLHFJob | None = None) -> list[dict[str, Any]]:
    """What exists for the job's whole life, across gang restarts. `uid`: the job object's (its children's owner);
    `ray_token` is a fresh random token, used only when the job has no token Secret yet; `egress`: where the job's
    pods may connect (default: own pods and DNS); `accepted`: the spec the ConfigMap holds when `job` is not it (a
    `placement: auto` job's, before its plan is laid over it)."""
    out = [configmap(accepted or job, uid), head_service(job, uid), network_policy(job, uid, metrics_namespaces,
                                                                                 egress)]
    if not job.spec.kubernetes.ray_auth_secret:
        out.append(ray_token_secret(job, uid, ray_token))
    if job.spec.run_policy.gang_scheduling and job.spec.placement != "auto":
        # sized by the pools: a `placement: auto` job's PodGroup waits for its plan (made at its first gang start)
        out.append(podgroup(job, uid))
    return out
