"""Every object the operator creates, built by pure functions from the job: dicts in, dicts out, no I/O.

Pods carry the gang *generation* (the restart count) in their names and labels, so a restarted gang never
collides with the terminating pods of the previous one, and the operator only looks at the current generation.
"""
from __future__ import annotations

import json
import shlex
from typing import Any

import yaml

from hybridflow.spec import API_GROUP as GROUP
from hybridflow.spec import DATA_MOUNT, REWARD_MOUNT, RLHFJob, ResourcePool, dump_job, pool_resource

LABEL_JOB = f"{GROUP}/job"
LABEL_ROLE = f"{GROUP}/role"
LABEL_POOL = f"{GROUP}/pool"
LABEL_INDEX = f"{GROUP}/index"
LABEL_GENERATION = f"{GROUP}/generation"
MANAGED_BY = {"app.kubernetes.io/managed-by": "hybridflow-operator", "app.kubernetes.io/name": "hybridflow"}

RAY_PORT = 6379
SPEC_MOUNT = "/etc/hybridflow"
CHECKPOINT_MOUNT = "/var/lib/hybridflow/checkpoints"
MODEL_CACHE = "/var/cache/hybridflow/models"
MODELS_MOUNT = "/models"


def job_labels(name: str) -> dict[str, str]:
    return {**MANAGED_BY, LABEL_JOB: name}


def selector(name: str, **extra: str) -> str:
    """Label selector for the job's children, e.g. selector('j', role='head')."""
    parts = [f"{LABEL_JOB}={name}"] + [f"{GROUP}/{k}={v}" for k, v in extra.items()]
    return ",".join(parts)


def owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "apiVersion": job.get("apiVersion", f"{GROUP}/v1alpha1"),
        "kind": "RLHFJob",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(job: dict[str, Any], name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job["metadata"].get("namespace", "default"),
        "labels": {**job_labels(job["metadata"]["name"]), **(labels or {})},
        "ownerReferences": [owner_reference(job)],
    }


def names(job_name: str) -> dict[str, str]:
    return {
        "configmap": f"{job_name}-spec",
        "service": f"{job_name}-head",
        "podgroup": f"{job_name}-gang",
    }


def head_pod_name(job_name: str, generation: int) -> str:
    return f"{job_name}-head-g{generation}"


def worker_pod_name(job_name: str, pool: str, index: int, generation: int) -> str:
    return f"{job_name}-{pool}-{index}-g{generation}"


def resolved_job(job: RLHFJob) -> RLHFJob:
    """The spec as it runs in pods: metrics on all interfaces, checkpoints on the PVC when one is given, prompt
    files inside the data volume and the reward file inside the ConfigMap's mount."""
    run = job.model_copy(deep=True)
    s, k8s = run.spec, run.spec.kubernetes
    s.metrics.address = "0.0.0.0"
    if k8s.checkpoint_pvc:
        s.trainer.checkpoint_dir = CHECKPOINT_MOUNT
    if k8s.data_pvc:
        s.data.train = [_inside(DATA_MOUNT, p) for p in s.data.train]
        s.data.eval = [_inside(DATA_MOUNT, p) for p in s.data.eval]
    if k8s.reward_config_map and s.models.reward.function is not None:
        s.models.reward.function.path = _inside(REWARD_MOUNT, s.models.reward.function.path)
    return run


def _inside(mount: str, path: str) -> str:
    """A path the spec gives relative to a volume, as the pod sees it (idempotent: the accepted spec is resolved
    again when compared with the live one)."""
    return path if path.startswith(mount + "/") else f"{mount}/{path}"


def configmap(job: dict[str, Any], parsed: RLHFJob) -> dict[str, Any]:
    doc = dump_job(resolved_job(parsed))
    doc["metadata"] = {"name": parsed.metadata.name, "namespace": job["metadata"].get("namespace", "default")}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, names(parsed.metadata.name)["configmap"]),
        "data": {"job.yaml": yaml.safe_dump(doc, sort_keys=False)},
    }


def head_service(job: dict[str, Any], parsed: RLHFJob) -> dict[str, Any]:
    name = parsed.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, names(name)["service"]),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # workers must resolve the head before it is Ready
            "selector": {LABEL_JOB: name, LABEL_ROLE: "head"},
            "ports": [
                {"name": "gcs", "port": RAY_PORT, "targetPort": RAY_PORT, "protocol": "TCP"},
                {"name": "metrics", "port": parsed.spec.metrics.port or 8000, "protocol": "TCP"},
            ],
        },
    }


def podgroup(job: dict[str, Any], parsed: RLHFJob) -> dict[str, Any]:
    """Volcano gang: nothing starts until the head and every pool pod can be placed."""
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": _meta(job, names(parsed.metadata.name)["podgroup"]),
        "spec": {"minMember": 1 + sum(p.nodes for p in parsed.spec.resource_pools)},
    }


