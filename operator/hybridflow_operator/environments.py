"""The sandbox pool on Kubernetes (spec.environments, or one default replica for a job with user code: the reward
function, an agent's tools and environments or its program): its pods, their headless Service, their NetworkPolicy
and token Secret, and the pure plan that keeps the pool at its size. Pure functions, no I/O, like manifests and phases.

The pool is where a Kubernetes job's untrusted code runs, and the only place: its pods hold no Ray token, no storage
or tracking keys and no ServiceAccount token, reach nothing (egress denied; an agent program's runs, the rollout's
endpoint ports alone), run under spec.sandbox's runtime class
when one is given, and answer only callers with the job's sandbox token, which opens nothing else.

The pool is not part of the gang: its pods carry no generation, a gang restart leaves them running (their sessions
are lost only if they die), and one that fails is deleted and made again under the same name, reachable at the same
address (env-<index>.<job>-env.<namespace>.svc), while training goes on: the rollout sees SessionLost for the
episodes it held and starts them again elsewhere. They run user code (tools, environments) in sandboxes, so they get
the least of the job's pods: no credentials, no checkpoint or model volumes, no egress (but an agent program's
calls to the rollout's endpoint ports), and ingress only from the job's own pods, on the pool's port.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.api import EXIT_SANDBOX_UNAVAILABLE, RLHFJob
from hybridflow.api.agents import SERVES_ALL, SERVES_REWARDS, code_files, sandbox_pool, sandbox_replicas
from hybridflow.api.names import LABEL_INDEX, LABEL_JOB, LABEL_ROLE, names
from hybridflow.api.status import Phase

from hybridflow_operator.manifests import (
    REWARD_MOUNT, agent_endpoint_ports, gang_selector, reward_configmap_key, runs_program, token_secret,
)
from hybridflow_operator.meta import (
    ENVIRONMENT_PORT, ENVIRONMENT_ROLE, SANDBOX_ENV, SANDBOX_PARTIAL, SANDBOX_REQUIRED, SCRATCH_MOUNT, SCRATCH_SIZE,
    SPEC_KEY, SPEC_MOUNT, object_meta,
)
from hybridflow_operator.plan import PodPhase, PodView
from hybridflow_operator.pods import (
    endpoint_ports_env, environment_pod_name, environment_service_name, pod_manifest, sandbox_token_env,
)
from hybridflow_operator.resolve import code_keys

# Phases in which the pool runs (its pods are made, and made again when one dies); in every other phase they go.
POOL_PHASES = (Phase.PENDING, Phase.INITIALIZING, Phase.RUNNING, Phase.RESTARTING)
ENDED = (PodPhase.FAILED, PodPhase.SUCCEEDED, PodPhase.UNKNOWN)


# The uid of the sandbox token Secret a sandbox pod started with (it read the token then). The operator never reads
# the Secret: when it had to make it anew (deleted since), its create returned a new uid, and a pod started with the
# old token would answer the gang, which reads the new one, 401; plan_pool replaces such pods, tick after tick,
# until none is left (level-triggered: a tick that fails between the Secret and the deletion loses nothing).
TOKEN_UID_ANNOTATION = "hybridflow.io/sandbox-token-uid"


def environment_labels(index: int) -> dict[str, str]:
    return {LABEL_ROLE: ENVIRONMENT_ROLE, LABEL_INDEX: str(index)}


def _volumes(job: RLHFJob, serves: str = SERVES_ALL) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The spec, a bounded scratch (the root filesystem is read-only; the sandboxes' private /tmp lives there) and
    the job's copy of its code files (reward function, tools, environment: copied from kubernetes.rewardConfigMap at
    acceptance): a replica serving one half of a split pool gets that half's files only (the model's code never
    reads the reward function's). Never the data claim: no code is read from it (the spec refuses that), and the
    pool reads no prompts."""
    vols: list[dict[str, Any]] = [
        {"name": "spec", "configMap": {"name": names(job.metadata.name)["configmap"]}},
        {"name": "scratch", "emptyDir": {"sizeLimit": SCRATCH_SIZE}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "scratch", "mountPath": SCRATCH_MOUNT},
    ]
    if code_keys(job):
        source: dict[str, Any] = {"name": names(job.metadata.name)["reward"]}
        if serves != SERVES_ALL:
            mine = {reward_configmap_key(path) for field, path in code_files(job.spec).items()
                    if field.startswith("spec.models.reward.") == (serves == SERVES_REWARDS)}
            if not mine:  # an agent of built-ins only: no code to mount (an empty `items` would project every key)
                return vols, mounts
            source["items"] = [{"key": k, "path": k} for k in sorted(mine)]
        vols.append({"name": "reward", "configMap": source})
        mounts.append({"name": "reward", "mountPath": REWARD_MOUNT, "readOnly": True})
    return vols, mounts


