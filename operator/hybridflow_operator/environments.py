"""spec.environments on Kubernetes: the environment pool's pods, their headless Service and their NetworkPolicy, and
the pure plan that keeps the pool at its size. Pure functions, no I/O, like manifests and phases.

The pool is not part of the gang: its pods carry no generation, a gang restart leaves them running (their sessions
are lost only if they die), and one that fails is deleted and made again under the same name, reachable at the same
address (env-<index>.<job>-env.<namespace>.svc), while training goes on: the rollout sees SessionLost for the
episodes it held and starts them again elsewhere. They run user code (tools, environments) in sandboxes, so they get
the least of the job's pods: no object-storage credentials, no checkpoint or model volumes, no egress at all, and
ingress only from the job's own pods, on the pool's port.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.api import DATA_MOUNT, RLHFJob
from hybridflow.api.names import LABEL_INDEX, LABEL_JOB, LABEL_ROLE, names
from hybridflow.api.status import Phase

from hybridflow_operator.manifests import (
    ENVIRONMENT_PORT, ENVIRONMENT_ROLE, SANDBOX_ENV, SANDBOX_REQUIRED, SCRATCH_MOUNT, SCRATCH_SIZE, SPEC_KEY,
    SPEC_MOUNT, _meta, _pod, environment_pod_name, environment_service_name,
)
from hybridflow_operator.phases import PodPhase, PodView

# Phases in which the pool runs (its pods are made, and made again when one dies); in every other phase they go.
POOL_PHASES = (Phase.PENDING, Phase.INITIALIZING, Phase.RUNNING, Phase.RESTARTING)
ENDED = (PodPhase.FAILED, PodPhase.SUCCEEDED, PodPhase.UNKNOWN)


def environment_labels(index: int) -> dict[str, str]:
    return {LABEL_ROLE: ENVIRONMENT_ROLE, LABEL_INDEX: str(index)}


def _volumes(job: RLHFJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The spec, a bounded scratch (the root filesystem is read-only; the sandboxes' private /tmp lives there), and
    the data claim read-only when the agent's environment or tools file is on it."""
    vols: list[dict[str, Any]] = [
        {"name": "spec", "configMap": {"name": names(job.metadata.name)["configmap"]}},
        {"name": "scratch", "emptyDir": {"sizeLimit": SCRATCH_SIZE}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "scratch", "mountPath": SCRATCH_MOUNT},
    ]
    k8s, agent = job.spec.kubernetes, job.spec.rollout.agent
    if k8s.data_pvc and agent is not None and (agent.environment_file or agent.tools_file):
        vols.append({"name": "data", "persistentVolumeClaim": {"claimName": k8s.data_pvc, "readOnly": True}})
        mounts.append({"name": "data", "mountPath": DATA_MOUNT, "readOnly": True})
    return vols, mounts


def environment_pod(job: RLHFJob, uid: str, index: int) -> dict[str, Any]:
    """Replica `index`: `hybridflow environments serve` on the resolved spec, authenticated with the job's token
    (RAY_AUTH_TOKEN, which every job pod gets)."""
    pool = job.spec.environments
    assert pool is not None
    name = job.metadata.name
    container = {
        "name": "environments",
        "image": pool.image or job.spec.kubernetes.image,
        "command": ["hybridflow", "environments", "serve", "--spec", f"{SPEC_MOUNT}/{SPEC_KEY}",
                    "--port", str(ENVIRONMENT_PORT), "--address", "0.0.0.0"],
        "ports": [{"name": "environments", "containerPort": ENVIRONMENT_PORT}],
        "env": [{"name": SANDBOX_ENV, "value": SANDBOX_REQUIRED}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": ENVIRONMENT_PORT}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": pool.cpu, "memory": pool.memory},
                      "limits": {"cpu": pool.cpu, "memory": pool.memory}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod = _pod(job, uid, environment_pod_name(name, index), environment_labels(index), [container], [], None, "64Mi",
               volumes_and_mounts=_volumes(job), gang=False)
    pod["spec"]["hostname"] = f"env-{index}"
    pod["spec"]["subdomain"] = environment_service_name(name)
    return pod


def environment_service(job: RLHFJob, uid: str) -> dict[str, Any]:
    """Headless: each replica by its own name (the pods' hostname in this subdomain), none behind a virtual IP,
    since a session must reach the replica that holds it."""
    name = job.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, uid, environment_service_name(name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: name, LABEL_ROLE: ENVIRONMENT_ROLE},
            "ports": [{"name": "environments", "port": ENVIRONMENT_PORT, "targetPort": ENVIRONMENT_PORT,
                       "protocol": "TCP"}],
        },
    }


# The pool's NetworkPolicy shares its Service's name (<job>-env): one name for the pool's static children.
environment_policy_name = environment_service_name


def environment_policy(job: RLHFJob, uid: str) -> dict[str, Any]:
    """The environment pods' fence: no egress at all (not even DNS: they call nothing), and ingress only from the
    job's own pods on the pool's port. The job's other policy does not select them (manifests.network_policy), so
    nothing adds egress back."""
    name = job.metadata.name
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, uid, environment_policy_name(name)),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: name, LABEL_ROLE: ENVIRONMENT_ROLE}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {LABEL_JOB: name}}}],
                         "ports": [{"protocol": "TCP", "port": ENVIRONMENT_PORT}]}],
            "egress": [],
        },
    }


def environment_children(job: RLHFJob, uid: str) -> list[dict[str, Any]]:
    """The pool's static children (none without spec.environments)."""
    if job.spec.environments is None:
        return []
    return [environment_service(job, uid), environment_policy(job, uid)]


@dataclass
class PoolPlan:
    """What to do about the pool this tick: replicas to create, pods to delete, and status.environments."""

    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    status: dict[str, int] | None = None


def plan_pool(job: RLHFJob, phase: str | None, pods: list[PodView], creating_gang: bool) -> PoolPlan:
    """The pool in the phase the tick leaves the job in. It runs from the first gang's creation to the job's end:
    missing replicas are made (in Pending only along with the gang's pods, so that a job waiting for its inputs
    starts nothing), ended ones deleted (and made again once gone); in any other phase (suspended, finished) every
    pod goes. `pods`: the job's environment pods."""
    pool = job.spec.environments
    live = [p for p in pods if not p.deleting]
    if pool is None or phase not in POOL_PHASES:  # every pod goes, and the status says so (not the last count)
        return PoolPlan(delete=[p.name for p in live],
                        status=None if pool is None else {"replicas": pool.replicas, "pods": 0, "ready": 0})
    wanted = {environment_pod_name(job.metadata.name, i): i for i in range(pool.replicas)}
    plan = PoolPlan(delete=[p.name for p in live if p.phase in ENDED or p.name not in wanted])
    present = {p.name for p in pods}  # a deleting pod still holds its name: made again once it is gone
    if phase != Phase.PENDING or creating_gang:
        plan.create = [i for n, i in wanted.items() if n not in present]
    serving = [p for p in live if p.name in wanted and p.phase not in ENDED]
    plan.status = {"replicas": pool.replicas, "pods": len(serving), "ready": sum(p.ready for p in serving)}
    return plan