def _ray_env(parsed: RLHFJob) -> list[dict[str, Any]]:
    secret = parsed.spec.kubernetes.ray_auth_secret
    env: list[dict[str, Any]] = [
        {"name": "RAY_DEDUP_LOGS", "value": "1"},
        {"name": "HYBRIDFLOW_MODEL_CACHE", "value": MODEL_CACHE},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if secret:
        env += [
            {"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}},
        ]
    else:
        env.append({"name": "RAY_AUTH_MODE", "value": "disabled"})
    return env


def _volumes(job: dict[str, Any], parsed: RLHFJob, shm: str, head: bool) -> tuple[list[dict], list[dict]]:
    vols = [
        {"name": "spec", "configMap": {"name": names(parsed.metadata.name)["configmap"]}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}},
        {"name": "model-cache", "emptyDir": {}},
    ]
    mounts = [
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "model-cache", "mountPath": MODEL_CACHE},
    ]
    if parsed.spec.kubernetes.model_pvc:
        vols.append({"name": "models", "persistentVolumeClaim": {"claimName": parsed.spec.kubernetes.model_pvc,
                                                                 "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
    if parsed.spec.kubernetes.checkpoint_pvc:
        vols.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": parsed.spec.kubernetes.checkpoint_pvc}})
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT})
    k8s = parsed.spec.kubernetes
    if head and k8s.data_pvc:
        vols.append({"name": "data", "persistentVolumeClaim": {"claimName": k8s.data_pvc, "readOnly": True}})
        mounts.append({"name": "data", "mountPath": DATA_MOUNT, "readOnly": True})
    if head and k8s.reward_config_map:
        vols.append({"name": "reward", "configMap": {"name": k8s.reward_config_map}})
        mounts.append({"name": "reward", "mountPath": REWARD_MOUNT, "readOnly": True})
    return vols, mounts


def _pod(
    job: dict[str, Any],
    parsed: RLHFJob,
    name: str,
    labels: dict[str, str],
    containers: list[dict[str, Any]],
    init_containers: list[dict[str, Any]],
    pool: ResourcePool | None,
    shm: str,
) -> dict[str, Any]:
    k8s, policy = parsed.spec.kubernetes, parsed.spec.run_policy
    volumes, mounts = _volumes(job, parsed, shm, head=pool is None)
    for c in [*containers, *init_containers]:
        c.setdefault("image", k8s.image)
        c.setdefault("imagePullPolicy", k8s.image_pull_policy)
        c["volumeMounts"] = mounts
        c["env"] = _ray_env(parsed) + c.get("env", [])
        c.setdefault("securityContext", {"allowPrivilegeEscalation": False})
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a failed container fails the gang; the operator restarts it whole
        "containers": containers,
        "volumes": volumes,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
    }
    if init_containers:
        spec["initContainers"] = init_containers
    if k8s.service_account_name:
        spec["serviceAccountName"] = k8s.service_account_name
    if policy.priority_class_name:
        spec["priorityClassName"] = policy.priority_class_name
    annotations: dict[str, str] = {}
    if policy.gang_scheduling:
        spec["schedulerName"] = policy.scheduler_name or "volcano"
        annotations["scheduling.k8s.io/group-name"] = names(parsed.metadata.name)["podgroup"]
    elif policy.scheduler_name:
        spec["schedulerName"] = policy.scheduler_name
    if pool is not None:
        if pool.node_selector:
            spec["nodeSelector"] = dict(pool.node_selector)
        if pool.tolerations:
            spec["tolerations"] = [dict(t) for t in pool.tolerations]
        if pool.affinity:
            spec["affinity"] = dict(pool.affinity)
    meta = _meta(job, name, labels)
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def head_pod(job: dict[str, Any], parsed: RLHFJob, generation: int) -> dict[str, Any]:
    """Ray head (no devices of its own) plus the single controller; the pod's exit code is the job's."""
    name = parsed.metadata.name
    port = parsed.spec.metrics.port or 8000
    script = "\n".join([
        "set -eu",
        f"ray start --head --port={RAY_PORT} --node-ip-address=\"$POD_IP\" --num-cpus=0 "
        "--include-dashboard=false --disable-usage-stats",
        # The driver's exit code is the pod's. No `ray stop` first: it would end the worker pods' raylets (and
        # their pods, with an error) before this pod reports Succeeded, and the operator would see a failed worker
        # of a running gang and restart it. Ray ends with this container.
        f"exec hybridflow driver {SPEC_MOUNT}/job.yaml --address=127.0.0.1:{RAY_PORT} --metrics-port={port}",
    ])
    k8s = parsed.spec.kubernetes
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
    labels = {LABEL_ROLE: "head", LABEL_GENERATION: str(generation)}
    return _pod(job, parsed, head_pod_name(name, generation), labels, [container], [], None, "1Gi")


def worker_pod(job: dict[str, Any], parsed: RLHFJob, pool: ResourcePool, index: int, generation: int) -> dict[str, Any]:
    """A Ray worker node advertising the pool's devices as the custom resource the controller asks for."""
    name = parsed.metadata.name
    ns = job["metadata"].get("namespace", "default")
    head = f"{names(name)['service']}.{ns}.svc"
    resources = json.dumps({pool_resource(pool.name): pool.devices_per_node})
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
    init = {"name": "wait-for-head", "command": ["python3", "-c", wait],
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}}}
    labels = {LABEL_ROLE: "worker", LABEL_POOL: pool.name, LABEL_INDEX: str(index), LABEL_GENERATION: str(generation)}
    shm = "2Gi" if pool.device == "cpu" else "16Gi"
    return _pod(job, parsed, worker_pod_name(name, pool.name, index, generation), labels, [container], [init], pool,
                shm)


def gang_pods(job: dict[str, Any], parsed: RLHFJob, generation: int) -> list[dict[str, Any]]:
    pods = [head_pod(job, parsed, generation)]
    for pool in parsed.spec.resource_pools:
        pods += [worker_pod(job, parsed, pool, i, generation) for i in range(pool.nodes)]
    return pods


def static_children(job: dict[str, Any], parsed: RLHFJob) -> list[dict[str, Any]]:
    """What exists for the job's whole life, across gang restarts."""
    out = [configmap(job, parsed), head_service(job, parsed)]
    if parsed.spec.run_policy.gang_scheduling:
        out.append(podgroup(job, parsed))
    return out
