"""The spec's runPolicy: how the operator runs, restarts, replaces, queues and ends a job on Kubernetes (`hybridflow
run` reads only what applies to one machine: the in-place recoveries of restartPolicy failedPod and the collective
timeout). With an elastic rollout pool's size and bounds, the only part of a live job's spec that may change
(operator accept.spec_fields), so the operator reads each field afresh at every tick; the job's own timeouts derived
from it (`collective_timeout`, `startup_call_timeout`) keep the values it was accepted with.

Also the recovery facts both sides share, so the operator and the controller never disagree: when a job counts as
Stalled (`progress_deadline`, `startup_deadline`), how long a collective waits (`collective_timeout`) and the
controller for a worker's answer while the gang starts (`startup_call_timeout`)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.api.fields import MAX_BACKOFF, ObjectName, SpecModel

STALL_FLOOR_SECONDS = 900  # the default progress deadline's floor, and the start-up deadline's
STALL_STEP_FACTOR = 10  # the default deadline: this many times the slowest step seen


class RunPolicy(SpecModel):
    """How the operator runs the job on Kubernetes; `hybridflow run` reads restartPolicy, replacementLimit and the
    collective timeout (a lost worker process is recovered in place there too)."""

    backoff_limit: int = Field(3, ge=0, le=MAX_BACKOFF, description="Gang restarts allowed before the job is Failed "
                               "(each restart is a new pod generation, g<n> in the pod names).")
    restart_policy: Literal["failedPod", "gang"] = Field(
        "failedPod", description="failedPod: a failed or lost pool pod is replaced alone while the head and the "
        "healthy pods keep running, and the controller rebuilds its worker groups from the last checkpoint (an "
        "async job's rollout pod: only its replica, while training goes on); gang: "
        "every failure restarts the whole gang. A failed head, a failed in-place recovery and a stalled job restart "
        "the gang either way.")
    replacement_limit: int = Field(3, ge=0, le=MAX_BACKOFF, description="restartPolicy failedPod: pods replaced alone "
                                   "(and in-place recoveries of the controller) before the next failure restarts the "
                                   "gang instead; evictions and preemptions are not counted.")
    progress_deadline_seconds: int | None = Field(
        None, gt=0, le=2**31 - 1, description="A running job that completes no step for this long after its last one "
        f"is Stalled: its gang restarts (counted against backoffLimit). Default: {STALL_STEP_FACTOR} times its slowest "
        f"step so far, at least {STALL_FLOOR_SECONDS} s. A gang's start-up, until its first step, has "
        "startupDeadlineSeconds instead. Collectives inside the job time out after it too, naming the rank that did "
        "not answer.")
    startup_deadline_seconds: int | None = Field(
        None, gt=0, le=2**31 - 1, description="A gang (the first, or one restarted) that has not completed its first "
        "step this long after all its pods ran (or after its driver reported the step it starts from, once its model "
        "is loaded) is Stalled: its start-up (Ray, the workers, loading the model or the checkpoint, the engines) "
        "and first step are judged apart from the steps after, as a pod's startupProbe is apart from its "
        f"livenessProbe. Default: the progress deadline, at least {STALL_FLOOR_SECONDS} s.")
    active_deadline_seconds: int | None = Field(None, gt=0, le=2**31 - 1, description="Fail the job after this many "
                                                "seconds.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, le=2**31 - 1, description="Delete the finished job (and its pods) this many seconds after it ends."
    )
    suspend: bool = Field(False, description="Delete the pods but keep the job; false again resumes from the checkpoint.")
    scheduler_name: ObjectName | None = Field(None, description="Pod schedulerName (e.g. volcano).")
    gang_scheduling: bool = Field(False, description="Create a Volcano PodGroup with minMember = all pods.")
    priority_class_name: ObjectName | None = Field(None, description="Pod priorityClassName.")


def progress_deadline(policy: RunPolicy, slowest_step_seconds: float | None) -> float:
    """Seconds without a completed step, after the gang's first, after which a running job is Stalled:
    runPolicy.progressDeadlineSeconds, else STALL_STEP_FACTOR times its slowest step so far, never under
    STALL_FLOOR_SECONDS."""
    if policy.progress_deadline_seconds is not None:
        return float(policy.progress_deadline_seconds)
    return max(float(STALL_FLOOR_SECONDS), STALL_STEP_FACTOR * (slowest_step_seconds or 0.0))


def startup_deadline(policy: RunPolicy, slowest_step_seconds: float | None) -> float:
    """Seconds without a completed step, before the gang's first, after which it is Stalled:
    runPolicy.startupDeadlineSeconds, else the progress deadline, never under STALL_FLOOR_SECONDS. Apart from the
    progress deadline because a short one, set to catch a hung step, would judge a restarted gang's start-up too
    (a large checkpoint's load, the engines' start) and restart it again and again until backoffLimit failed the
    job."""
    if policy.startup_deadline_seconds is not None:
        return float(policy.startup_deadline_seconds)
    return max(float(STALL_FLOOR_SECONDS), progress_deadline(policy, slowest_step_seconds))


COLLECTIVE_TIMEOUT_SECONDS = 1800  # torch.distributed's own default for gloo and NCCL


def collective_timeout(policy: RunPolicy) -> float:
    """How long a collective (an all-reduce, a weight sync) inside the job, and the controller's wait for a worker's
    answer once the gang has started (before: `startup_call_timeout`), last before they fail naming the rank that did
    not answer: the progress deadline when one is set (no single call may outlast it), else torch's default of 30
    minutes (a stage of a large model may take long)."""
    return float(policy.progress_deadline_seconds or COLLECTIVE_TIMEOUT_SECONDS)


def startup_call_timeout(policy: RunPolicy) -> float:
    """How long the controller waits for a worker's answer while the gang starts, until its first completed step
    (loading the checkpoint, the engines, the held-out evaluation before, the first step): the larger of the
    collective timeout and the start-up deadline, so that a start-up the operator allows (`startup_deadline`) is not
    cut short inside the job by a progress deadline set to catch hung steps. Collectives keep `collective_timeout`:
    the ranks of a load or a step wait on each other for no longer than a step may take."""
    return max(collective_timeout(policy), startup_deadline(policy, None))
