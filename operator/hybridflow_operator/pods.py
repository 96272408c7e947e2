"""The gang's pods (head and pool pods of a generation) and what they need of the sandbox pool: pure, the job in,
dicts out."""
from __future__ import annotations

import copy
import json
import shlex
from pathlib import PurePosixPath
from typing import Any

from hybridflow.api import DATA_MOUNT, REWARD_MOUNT, JobSpec, RLHFJob, ResourcePool, pool_resource, pool_slot_resource
from hybridflow.api.agents import (
    ENDPOINT_PORTS_ENV, ENVIRONMENT_URLS_ENV, REWARD_URLS_ENV, SERVES_AGENTS, SERVES_ALL, SERVES_REWARDS,
    sandbox_replicas,
)
from hybridflow.api.names import (
    LABEL_GENERATION, LABEL_INDEX, LABEL_POOL, LABEL_ROLE, head_pod_name, names, worker_pod_name,
)
from hybridflow.api.scaling import sized
from hybridflow.api.storage import CHECKPOINT_MOUNT, STORAGE_CREDENTIAL_KEYS, TRACKING_CREDENTIAL_KEYS

from hybridflow_operator.meta import (
    AGENT_ENDPOINT_PORTS, ENVIRONMENT_PORT, FS_GROUP, MODEL_CACHE, MODEL_CACHE_SIZE, MODELS_MOUNT, RAY_PORT,
    RESUME_MOUNT, SANDBOX_ENV, SANDBOX_REQUIRED, SANDBOX_TOKEN_ENV, SANDBOX_TOKEN_KEY, SCRATCH_MOUNT, SCRATCH_SIZE,
    SPEC_KEY, SPEC_MOUNT, metrics_port, object_meta, job_namespace, ray_token_secret_name,
)
from hybridflow_operator.resolve import is_below, model_sources, resolved_job


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
    variable), the ports a rollout's endpoint takes for an agent program run there, and the sandbox token; [] without
    a pool."""
    if not (agents := environment_urls(job)):
        return []
    out = [{"name": ENVIRONMENT_URLS_ENV, "value": ",".join(agents)}]
    if (rewards := environment_urls(job, SERVES_REWARDS)) != agents:
        out.append({"name": REWARD_URLS_ENV, "value": ",".join(rewards)})
    if runs_program(job):
        out.append(endpoint_ports_env())
    return [*out, sandbox_token_env(job)]



def runs_program(job: RLHFJob) -> bool:
    """An agent program (spec.rollout.agent.program): its runs in the pool call the rollout's endpoint back."""
    return job.spec.rollout.agent is not None and job.spec.rollout.agent.program is not None


def endpoint_ports_env() -> dict[str, Any]:
    """ENDPOINT_PORTS_ENV: the ports a rollout's endpoint takes (the gang's pods) and the only ones a sandbox pod's
    relay connects to (hybridflow.agents.relay.allowed_target)."""
    return {"name": ENDPOINT_PORTS_ENV, "value": "-".join(map(str, AGENT_ENDPOINT_PORTS))}


def agent_endpoint_ports() -> dict[str, Any]:
    """The NetworkPolicyPort of the rollout endpoints' ports (AGENT_ENDPOINT_PORTS), for a job with a program."""
    first, last = AGENT_ENDPOINT_PORTS
    return {"protocol": "TCP", "port": first, "endPort": last}


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
    if model_mounts := model_volume_mounts(run.spec):
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


def model_volume_mounts(s: JobSpec) -> list[dict[str, Any]]:
    """kubernetes.modelPvc: each model directory the (resolved) spec names, read-only by its own subPath (a
    directory inside another one is seen through it); nothing of the claim's other models."""
    if not s.kubernetes.model_pvc:
        return []
    rels = {is_below(MODELS_MOUNT, src.path) for src in model_sources(s).values() if src.source == "path" and src.path}
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
        own = is_below(CHECKPOINT_MOUNT, t.checkpoint_dir)
        out.append({"name": "checkpoints", "mountPath": t.checkpoint_dir, "subPath": own})
    if t.resume_from and t.resume_from.startswith(RESUME_MOUNT + "/"):
        source = PurePosixPath(is_below(RESUME_MOUNT, t.resume_from) or "")
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


def pod_manifest(
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
    meta = object_meta(job, uid, name, labels)
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def head_pod(job: RLHFJob, uid: str, generation: int) -> dict[str, Any]:
    """Ray head (no devices of its own) plus the single controller; the pod's exit code is the job's."""
    name = job.metadata.name
    port = metrics_port(job)
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
    return pod_manifest(job, uid, head_pod_name(name, generation), labels, [container], [], None, "1Gi")


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
    pod = pod_manifest(job, uid, worker_pod_name(name, pool.name, index, generation), labels, [container], [init], pool,
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


