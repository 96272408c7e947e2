"""An RLHFJob's status as the operator writes it: the typed `Phase` and the shape of `status`.

Torch-free, like all of `hybridflow.api`: the operator writes these, the CRD describes them, dashboards and alerts
select on the phase's string (`hybridflow_operator_job_info{phase="Failed"}`). So each `Phase` member *is* its
string (a `StrEnum`): written into status, compared with what the API server returns or used as a metric label, it
is the same "Running" as before phases were typed, and no reader of the status has to know the enum exists.
"""
from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from hybridflow.api.schema import JobSpec


class Phase(StrEnum):
    """Where a job is in its life (phases.py in the operator draws the transitions between them)."""

    NEW = ""  # no phase in status yet: the operator has not started the job
    PENDING = "Pending"
    INITIALIZING = "Initializing"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDING = "Suspending"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"  # no pods: its Kueue Workload waits for admission (or was evicted and waits again)
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


# A job's pods are on their way or run: the phases a deadline counts in (with RESTARTING) and pods are watched in.
ACTIVE: tuple[Phase, ...] = (Phase.PENDING, Phase.INITIALIZING, Phase.RUNNING)
# Nothing moves a job out of these: its workers go, its head stays for its logs until runPolicy's TTL.
TERMINAL: tuple[Phase, ...] = (Phase.SUCCEEDED, Phase.FAILED)
# The phases a status can show (all but NEW): the metrics' phase labels, the CRD's description.
SHOWN: tuple[Phase, ...] = tuple(p for p in Phase if p is not Phase.NEW)


class Condition(TypedDict):
    """A metav1.Condition, as status.conditions holds it."""

    type: str
    status: str  # "True" | "False"
    reason: str
    message: str
    lastTransitionTime: str


class PoolStatus(TypedDict):
    """One resource pool as status.pools shows it: which roles the spec places on it, and how many of its pods of
    the current gang generation exist and are Ready. A rollout pool of its own (spec.placement.rollout) is a second
    entry, so `kubectl get rlhfjob -o yaml` tells a trainer pool that is up from a rollout pool still pending."""

    name: str
    roles: list[str]
    pods: int
    ready: int


def pool_status(spec: JobSpec, pods: Iterable[tuple[str, bool]]) -> list[PoolStatus]:
    """status.pools, in spec.resourcePools' order. `pods`: (pool name, Ready) of each pool pod that counts (the
    current generation's, not being deleted); a pod of a pool the spec does not have is not counted. Roles are
    the job's (JobSpec.roles) where `JobSpec.pool` puts them: spec.placement's, the first pool for the rest."""
    roles = spec.roles()
    out = {p.name: PoolStatus(name=p.name, roles=[r for r in roles if spec.pool(r).name == p.name], pods=0, ready=0)
           for p in spec.resource_pools}
    for pool, ready in pods:
        if (entry := out.get(pool)) is not None:
            entry["pods"] += 1
            entry["ready"] += int(ready)
    return list(out.values())


class JobStatus(TypedDict, total=False):
    """Every field of RLHFJob.status the operator writes (the CRD keeps unknown fields, so this is the contract
    between the operator's ticks, which read back what the last one wrote, and whoever reads the job)."""

    phase: Phase
    reason: str
    message: str
    conditions: list[Condition]
    restarts: int  # gang generations started after the first; pods carry it as their generation
    disruptions: int  # those of the restarts that evictions and preemptions caused (not counted as failures)
    # restartPolicy failedPod: pool pods replaced alone (counted against runPolicy.replacementLimit), the ones
    # deleted and not yet made again, and the last replacement's time and message
    podReplacements: int
    replacing: list[str]
    lastReplacement: dict[str, str]
    lastProgressTime: str  # when the operator last saw the step move (or the job start Running): the stall clock
    startupTime: str  # while Running, until the driver's first step: when the gang's pods all ran (its start-up)
    slowestStepSeconds: float  # the slowest step polled so far: the default progress deadline scales with it
    startTime: str
    completionTime: str
    totalSteps: int
    # progress, polled from the driver's metrics while Running (progress.WANTED)
    step: int
    tokensPerSecond: float
    etaSeconds: int
    lastCheckpointStep: int
    lastCheckpoint: str
    lastCheckpointTime: str
    recoveries: int  # the controller's in-place recoveries (its worker groups rebuilt after a lost worker)
    lastRecoverySeconds: float  # the last one's seconds from the loss to the next step logged
    pools: list[PoolStatus]  # per resource pool: its roles, pods and Ready pods (pool_status), seen at every tick
    environments: dict[str, int]  # spec.environments: {replicas, pods (serving, not ended), ready}, every tick
    # an elastic rollout pool (spec.rolloutPool): the pods it was given, its pods' selector (both for the scale
    # subresource), and its last change of size (from, to, time, message)
    rolloutReplicas: int
    rolloutSelector: str
    lastRolloutScale: dict[str, Any]
    # a job queued through Kueue: its LocalQueue (the label's value when it was accepted), and runPolicy.suspend as
    # last written into its Workload's spec.active (the operator writes it again only when runPolicy.suspend changes)
    queueName: str
    workloadActive: bool
    # digests recorded before the job's ConfigMaps are created, and the uids of the token Secrets it made
    acceptedSpecDigest: str
    rewardDigest: str  # the reward file's (kept beside codeDigests, which holds it too)
    codeDigests: dict[str, str]  # every code file copied from kubernetes.rewardConfigMap, by key
    rayTokenSecretUid: str
    sandboxTokenSecretUid: str
    # a `placement: auto` job's plan, as its plan pod printed it (hybridflow.api.plan): {"summary": {...}, "fields":
    # {...}}; recorded once, before the first gang, and laid over the accepted spec wherever the job is built
    plan: dict[str, Any]
