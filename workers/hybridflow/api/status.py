"""An RLHFJob's status as the operator writes it: the typed `Phase` and the shape of `status`.

Torch-free, like all of `hybridflow.api`: the operator writes these, the CRD describes them, dashboards and alerts
select on the phase's string (`hybridflow_operator_job_info{phase="Failed"}`). So each `Phase` member *is* its
string (a `StrEnum`): written into status, compared with what the API server returns or used as a metric label, it
is the same "Running" as before phases were typed, and no reader of the status has to know the enum exists.
"""
from __future__ import annotations

from enum import StrEnum
from typing import TypedDict


class Phase(StrEnum):
    """Where a job is in its life (phases.py in the operator draws the transitions between them)."""

    NEW = ""  # no phase in status yet: the operator has not started the job
    PENDING = "Pending"
    INITIALIZING = "Initializing"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDING = "Suspending"
    SUSPENDED = "Suspended"
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


class JobStatus(TypedDict, total=False):
    """Every field of RLHFJob.status the operator writes (the CRD keeps unknown fields, so this is the contract
    between the operator's ticks, which read back what the last one wrote, and whoever reads the job)."""

    phase: Phase
    reason: str
    message: str
    conditions: list[Condition]
    restarts: int  # gang generations started after the first; pods carry it as their generation
    disruptions: int  # those of the restarts that evictions and preemptions caused (not counted as failures)
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
    # digests recorded before the job's ConfigMaps are created, and the uid of the Ray token Secret it made
    acceptedSpecDigest: str
    rewardDigest: str
    rayTokenSecretUid: str
