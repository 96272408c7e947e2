"""The RLHFJob state machine: one pure function from (spec, status, observed pods, now) to a plan.

    NEW -> Pending -> Initializing -> Running -> Succeeded
                  \\________________________/ -> Restarting -> Pending ...  (a pod failed, restarts < backoffLimit;
                                                                             Stalled: no step within the deadline)
                                              -> Failed                     (backoff exhausted, deadline, invalid spec)
    any active phase -> Suspending -> Suspended -> Pending                  (runPolicy.suspend true, then false)
    NEW -> Queued -> Pending ...; any active phase -> Suspending -> Queued  (Kueue: a Workload not admitted yet,
                                                                             or evicted; admitted again: resumed)
    Initializing/Running -> (same phase)                                    (restartPolicy failedPod: a failed pool
                                                                             pod replaced alone, the head kept)

The handler reads the world, calls `decide` once per tick, holds a plan that creates pods to what it looks up only
then (`admit_gang`: missing inputs, the cluster's job policy), and carries the plan out; nothing here performs I/O,
so every transition is tested directly. Phases are `hybridflow.api.status.Phase` members (each is its string).
Status is never rebuilt from scratch: restarts, conditions and progress carry over.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, cast

from hybridflow.api import EXIT_BAD_INPUT, RLHFJob
from hybridflow.api.run_policy import progress_deadline
from hybridflow.api.scaling import replicas_now, sized
from hybridflow.api.status import ACTIVE, TERMINAL, Condition, JobStatus, Phase, pool_status
from hybridflow_operator.kueue import Admission, held
from hybridflow_operator.manifests import selector

# A pod still Pending this long with no reason of its own is reported (not failed: a queue may be long).
PENDING_TOO_LONG_SECONDS = 600
# A pod still terminating this long past its grace period (a lost node) no longer holds a gang restart back. Long:
# on a partitioned (not dead) node the old driver may still be writing checkpoints; only a lost node ends so.
STUCK_TERMINATING_SECONDS = 300
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


def decide(job: RLHFJob | None, error: str | None, status: JobStatus, pods: list[PodView],
           now: dt.datetime, missing_inputs: str | None = None, disrupted: dict[str, str] | None = None,
           queue: Queue | None = None, rollout_asked: int | None = None) -> Plan:
    """The tick's plan, decided once. missing_inputs: None when the job's inputs were not checked; "" when they were
    and all exist; else what the operator found absent (see `admit_gang`). disrupted: pods of the current generation
    seen with a DisruptionTarget condition (name -> reason), also those already gone. queue: the job's Kueue
    queue and Workload, when it is queued: no pod while Kueue has not admitted it (or has evicted it).
    rollout_asked: an elastic rollout pool's size asked for, when the job (sized by kueue.within_admission to what
    Kueue admitted) runs a smaller one: condition RolloutCapped says so.

    The handler calls this without missing_inputs, and only when the plan creates pods looks the inputs up (API
    reads) and folds them in with `admit_gang`: the same plan as deciding with them, without deciding twice."""
    plan = _decide(job, error, status, pods, now, disrupted or {}, queue, rollout_asked)
    if job is None:
        return plan
    _observe_pools(plan.status, job, pods)
    return admit_gang(plan, status, pods, now, missing_inputs)


def _observe_pools(status: JobStatus, job: RLHFJob, pods: list[PodView]) -> None:
    """status.pools from the pool pods of the generation the plan leaves current (after a gang restart: the new
    one's, none yet), so a rollout pool of its own shows as up or not beside the trainer's."""
    gen = int(status.get("restarts", 0))
    status["pools"] = pool_status(job.spec, [(p.pool, p.ready) for p in pods
                                             if p.role == "worker" and p.generation == gen and not p.deleting])


def admit_gang(plan: Plan, status: JobStatus, pods: list[PodView], now: dt.datetime, missing_inputs: str | None,
               broken: Sequence[str] = ()) -> Plan:
    """A plan that creates pods (`create_gang`), held to what the operator found out only then: missing_inputs
    (as for `decide`): pods are not created while something is missing, the job waits in Pending with the reason, as
    a pod waits for its volumes; broken: the ways the spec breaks the cluster's job policy (policy.violations), which
    fail the job before any pod. Any other plan is returned as it is. `status` is the tick's status, as decided on."""
    if plan.status.get("phase") in TERMINAL or plan.create_gang is None:
        return plan
    if missing_inputs is not None:
        _hold_for_inputs(plan, status, capped(missing_inputs) if missing_inputs else missing_inputs, now)
    if plan.create_gang is not None and broken:
        # Judged on the spec the pods would be built from, at every gang start: runPolicy may change on a live job
        # (a priority class patched in later is refused at the next restart or resume, not granted).
        return invalid(status, "the spec breaks this cluster's job policy: " + "; ".join(broken), now, pods)
    return plan


def _hold_for_inputs(plan: Plan, status: JobStatus, missing_inputs: str, now: dt.datetime) -> None:
    """missing_inputs is compared with the InputsReady condition's message, so it comes capped like it."""
    had = next((c for c in status.get("conditions", []) if c["type"] == "InputsReady"), None)
    if missing_inputs:
        plan.create_gang = None
        plan.events = [e for e in plan.events if e[0] != "Normal"]  # no "creating the pods" when none are created
        plan.status.update(phase=Phase.PENDING, reason="InputsMissing", message=missing_inputs)
        if not had or had["status"] != "False" or had["message"] != missing_inputs:
            plan.events.append(("Warning", "InputsMissing", missing_inputs))
        set_condition(plan.status, "InputsReady", False, "InputsMissing", missing_inputs, now)
    elif had and had["status"] == "False":
        found = "the job's volumes and reward file exist; creating the pods"
        _to(plan, Phase.PENDING, "InputsFound", found, now)
        set_condition(plan.status, "InputsReady", True, "InputsFound", found, now)


def invalid(status: JobStatus, error: str, now: dt.datetime, pods: list[PodView]) -> Plan:
    """The plan for a job that cannot run as it is (its spec, the cluster's job policy, a child that is not its
    own): Failed, naming why; a job already Failed stays as it is."""
    plan = Plan(status=cast(JobStatus, dict(status)))
    plan.status.setdefault("restarts", 0)
    if plan.status.get("phase", Phase.NEW) != Phase.FAILED:
        fail(plan, "ValidationFailed", error, now, pods)
    return plan


def _decide(job: RLHFJob | None, error: str | None, status: JobStatus, pods: list[PodView],
            now: dt.datetime, disrupted: dict[str, str], queue: Queue | None, rollout_asked: int | None) -> Plan:
    if error is not None:
        return invalid(status, error, now, pods)
    st = cast(JobStatus, dict(status))
    st.setdefault("restarts", 0)
    plan = Plan(status=st)
    phase = st.get("phase", Phase.NEW)
    assert job is not None
    policy = job.spec.run_policy
    gen = int(st["restarts"])
    st["totalSteps"] = job.spec.trainer.steps
    current = [p for p in pods if p.generation == gen and not p.deleting]
    stale = [p for p in pods if p.generation != gen and not p.deleting]

    if phase in TERMINAL:
        _finished(plan, job, current, now)
        return plan
    if policy.suspend and phase not in (Phase.SUSPENDING, Phase.SUSPENDED):
        _to(plan, Phase.SUSPENDING, "SuspendRequested", "runPolicy.suspend is true: deleting pods, keeping status",
            now)
        set_condition(st, "Suspended", False, "Suspending", "deleting the job's pods", now)
        plan.delete_pods = [p.name for p in pods if not p.deleting]
        # A job created suspended is accepted now all the same (its spec ConfigMap and digest): a spec edited while
        # it waits (a Secret or ConfigMap added) is then a change to ignore, never what its first pods are made of.
        plan.create_static = phase == Phase.NEW
        return plan
    waits = held(queue.workload, queue.name) if queue is not None else None
    if phase == Phase.SUSPENDING:
        plan.delete_pods = [p.name for p in pods if not p.deleting]
        if not pods and (policy.suspend or queue is None):
            _to(plan, Phase.SUSPENDED, "Suspended", "all pods deleted; set runPolicy.suspend false to resume", now)
            set_condition(st, "Suspended", True, "Suspended", "job suspended", now)
        elif not pods:  # suspended for Kueue (evicted): queued again, until admitted again
            _queued(plan, waits or "Kueue admitted it again", now, evicted=st.get("reason") == "Evicted")
        return plan
    if phase in (Phase.SUSPENDED, Phase.QUEUED):
        if policy.suspend:
            return plan
        if waits is not None:
            _queued(plan, waits, now, evicted=phase == Phase.QUEUED and st.get("reason") == "Evicted")
            return plan
        if phase == Phase.SUSPENDED:
            set_condition(st, "Suspended", False, "Resumed", "resuming from the last checkpoint", now)
        st.pop("startTime", None)  # the deadline counts from the resume, as for Kubernetes Jobs
        if queue is not None:
            return _admitted(plan, job, gen, queue, now)
        return _start(plan, job, gen, now, "Resumed", "resuming from the last checkpoint")

    deadline = policy.active_deadline_seconds
    started = parse_time(st.get("startTime"))
    if deadline and started and (now - started).total_seconds() > deadline and phase in (*ACTIVE, Phase.RESTARTING):
        fail(plan, "DeadlineExceeded", f"ran longer than runPolicy.activeDeadlineSeconds={deadline}", now, pods)
        return plan

    if phase == Phase.NEW and waits is not None:
        plan.create_static = True  # accepted now (its spec ConfigMap), and its Workload made, as for a suspended job
        _queued(plan, waits, now)
        return plan
    if phase == Phase.NEW and queue is not None:
        plan = _admitted(plan, job, gen, queue, now)
        return plan
    if phase == Phase.NEW:
        return _start(plan, job, gen, now, "Created", "creating the head, pool pods and Ray cluster", static=True)
    if waits is not None and phase in (*ACTIVE, Phase.RESTARTING):  # Kueue evicted it (or lost its Workload)
        _to(plan, Phase.SUSPENDING, "Evicted", f"{waits}: deleting the pods; the job resumes from its last "
            "checkpoint once Kueue admits it again", now, "Warning")
        set_condition(st, "Running", False, "Evicted", waits, now)
        set_condition(st, "Admitted", False, "Evicted", waits, now)
        plan.delete_pods = [p.name for p in pods if not p.deleting]
        return plan
    if phase == Phase.RESTARTING:
        plan.delete_pods = [p.name for p in stale]
        stuck = [p for p in pods if p.generation != gen and _stuck_terminating(p, now)]
        if not stale and not [p for p in pods if p.generation != gen and p not in stuck]:
            if stuck:
                plan.events.append(("Warning", "PodStuckTerminating",
                                    f"{', '.join(p.name for p in stuck)} still terminating "
                                    f"{STUCK_TERMINATING_SECONDS}s past its grace period (a lost node?); not waiting"))
            return _start(plan, job, gen, now, "GangRestarted", f"gang generation {gen} created; the controller "
                          "resumes from the last checkpoint")
        return plan

    # Pending / Initializing / Running
    plan.delete_pods = [p.name for p in stale]  # leftovers of an older generation (e.g. after operator restart)
    head = next((p for p in current if p.role == "head"), None)
    if head is not None and head.phase == PodPhase.SUCCEEDED:
        _to(plan, Phase.SUCCEEDED, "Completed", "the controller finished every step", now)
        set_condition(st, "Succeeded", True, "Completed", "the controller finished every step", now)
        set_condition(st, "Running", False, "Completed", "job finished", now)
        st["completionTime"] = iso(now)
        if st.get("totalSteps"):  # the driver exits 0 only after its last step, which polling may have missed
            st["step"] = st["totalSteps"]
        plan.delete_pods += [p.name for p in current if p.role != "head"]
        return plan
    current, coming = _rescale(plan, job, current, now, rollout_asked)
    failed = [p for p in current if p.phase in (PodPhase.FAILED, PodPhase.UNKNOWN)]
    if head is not None and head in failed and head.exit_code == EXIT_BAD_INPUT:
        fail(plan, "InvalidInput", f"the driver rejected the job's input (not retried): {head.message}", now, pods)
        return plan
    missing = expected_pods(job) - len(current) - coming
    _replaced_pods_back(st, current)
    if _replaces_alone(job, phase, head, failed, missing, st, disrupted):
        return _replace(plan, job, current, failed, missing, now, disrupted)
    if failed or (missing and phase in (Phase.INITIALIZING, Phase.RUNNING)):
        what = (f"pod {failed[0].name} {failed[0].phase.lower()}" + (f": {failed[0].message}" if failed[0].message else "")
                if failed else f"{missing} pod(s) disappeared")
        evicted = {**{p.name: p.disruption for p in pods if p.generation == gen and p.disruption}, **disrupted}
        if evicted:  # evicted by a drain, preempted: not the job's fault
            pod, why = sorted(evicted.items())[0]
            what = f"pod {pod} was disrupted ({why})"
        return _restart(plan, job, gen, what, now, pods, counts=not evicted)
    if missing:
        plan.create_gang = gen
        plan.create_static = True
        return plan
    _report_pods_not_starting(plan, current, now)
    if phase == Phase.RUNNING and (stalled := _stalled(job, st, now)):
        return _restart(plan, job, gen, stalled, now, pods, reason="Stalled")
    if all(p.phase == PodPhase.RUNNING for p in current):
        if phase != Phase.RUNNING:
            _to(plan, Phase.RUNNING, "AllPodsRunning", f"{len(current)} pods running; training", now)
            set_condition(st, "Running", True, "AllPodsRunning", "the Ray cluster formed and the controller runs", now)
            st["lastProgressTime"] = iso(now)  # the progress deadline counts from here until the first step
    elif any(p.phase != PodPhase.PENDING for p in current) and phase == Phase.PENDING:
        _to(plan, Phase.INITIALIZING, "PodsStarting", "pods scheduled; waiting for the Ray cluster", now)
    return plan


class Rest(NamedTuple):
    """Why a job has nothing to do, and how long it may rest without any change to its spec or its pods."""
    why: str  # suspended | queued | finished | ttl | inputs | refused
    at_most: float | None  # seconds; None: until a change
    retry: bool = False  # what it waits for is outside the job (a PVC made, a quota raised): look again with a backoff


def resting(job: RLHFJob | None, status: JobStatus, now: dt.datetime) -> Rest | None:
    """Whether a job, in this status, has nothing to do until its spec or its pods change, or None when it is active
    (Pending with its pods on their way, Initializing, Running, Restarting, Suspending: every tick counts).

    - "suspended": runPolicy.suspend, every pod gone; only unsuspending (a spec change) moves it.
    - "queued": its Kueue Workload is not admitted; a change of the Workload (the caller follows it) or of the job
      moves it.
    - "finished" / "ttl": Succeeded or Failed; its TTL (runPolicy.ttlSecondsAfterFinished) is all that is left, so
      it rests until then, or for good without one.
    - "inputs" / "refused": Pending while a PVC or the reward file is missing (InputsReady False), or while the API
      server refuses its pods (CreateRefused True: a quota, an admission policy). Nothing of the job's own tells when
      that ends: the caller looks again with a backoff, never past runPolicy.activeDeadlineSeconds."""
    phase, conds = status.get("phase"), status.get("conditions", [])
    if phase in TERMINAL:
        ttl = job.spec.run_policy.ttl_seconds_after_finished if job is not None else None
        done = parse_time(status.get("completionTime"))
        if ttl is None or done is None:
            return Rest("finished", None)
        return Rest("ttl", max(0.0, ttl - (now - done).total_seconds()))
    if job is None:
        return None
    if phase == Phase.SUSPENDED:
        return Rest("suspended", None) if job.spec.run_policy.suspend else None
    if phase == Phase.QUEUED:  # until its Workload changes (Kueue admits it), or the job does
        return Rest("queued", None)
    if phase != Phase.PENDING:
        return None
    why = ("inputs" if any(c["type"] == "InputsReady" and c["status"] == "False" for c in conds) else
           "refused" if any(c["type"] == "CreateRefused" and c["status"] == "True" for c in conds) else None)
    if why is None:
        return None
    deadline, started = job.spec.run_policy.active_deadline_seconds, parse_time(status.get("startTime"))
    left = max(0.0, deadline - (now - started).total_seconds()) if deadline and started else None
    return Rest(why, left, retry=True)


def backoff(tries: int, first: float, most: float) -> float:
    """Seconds before the next look at a job waiting for something outside it: first, doubling each try, at most
    `most`."""
    return min(most, first * 2 ** min(tries, 32))


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


def _to(plan: Plan, phase: Phase, reason: str, message: str, now: dt.datetime, event_type: str = "Normal") -> None:
    message = capped(message)
    plan.status["phase"] = phase
    plan.status["reason"] = reason
    plan.status["message"] = message
    plan.events.append((event_type, reason, message))


def _start(plan: Plan, job: RLHFJob, gen: int, now: dt.datetime, reason: str, message: str,
           static: bool = False) -> Plan:
    _to(plan, Phase.PENDING, reason, message, now)
    plan.status.setdefault("startTime", iso(now))
    set_condition(plan.status, "Created", True, reason, message, now)
    plan.create_static = True
    plan.create_gang = gen
    return plan


def _restart(plan: Plan, job: RLHFJob, gen: int, what: str, now: dt.datetime, pods: list[PodView],
             counts: bool = True, reason: str = "GangRestart") -> Plan:
    """A new gang generation. `restarts` counts generations; a disruption (eviction, preemption) restarts the gang
    without using up runPolicy.backoffLimit, as a Job's podFailurePolicy Ignore does. `reason`: GangRestart, or
    Stalled for a job that completed no step within its progress deadline."""
    limit = job.spec.run_policy.backoff_limit
    disruptions = int(plan.status.get("disruptions", 0)) + (0 if counts else 1)
    used = gen - int(plan.status.get("disruptions", 0))
    if counts and used + 1 > limit:
        fail(plan, "BackoffLimitExceeded", f"{what}; {used} restart(s) used of runPolicy.backoffLimit={limit}", now,
              pods)
        return plan
    plan.status["restarts"] = gen + 1
    if disruptions:
        plan.status["disruptions"] = disruptions
    count = f"({used + 1}/{limit})" if counts else "(a disruption: not counted against runPolicy.backoffLimit)"
    _to(plan, Phase.RESTARTING, reason, f"{what}; restarting the whole gang {count}", now, "Warning")
    set_condition(plan.status, "Running", False, reason, what, now)
    plan.status.pop("replacing", None)  # a new generation makes every pod afresh
    plan.delete_pods = [p.name for p in pods if not p.deleting]
    return plan


def _rescale(plan: Plan, job: RLHFJob, current: list[PodView], now: dt.datetime,
             asked: int | None = None) -> tuple[list[PodView], int]:
    """An elastic rollout pool's size changed (spec.rolloutPool.replicas, read live): the pods past the new size
    are deleted (their preStop hands their replicas' work back to the controller first) and the new ones created,
    while the head and every other pod keep running; neither is a failure, nor counted. `asked`: the size asked
    for when Kueue admitted fewer pods (the job's size is then the count admitted: condition RolloutCapped). Returns
    the pods that stay current, and how many of those being added are not seen yet (not missing: on their way)."""
    want = replicas_now(job.spec)
    if want is None:
        return current, 0
    st, pool = plan.status, job.spec.pool("rollout").name
    _note_cap(plan, pool, want, asked, now)
    st["rolloutSelector"] = selector(job.metadata.name, pool=pool)  # the scale subresource's
    have = int(st.get("rolloutReplicas", want))
    last = st.get("lastRolloutScale") or {}
    if want != last.get("to", have):
        mends = ("the new pods' replicas take the current weights before they take work" if want > have else
                 "the replicas leaving finish the generation they are in first; the rest go on")
        message = (f"rollout pool {pool}: {have} -> {want} pods (spec.rolloutPool.replicas); the head and the other "
                   f"pods keep running, {mends}")
        plan.events.append(("Normal", "RolloutScaled", message))
        st["lastRolloutScale"] = {"from": have, "to": want, "time": iso(now), "message": message}
    ours = [p for p in current if p.role == "worker" and p.pool == pool]
    surplus = [p for p in ours if p.index >= want]
    plan.delete_pods += [p.name for p in surplus if p.name not in plan.delete_pods]
    there = {p.index for p in ours}
    coming = [i for i in range(have, want) if i not in there]
    if coming:
        plan.create_gang = int(st.get("restarts", 0))  # made by name, as missing pods are
    st["rolloutReplicas"] = want if not coming else have
    return [p for p in current if p not in surplus], len(coming)


def _note_cap(plan: Plan, pool: str, size: int, asked: int | None, now: dt.datetime) -> None:
    """Condition RolloutCapped: the rollout pool runs `size` pods, the count Kueue admitted, not the `asked` size."""
    had = next((c for c in plan.status.get("conditions", []) if c["type"] == "RolloutCapped"), None)
    if asked is not None:
        message = (f"rollout pool {pool}: spec.rolloutPool.replicas = {asked}, but Kueue admitted {size} pod(s) for "
                   f"it; the pool stays at {size} until the job is admitted again with more")
        if not had or had["status"] != "True" or had["message"] != message:
            plan.events.append(("Warning", "RolloutCapped", message))
        set_condition(plan.status, "RolloutCapped", True, "KueueAdmission", message, now)
    elif had and had["status"] == "True":
        set_condition(plan.status, "RolloutCapped", False, "WithinAdmission", f"rollout pool {pool} at its size", now)


def _queued(plan: Plan, why: str, now: dt.datetime, evicted: bool = False) -> None:
    """Queued: no pods until Kueue admits the job's Workload (again, after an eviction: `evicted` keeps that the
    reason)."""
    st = plan.status
    reason = "Evicted" if evicted else "WaitingForAdmission"
    if st.get("phase") != Phase.QUEUED or st.get("message") != capped(why):
        _to(plan, Phase.QUEUED, reason, why, now)
    set_condition(st, "Admitted", False, reason, why, now)


def _admitted(plan: Plan, job: RLHFJob, gen: int, queue: Queue, now: dt.datetime) -> Plan:
    """Kueue admitted the job's Workload: its pods are made (placed on the flavors assigned), resuming from the
    last checkpoint after an eviction."""
    wl = queue.workload
    assert wl is not None
    again = any(c["type"] == "Created" for c in plan.status.get("conditions", []))  # it had pods before
    message = (f"Kueue admitted Workload {wl.name} in ClusterQueue {wl.cluster_queue or '?'}; " +
               ("resuming from the last checkpoint" if again else "creating the head, pool pods and Ray cluster"))
    set_condition(plan.status, "Admitted", True, "Admitted", message, now)
    return _start(plan, job, gen, now, "Admitted", message, static=True)


def _replaces_alone(job: RLHFJob, phase: str, head: PodView | None, failed: list[PodView], missing: int,
                    st: JobStatus, disrupted: dict[str, str]) -> bool:
    """Whether this tick's lost pool pods are replaced alone (runPolicy.restartPolicy failedPod): the head runs (it
    holds the Ray head and the controller, which rebuilds its worker groups), only pool pods failed or went, and
    the replacements stay within runPolicy.replacementLimit; anything else restarts the gang."""
    if job.spec.run_policy.restart_policy != "failedPod" or phase not in (Phase.INITIALIZING, Phase.RUNNING):
        return False
    if head is None or head.phase != PodPhase.RUNNING or any(p.role != "worker" for p in failed):
        return False
    if not failed and not missing:
        return False
    return int(st.get("podReplacements", 0)) + _counted(failed, missing, st, disrupted) <= \
        job.spec.run_policy.replacement_limit


def _counted(failed: list[PodView], missing: int, st: JobStatus, disrupted: dict[str, str]) -> int:
    """The replacements this tick counts: failed pods that were not evicted or preempted, and pods gone that this
    operator did not delete."""
    gone = missing - len(_being_replaced(st))
    return sum(1 for p in failed if not (p.disruption or disrupted.get(p.name))) + max(gone, 0)


def _being_replaced(st: JobStatus) -> list[str]:
    """Pods this operator deleted to replace them, not yet seen again."""
    return list(st.get("replacing", []))


def _replace(plan: Plan, job: RLHFJob, current: list[PodView], failed: list[PodView], missing: int,
             now: dt.datetime, disrupted: dict[str, str]) -> Plan:
    """Delete the failed pool pods and create them again under the same names (the next ticks, once the old ones
    are gone: `create_gang` makes the current generation's missing pods), while the head and the healthy pods keep
    running; pods that went without this operator (a lost node) are made again too. Each counts against
    runPolicy.replacementLimit, an eviction or preemption does not. The controller in the head rebuilds its worker
    groups once the new pod's Ray node joins, and resumes from the last checkpoint."""
    st = plan.status
    replacing = set(_being_replaced(st))
    gone = missing - len(replacing)
    kept = [p.name for p in current if p not in failed]
    st["podReplacements"] = int(st.get("podReplacements", 0)) + _counted(failed, missing, st, disrupted)
    for p in failed:
        why = p.disruption or disrupted.get(p.name, "")
        what = (f"pod {p.name} was disrupted ({why}; not counted against runPolicy.replacementLimit)" if why else
                f"pod {p.name} {p.phase.lower()}" + (f": {p.message}" if p.message else ""))
        _note_replacement(plan, what, kept, now, job.spec.replica_pool(p.pool))
        replacing.add(p.name)
    if gone > 0:
        _note_replacement(plan, f"{gone} pool pod(s) disappeared", kept, now)
    st["replacing"] = sorted(replacing)
    plan.delete_pods += [p.name for p in failed]
    plan.create_gang = int(st.get("restarts", 0))  # the missing ones, by name, once their old objects are gone
    return plan


def _note_replacement(plan: Plan, what: str, kept: list[str], now: dt.datetime, replica: bool = False) -> None:
    mends = ("the controller rebuilds the rollout replica in it while training goes on" if replica else
             "the controller rebuilds its worker groups from the last checkpoint")
    message = capped(f"{what}; replacing it alone: the head and {len(kept)} other pod(s) keep running "
                     f"({', '.join(kept)}), {mends}")
    plan.events.append(("Warning", "PodReplaced", message))
    plan.status["lastReplacement"] = {"time": iso(now), "message": message}


def _replaced_pods_back(st: JobStatus, current: list[PodView]) -> None:
    """Forget the replacements whose new pods exist."""
    if "replacing" in st:
        names = {p.name for p in current}
        left = [n for n in st["replacing"] if n not in names]
        if left:
            st["replacing"] = left
        else:
            st.pop("replacing")


def _stalled(job: RLHFJob, st: JobStatus, now: dt.datetime) -> str | None:
    """Why a running job counts as stuck: no step completed within its progress deadline (api.run_policy), counted
    from the last step the operator saw, or from Running until the first."""
    since = parse_time(st.get("lastProgressTime"))
    if since is None:
        st["lastProgressTime"] = iso(now)  # a job running before the operator knew the field: counted from now
        return None
    deadline = progress_deadline(job.spec.run_policy, st.get("slowestStepSeconds"))
    quiet = (now - since).total_seconds()
    if quiet <= deadline:
        return None
    last = f"after step {st['step']}" if st.get("step") else "since the job started running"
    return (f"no step completed for {quiet:.0f}s {last} (progress deadline {deadline:.0f}s: "
            + ("runPolicy.progressDeadlineSeconds" if job.spec.run_policy.progress_deadline_seconds else
               "the default, from the slowest step seen") + ")")


def _stuck_terminating(p: PodView, now: dt.datetime) -> bool:
    return bool(p.deleting and p.deletion_deadline
                and (now - p.deletion_deadline).total_seconds() > STUCK_TERMINATING_SECONDS)


def _report_pods_not_starting(plan: Plan, current: list[PodView], now: dt.datetime) -> None:
    """A condition (and one event per new reason) when pods of the gang cannot start: an image that cannot be
    pulled, a bad container config, no node that fits, or Pending too long; cleared once none is stuck."""
    st = plan.status
    stuck: list[tuple[str, str]] = []  # (reason, what)
    for p in current:
        if p.phase != PodPhase.PENDING:
            continue
        if p.waiting:
            stuck.append((p.waiting.split(":")[0], f"pod {p.name}: {p.waiting}"))
        elif p.pending_since and (now - p.pending_since).total_seconds() > PENDING_TOO_LONG_SECONDS:
            stuck.append(("PendingTooLong", f"pod {p.name}: Pending for over {PENDING_TOO_LONG_SECONDS}s"))
    refused_before = next((c for c in st.get("conditions", []) if c["type"] == "CreateRefused"), None)
    if refused_before and refused_before["status"] == "True":  # every pod exists now: the API admitted them
        set_condition(st, "CreateRefused", False, "Created", "the API server admitted the job's pods", now)
    had = next((c for c in st.get("conditions", []) if c["type"] == "PodsStarting"), None)
    if stuck:
        reason, message = stuck[0][0], capped("; ".join(what for _, what in stuck))
        if not had or had["status"] != "False" or had["message"] != message:
            plan.events.append(("Warning", reason, message))
        set_condition(st, "PodsStarting", False, reason, message, now)
    elif had and had["status"] == "False":
        set_condition(st, "PodsStarting", True, "Started", "every pod of the gang has started", now)


def fail(plan: Plan, reason: str, message: str, now: dt.datetime, pods: list[PodView]) -> None:
    """The job Failed for `reason`: its pods but the head go (the head stays for its logs)."""
    _to(plan, Phase.FAILED, reason, message, now, "Warning")
    set_condition(plan.status, "Failed", True, reason, message, now)
    set_condition(plan.status, "Running", False, reason, message, now)
    plan.status["completionTime"] = iso(now)
    plan.delete_pods = [p.name for p in pods if not p.deleting and p.role != "head"]


def _finished(plan: Plan, job: RLHFJob, current: list[PodView], now: dt.datetime) -> None:
    """Terminal: worker pods go (they hold devices), the head stays for its logs until the TTL."""
    plan.delete_pods = [p.name for p in current if p.role != "head"]
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    done = parse_time(plan.status.get("completionTime"))
    if ttl is not None and done is not None and (now - done).total_seconds() >= ttl:
        plan.delete_job = True
