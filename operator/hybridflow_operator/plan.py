"""What a tick decides (`Plan`) and what it decides from (`PodView`, `Queue`), with the status edits every phase
shares: entering a phase, a condition, failing the job. Pure: nothing here performs I/O."""
from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, cast

from hybridflow.api import RLHFJob
from hybridflow.api.scaling import sized
from hybridflow.api.status import Condition, JobStatus, Phase
from hybridflow_operator.kueue import Admission

# A status message (the phase's, each condition's) is cut to this many characters: they quote what users wrote (a
# spec error names the field, a pod's termination message its log), and a job's status must stay far under etcd's
# object limit; three copies of one 200 KB key used to fail every status write.
MAX_MESSAGE = 1024


class PodPhase(StrEnum):
    """A pod's phase, in the kubelet's words (not a job's `Phase`: pods have Unknown, and no Suspended)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


@dataclass(frozen=True)
class PodView:
    name: str
    role: str  # head | worker
    generation: int
    phase: str  # a PodPhase, as the API server wrote it
    deleting: bool = False
    message: str = ""
    exit_code: int | None = None  # of the container that failed
    waiting: str = ""  # why a pending pod does not start: "ImagePullBackOff: ...", "Unschedulable: ...", ...
    disruption: str = ""  # the reason of its DisruptionTarget condition: evicted, preempted, drained
    deletion_deadline: dt.datetime | None = None  # its deletionTimestamp: the end of its grace period
    pending_since: dt.datetime | None = None  # creation time, while Pending
    pool: str = ""  # a worker's resource pool (its pool label); "" for the head
    index: int = -1  # a worker's index in its pool (its index label); -1 for the head
    ready: bool = False  # its Ready condition is True
    output: str = ""  # the termination message of its container that exited 0 (a plan pod's plan)
    token_uid: str = ""  # a sandbox pod's sandbox token Secret uid (environments.TOKEN_UID_ANNOTATION)


@dataclass
class Plan:
    status: JobStatus
    create_static: bool = False
    create_gang: int | None = None  # generation whose missing pods to create
    create_plan_pod: bool = False  # a `placement: auto` job's plan pod, before its first gang (plan_pod.py)
    delete_pods: list[str] = field(default_factory=list)
    delete_job: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    # Filled by the whole decision (phases.decide with an Observed), for the handler to carry out:
    create_sandbox: list[int] = field(default_factory=list)  # sandbox pool replicas to make (environments.plan_pool)
    copy_code: dict[str, str] | None = None  # the code files to copy into the job's own ConfigMap (Inputs.files)
    workload_spec: dict[str, Any] | None = None  # the Workload's spec.active patch (kueue.active_update)
    # The decision stopped short: it creates pods, and the inputs (Observed.inputs) are to be looked up first.
    needs_inputs: bool = False


def iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> dt.datetime | None:
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc) if s else None


def capped(message: str) -> str:
    """The message as status holds it: at most MAX_MESSAGE characters, an ellipsis marking a cut."""
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 1] + "\u2026"


def set_condition(status: JobStatus, ctype: str, value: bool, reason: str, message: str, now: dt.datetime) -> None:
    """metav1.Condition semantics: lastTransitionTime moves only when the status flips."""
    message = capped(message)
    conds = [cast(Condition, dict(c)) for c in status.get("conditions", [])]
    new = "True" if value else "False"
    for c in conds:
        if c["type"] == ctype:
            if c["status"] != new:
                c["lastTransitionTime"] = iso(now)
            c.update(status=new, reason=reason, message=message)
            break
    else:
        conds.append({"type": ctype, "status": new, "reason": reason, "message": message,
                      "lastTransitionTime": iso(now)})
    status["conditions"] = conds


def expected_pods(job: RLHFJob) -> int:
    """The head and every pool pod, an elastic rollout pool at its size now."""
    return 1 + sum(p.nodes for p in sized(job).spec.resource_pools)


@dataclass(frozen=True)
class Queue:
    """A job queued through Kueue (labelled kueue.x-k8s.io/queue-name): its LocalQueue, and its Workload as last
    seen (None: not created, or gone)."""
    name: str
    workload: Admission | None


def enter(plan: Plan, phase: Phase, reason: str, message: str, now: dt.datetime, event_type: str = "Normal") -> None:
    message = capped(message)
    if phase != Phase.RUNNING:
        plan.status.pop("startupTime", None)  # a gang's start-up clock runs only while it is Running (gang.stalled)
    plan.status["phase"] = phase
    plan.status["reason"] = reason
    plan.status["message"] = message
    plan.events.append((event_type, reason, message))


def fail(plan: Plan, reason: str, message: str, now: dt.datetime, pods: list[PodView]) -> None:
    """The job Failed for `reason`: its pods but the head go (the head stays for its logs)."""
    enter(plan, Phase.FAILED, reason, message, now, "Warning")
    set_condition(plan.status, "Failed", True, reason, message, now)
    set_condition(plan.status, "Running", False, reason, message, now)
    plan.status["completionTime"] = iso(now)
    plan.delete_pods = [p.name for p in pods if not p.deleting and p.role != "head"]


def invalid(status: JobStatus, error: str, now: dt.datetime, pods: list[PodView]) -> Plan:
    """The plan for a job that cannot run as it is (its spec, the cluster's job policy, a child that is not its
    own): Failed, naming why; a job already Failed stays as it is."""
    plan = Plan(status=cast(JobStatus, dict(status)))
    plan.status.setdefault("restarts", 0)
    if plan.status.get("phase", Phase.NEW) != Phase.FAILED:
        fail(plan, "ValidationFailed", error, now, pods)
    return plan


def refused(status: JobStatus, what: str, code: int, api_message: str, now: dt.datetime,
            pods: list[PodView]) -> Plan:
    """The API server refused to create a child. 422 (invalid) cannot succeed on retry, nor 404 (a kind the cluster
    lacks: Volcano's PodGroup without Volcano): the job fails with the API's words. 403 (an admission policy, a
    quota) may pass later: the job stays as it is, with a condition and an event that say why, and the next tick
    tries again."""
    plan = Plan(status=dict(status))
    message = capped(f"the API server refused to create {what} ({code}): {api_message}")
    if code in (404, 422):
        fail(plan, "CreateRefused", message, now, pods)
    else:
        if not any(c.get("type") == "CreateRefused" and c.get("status") == "True" and c.get("message") == message
                   for c in status.get("conditions", [])):
            plan.events.append(("Warning", "CreateRefused", message))
        set_condition(plan.status, "CreateRefused", True, "CreateRefused", message, now)
    return plan


def names_taken(status: JobStatus, namespace: str, pods: list[str], now: dt.datetime) -> Plan:
    """Pods the tick was to create whose names other pods hold (the create answered 409, and no pod of that name is
    the job's: another owner, other labels). Never adopted nor waited for in silence: the job stays as it is, with
    condition CreateRefused (reason PodNameTaken) naming them and one event per new message; like a refused create
    it is tried again later, and the condition clears once every pod of the gang exists."""
    plan = Plan(status=dict(status))
    one = len(pods) == 1
    message = capped(f"{'pod' if one else 'pods'} {', '.join(f'{namespace}/{p}' for p in pods)} "
                     f"{'exists' if one else 'exist'} but {'was' if one else 'were'} not made for this job (another "
                     f"owner, other labels), so the job's {'pod' if one else 'pods'} of that name cannot be created; "
                     f"delete {'it' if one else 'them'}, or give the job another name")
    if not any(c.get("type") == "CreateRefused" and c.get("status") == "True" and c.get("message") == message
               for c in status.get("conditions", [])):
        plan.events.append(("Warning", "PodNameTaken", message))
    set_condition(plan.status, "CreateRefused", True, "PodNameTaken", message, now)
    return plan


@dataclass(frozen=True)
class Inputs:
    """What a gang start needs from outside the job, looked up (API reads) only when the plan creates pods."""
    missing: str  # what its pods would mount but is absent or unmarked for jobs; "" when all is there
    files: dict[str, str] | None = None  # the code files' texts by key, found and not copied yet


@dataclass(frozen=True)
class Observed:
    """Everything a tick decides from, read before deciding: the decision itself reads nothing (phases.decide).
    Only `inputs` is read on demand: the API reads it costs are made only when a first decision creates pods."""
    status: JobStatus  # the job's status as this operator last wrote it
    now: dt.datetime
    pods: Sequence[PodView] = ()  # the gang's pods the job controls (not its sandbox pool's nor its plan pod)
    error: str | None = None  # why the job's spec cannot run (a SpecError), or None
    disrupted: Mapping[str, str] = field(default_factory=dict)  # current generation's pods evicted: name -> reason
    queue: Queue | None = None  # its Kueue queue and Workload, when it is queued
    rollout_asked: int | None = None  # an elastic rollout pool's size asked for, when Kueue admitted fewer pods
    inputs: Inputs | None = None  # None: not looked up (yet)
    broken: Sequence[str] = ()  # the ways the spec breaks the cluster's job policy (policy.violations)
    changed: bool = False  # the live spec differs from the accepted one in more than runPolicy
    plan_pod: PodView | None = None  # a `placement: auto` job's plan pod, as seen
    pool_pods: Sequence[PodView] = ()  # its sandbox pool's pods


@dataclass(frozen=True)
class CreateFailure:
    """Why creating the plan's children failed: "names" (pods of other owners under the names of the job's:
    `detail` lists them), "invalid" (a child that exists but is not the job's: `detail` says which), or "refused"
    (the API server refused `what` with HTTP `code`: `detail` is its message)."""
    kind: str
    detail: str | list[str]
    what: str = ""
    code: int = 0


def failed_create(planned: Plan, failure: CreateFailure, namespace: str, observed: Observed) -> Plan:
    """The plan once creating the planned children failed: the planned events stay (they were decided), then what
    the failure makes of the job (`names_taken`, `invalid`, `refused`), with the pods the planned plan deleted."""
    now, pods = observed.now, list(observed.pods)
    if failure.kind == "names":
        plan = names_taken(planned.status, namespace, list(failure.detail), now)
        plan.delete_pods = list(planned.delete_pods)
    elif failure.kind == "invalid":
        plan = invalid(planned.status, str(failure.detail), now, pods)
    else:
        plan = refused(planned.status, failure.what, failure.code, str(failure.detail), now, pods)
        plan.delete_pods = sorted(set(plan.delete_pods) | set(planned.delete_pods))
    plan.events[:0] = planned.events
    plan.workload_spec = planned.workload_spec  # what Kueue is owed is written all the same
    return plan