def sandbox_env(job: RLHFJob) -> list[dict[str, Any]]:
    """All a sandbox pod's environment: the sandbox token, require (or partial, spec.sandbox.allowPartial), HOME in
    its scratch, the endpoints' ports for a program's runs; no Ray token, no storage or tracking key."""
    mode = SANDBOX_PARTIAL if job.spec.sandbox.allow_partial else SANDBOX_REQUIRED
    # a job's agent program: the endpoints' ports, the only ones its runs' relays connect to (the request names the
    # address; a NetworkPolicy does not see the pod's own loopback)
    ports = [endpoint_ports_env()] if runs_program(job) else []
    return [{"name": SANDBOX_ENV, "value": mode}, sandbox_token_env(job), {"name": "HOME", "value": SCRATCH_MOUNT},
            {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"}, *ports]


def environment_pod(job: RLHFJob, uid: str, index: int, runtime_class: str = "",
                    token_uid: str = "") -> dict[str, Any]:
    """Replica `index`: `hybridflow environments serve` on the resolved spec, authenticated with the job's sandbox
    token, serving what sandbox_replicas gives that index. `runtime_class`: the RuntimeClass when the spec names
    none (the chart's jobPolicy.sandboxRuntimeClassName, policy.Policy.sandbox_runtime_class; "": the cluster's
    default runtime). `token_uid`: the uid of the sandbox token Secret it starts with (TOKEN_UID_ANNOTATION)."""
    pool = sandbox_pool(job.spec)
    assert pool is not None
    name, serves = job.metadata.name, sandbox_replicas(job.spec)[index]
    # --serves only for a split pool: a pool serving everything runs as before (an older image has no such flag)
    split = ["--serves", serves] if serves != SERVES_ALL else []
    container = {
        "name": "environments",
        "image": pool.image or job.spec.kubernetes.image,
        "command": ["hybridflow", "environments", "serve", "--spec", f"{SPEC_MOUNT}/{SPEC_KEY}",
                    "--port", str(ENVIRONMENT_PORT), "--address", "0.0.0.0", *split],
        "ports": [{"name": "environments", "containerPort": ENVIRONMENT_PORT}],
        "env": sandbox_env(job),
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": ENVIRONMENT_PORT}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": pool.cpu, "memory": pool.memory},
                      "limits": {"cpu": pool.cpu, "memory": pool.memory}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod = pod_manifest(job, uid, environment_pod_name(name, index), environment_labels(index), [container], [], None, "64Mi",
               volumes_and_mounts=_volumes(job, serves), gang=False)
    if runtime_class := job.spec.sandbox.runtime_class_name or runtime_class:
        pod["spec"]["runtimeClassName"] = runtime_class
    if token_uid:
        pod["metadata"].setdefault("annotations", {})[TOKEN_UID_ANNOTATION] = token_uid
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
        "metadata": object_meta(job, uid, environment_service_name(name)),
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
    """The environment pods' fence: no egress at all (not even DNS: they call nothing by name), but, for a job with
    an agent program, to the rollout endpoints' ports (AGENT_ENDPOINT_PORTS) on the job's other pods, where its runs
    call the model (relayed by the pool's process: the sandboxes themselves have no network); and ingress only from
    the job's own pods on the pool's port. The job's other policy does not select them (manifests.network_policy),
    so nothing adds egress back."""
    name = job.metadata.name
    egress = [{"to": [{"podSelector": gang_selector(name)}], "ports": [agent_endpoint_ports()]}] \
        if runs_program(job) else []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, uid, environment_policy_name(name)),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: name, LABEL_ROLE: ENVIRONMENT_ROLE}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {LABEL_JOB: name}}}],
                         "ports": [{"protocol": "TCP", "port": ENVIRONMENT_PORT}]}],
            "egress": egress,
        },
    }


def environment_children(job: RLHFJob, uid: str, token: str) -> list[dict[str, Any]]:
    """The pool's static children (none for a job without user code). `token`: a fresh random one, used only when
    the job has no sandbox token Secret yet."""
    if sandbox_pool(job.spec) is None:
        return []
    return [environment_service(job, uid), environment_policy(job, uid),
            token_secret(job, uid, "sandbox_token", token)]


@dataclass
class PoolPlan:
    """What to do about the pool this tick: replicas to create, pods to delete, and status.environments."""

    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    status: dict[str, int] | None = None
    # a replica refused to run the job's code without every layer of the sandbox (its exit code says so): the
    # message that fails the job, since a replacement on the same nodes would refuse the same way
    refused: str = ""


def plan_pool(job: RLHFJob, phase: str | None, pods: list[PodView], creating_gang: bool,
              token_uid: str = "") -> PoolPlan:
    """The pool in the phase the tick leaves the job in. It runs from the first gang's creation to the job's end:
    missing replicas are made (in Pending only along with the gang's pods, so that a job waiting for its inputs
    starts nothing), ended ones deleted (and made again once gone); in any other phase (suspended, finished) every
    pod goes. `pods`: the job's environment pods."""
    replicas = len(sandbox_replicas(job.spec))
    live = [p for p in pods if not p.deleting]
    if not replicas or phase not in POOL_PHASES:  # every pod goes, and the status says so (not the last count)
        return PoolPlan(delete=[p.name for p in live],
                        status={"replicas": replicas, "pods": 0, "ready": 0} if replicas else None)
    wanted = {environment_pod_name(job.metadata.name, i): i for i in range(replicas)}
    # ended, unwanted, or started with a sandbox token made anew since (`token_uid`: the job's Secret's uid now; a
    # pod without the annotation, made by an older operator, is left as it is)
    stale = {p.name for p in live if token_uid and p.token_uid and p.token_uid != token_uid}
    plan = PoolPlan(delete=[p.name for p in live if p.phase in ENDED or p.name not in wanted or p.name in stale])
    present = {p.name for p in pods}  # a deleting pod still holds its name: made again once it is gone
    if phase != Phase.PENDING or creating_gang:
        plan.create = [i for n, i in wanted.items() if n not in present]
    serving = [p for p in live if p.name in wanted and p.phase not in ENDED]
    plan.status = {"replicas": replicas, "pods": len(serving), "ready": sum(p.ready for p in serving)}
    if refusing := [p for p in pods if p.phase == PodPhase.FAILED and p.exit_code == EXIT_SANDBOX_UNAVAILABLE]:
        plan.refused = (f"sandbox pod {refusing[0].name} refused to run the job's user code without every layer of "
                        f"the sandbox: {refusing[0].message or 'its node lacks some'}")
    return plan
