"""The RLHFJob state machine: one pure function from the job and what a tick observed to the tick's whole plan.

    NEW -> Pending -> Initializing -> Running -> Succeeded
                  \\________________________/ -> Restarting -> Pending ...  (a pod failed, restarts < backoffLimit;
                                                                             Stalled: no step within the deadline)
                                              -> Failed                     (backoff exhausted, deadline, invalid spec)
    any active phase -> Suspending -> Suspended -> Pending                  (runPolicy.suspend true, then false)
    NEW -> Queued -> Pending ...; any active phase -> Suspending -> Queued  (Kueue: a Workload not admitted yet,
                                                                             or evicted; admitted again: resumed)
    Initializing/Running -> (same phase)                                    (restartPolicy failedPod: a failed pool
                                                                             pod replaced alone, the head kept)

Each phase has one function (`PHASES`), after the checks every phase shares (finished, suspend asked for, deadline,
eviction); `decide` then completes the plan with what only the tick knows (steps.py: Kueue's bookkeeping, the
inputs and the job policy, the plan pod, the digests, the sandbox pool, an ignored spec change). The handler reads
the world into an `Observed`, calls `decide`, and carries the plan out; nothing here performs I/O, so every
transition is tested directly. Phases are `hybridflow.api.status.Phase` members (each is its string). Status is
never rebuilt from scratch: restarts, conditions and progress carry over.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from hybridflow.api import EXIT_BAD_INPUT, RLHFJob
from hybridflow.api.status import ACTIVE, TERMINAL, JobStatus, Phase, pool_status
from hybridflow_operator import steps
from hybridflow_operator.gang import (
    STUCK_TERMINATING_SECONDS, admit_gang, admitted, finished, queued, replace, replaced_pods_back, replaces_alone,
    report_pods_not_starting, rescale, restart, stalled, start, stuck_terminating,
)
from hybridflow_operator.kueue import held
from hybridflow_operator.plan import (
    MAX_MESSAGE, CreateFailure, Inputs, Observed, Plan, PodPhase, PodView, Queue, enter, expected_pods, fail,
    failed_create, invalid, iso, names_taken, parse_time, refused, set_condition,
)
from hybridflow_operator.rest import Rest, backoff, resting

__all__ = [  # the state machine's names, as its callers and tests import them
    "STUCK_TERMINATING_SECONDS", "MAX_MESSAGE", "CreateFailure", "Inputs", "Observed", "Plan", "PodPhase", "PodView",
    "Queue", "Rest", "admit_gang", "backoff", "decide", "expected_pods", "fail", "failed_create", "invalid", "iso",
    "names_taken", "refused", "resting", "set_condition", "transition",
]


def decide(job: RLHFJob | None, observed: Observed) -> Plan:
    """The tick's whole plan, decided once from `observed` (`job` is None when its spec cannot run: observed.error):
    the phase's transition, then steps.STEPS. A plan that would create pods before their inputs were looked up comes
    back `needs_inputs`: the caller looks them up (observed.inputs) and decides again."""
    return steps.complete(_phase_plan(job, observed), job, observed)


def transition(job: RLHFJob | None, error: str | None, status: JobStatus, pods: list[PodView], now: dt.datetime,
               missing_inputs: str | None = None, disrupted: dict[str, str] | None = None, queue: Queue | None = None,
               rollout_asked: int | None = None) -> Plan:
    """The state machine alone, from the observations one by one: the phase's transition with the job's pools and
    `missing_inputs` folded in, without the bookkeeping steps `decide` adds (Kueue's, the plan pod, the sandbox
    pool, the digests). What a tick's transitions are, tested apart from what every tick also carries."""
    seen = Observed(status=status, now=now, pods=pods, error=error, disrupted=disrupted or {}, queue=queue,
                    rollout_asked=rollout_asked,
                    inputs=Inputs(missing_inputs) if missing_inputs is not None else None)
    plan = _phase_plan(job, seen)
    if job is None:
        return plan
    return admit_gang(plan, status, list(seen.pods), now, missing_inputs)


def _phase_plan(job: RLHFJob | None, observed: Observed) -> Plan:
    """The phase's transition, and status.pools from the pods the plan leaves current."""
    if observed.error is not None:
        plan = invalid(observed.status, observed.error, observed.now, list(observed.pods))
    else:
        assert job is not None
        tick = _Tick.of(job, observed)
        phase = tick.st.get("phase", Phase.NEW)
        if phase in TERMINAL:
            plan = _finished(tick)
        else:
            plan = _suspend_asked(tick, phase) or PHASES.get(phase, _active)(tick)
    _observe_pools(plan.status, job, list(observed.pods))
    return plan


@dataclass
class _Tick:
    """One decision's context: the job, what was observed, the plan being made and what every phase reads."""
    job: RLHFJob
    seen: Observed
    plan: Plan
    gen: int  # the current gang generation (status.restarts)
    current: list[PodView]  # its pods, not being deleted
    stale: list[PodView]  # older generations' pods, not being deleted
    waits: str | None  # why Kueue holds the job (kueue.held), None when it may run or is not queued

    @classmethod
    def of(cls, job: RLHFJob, seen: Observed) -> _Tick:
        st = cast(JobStatus, dict(seen.status))
        st.setdefault("restarts", 0)
        st["totalSteps"] = job.spec.trainer.steps
        gen = int(st["restarts"])
        pods = list(seen.pods)
        queue = seen.queue
        return cls(job=job, seen=seen, plan=Plan(status=st), gen=gen,
                   current=[p for p in pods if p.generation == gen and not p.deleting],
                   stale=[p for p in pods if p.generation != gen and not p.deleting],
                   waits=held(queue.workload, queue.name) if queue is not None else None)

    @property
    def st(self) -> JobStatus:
        return self.plan.status

    @property
    def pods(self) -> list[PodView]:
        return list(self.seen.pods)

    @property
    def now(self) -> dt.datetime:
        return self.seen.now


def _finished(t: _Tick) -> Plan:
    finished(t.plan, t.job, t.current, t.now)
    return t.plan


def _suspend_asked(t: _Tick, phase: str) -> Plan | None:
    """runPolicy.suspend on a job not suspending already: its pods go, its status stays."""
    if not t.job.spec.run_policy.suspend or phase in (Phase.SUSPENDING, Phase.SUSPENDED):
        return None
    plan, now = t.plan, t.now
    enter(plan, Phase.SUSPENDING, "SuspendRequested", "runPolicy.suspend is true: deleting pods, keeping status", now)
    set_condition(t.st, "Suspended", False, "Suspending", "deleting the job's pods", now)
    plan.delete_pods = [p.name for p in t.pods if not p.deleting]
    # A job created suspended is accepted now all the same (its spec ConfigMap and digest): a spec edited while
    # it waits (a Secret or ConfigMap added) is then a change to ignore, never what its first pods are made of.
    plan.create_static = phase == Phase.NEW
    return plan


def _new(t: _Tick) -> Plan:
    """A job not started yet: queued (Kueue holds it), admitted (Kueue let it in), or started."""
    if t.waits is not None:
        t.plan.create_static = True  # accepted now (its spec ConfigMap), and its Workload made, as when suspended
        queued(t.plan, t.waits, t.now)
        return t.plan
    if t.seen.queue is not None:
        return admitted(t.plan, t.job, t.gen, t.seen.queue, t.now)
    return start(t.plan, t.job, t.gen, t.now, "Created", "creating the head, pool pods and Ray cluster", static=True)


def _suspending(t: _Tick) -> Plan:
    """Pods going; once none is left, Suspended (runPolicy.suspend) or Queued again (evicted by Kueue)."""
    plan, st, pods = t.plan, t.st, t.pods
    plan.delete_pods = [p.name for p in pods if not p.deleting]
    if not pods and (t.job.spec.run_policy.suspend or t.seen.queue is None):
        enter(plan, Phase.SUSPENDED, "Suspended", "all pods deleted; set runPolicy.suspend false to resume", t.now)
        set_condition(st, "Suspended", True, "Suspended", "job suspended", t.now)
    elif not pods:  # suspended for Kueue (evicted): queued again, until admitted again
        queued(plan, t.waits or "Kueue admitted it again", t.now, evicted=st.get("reason") == "Evicted")
    return plan


def _paused(t: _Tick) -> Plan:
    """Suspended or Queued: resumed once neither runPolicy.suspend nor Kueue holds it."""
    plan, st, phase = t.plan, t.st, t.st.get("phase")
    if t.job.spec.run_policy.suspend:
        return plan
    if t.waits is not None:
        queued(plan, t.waits, t.now, evicted=phase == Phase.QUEUED and st.get("reason") == "Evicted")
        return plan
    if phase == Phase.SUSPENDED:
        set_condition(st, "Suspended", False, "Resumed", "resuming from the last checkpoint", t.now)
    st.pop("startTime", None)  # the deadline counts from the resume, as for Kubernetes Jobs
    if t.seen.queue is not None:
        return admitted(plan, t.job, t.gen, t.seen.queue, t.now)
    return start(plan, t.job, t.gen, t.now, "Resumed", "resuming from the last checkpoint")


def _overrun_or_evicted(t: _Tick) -> Plan | None:
    """What ends a job with pods whatever its phase: its deadline passed (Failed), Kueue evicted it (Suspending)."""
    plan, st, now, phase = t.plan, t.st, t.now, t.st.get("phase")
    if phase not in (*ACTIVE, Phase.RESTARTING):
        return None
    deadline = t.job.spec.run_policy.active_deadline_seconds
    started = parse_time(st.get("startTime"))
    if deadline and started and (now - started).total_seconds() > deadline:
        fail(plan, "DeadlineExceeded", f"ran longer than runPolicy.activeDeadlineSeconds={deadline}", now, t.pods)
        return plan
    if t.waits is not None:  # Kueue evicted it (or lost its Workload)
        enter(plan, Phase.SUSPENDING, "Evicted", f"{t.waits}: deleting the pods; the job resumes from its last "
              "checkpoint once Kueue admits it again", now, "Warning")
        set_condition(st, "Running", False, "Evicted", t.waits, now)
        set_condition(st, "Admitted", False, "Evicted", t.waits, now)
        plan.delete_pods = [p.name for p in t.pods if not p.deleting]
        return plan
    return None


def _restarting(t: _Tick) -> Plan:
    """The old generation goes; once gone (or stuck terminating on a lost node), the new one starts."""
    if (ended := _overrun_or_evicted(t)) is not None:
        return ended
    plan, gen, now = t.plan, t.gen, t.now
    plan.delete_pods = [p.name for p in t.stale]
    stuck = [p for p in t.pods if p.generation != gen and stuck_terminating(p, now)]
    if not t.stale and not [p for p in t.pods if p.generation != gen and p not in stuck]:
        if stuck:
            plan.events.append(("Warning", "PodStuckTerminating",
                                f"{', '.join(p.name for p in stuck)} still terminating "
                                f"{STUCK_TERMINATING_SECONDS}s past its grace period (a lost node?); not waiting"))
        return start(plan, t.job, gen, now, "GangRestarted", f"gang generation {gen} created; the controller "
                     "resumes from the last checkpoint")
    return plan


def _active(t: _Tick) -> Plan:
    """Pending, Initializing, Running: succeeded, failed, replaced, restarted, missing pods made, or moving on."""
    if (ended := _overrun_or_evicted(t)) is not None:
        return ended
    plan, st, job, gen, now, pods, phase = t.plan, t.st, t.job, t.gen, t.now, t.pods, t.st.get("phase")
    plan.delete_pods = [p.name for p in t.stale]  # leftovers of an older generation (e.g. after operator restart)
    head = next((p for p in t.current if p.role == "head"), None)
    if head is not None and head.phase == PodPhase.SUCCEEDED:
        return _succeeded(t)
    current, coming = rescale(plan, job, t.current, now, t.seen.rollout_asked)
    failed = [p for p in current if p.phase in (PodPhase.FAILED, PodPhase.UNKNOWN)]
    if head is not None and head in failed and head.exit_code == EXIT_BAD_INPUT:
        fail(plan, "InvalidInput", f"the driver rejected the job's input (not retried): {head.message}", now, pods)
        return plan
    missing = expected_pods(job) - len(current) - coming
    replaced_pods_back(st, current)
    disrupted = dict(t.seen.disrupted)
    if replaces_alone(job, phase, head, failed, missing, st, disrupted):
        return replace(plan, job, current, failed, missing, now, disrupted)
    if failed or (missing and phase in (Phase.INITIALIZING, Phase.RUNNING)):
        what = (f"pod {failed[0].name} {failed[0].phase.lower()}" + (f": {failed[0].message}" if failed[0].message else "")
                if failed else f"{missing} pod(s) disappeared")
        evicted = {**{p.name: p.disruption for p in pods if p.generation == gen and p.disruption}, **disrupted}
        if evicted:  # evicted by a drain, preempted: not the job's fault
            pod, why = sorted(evicted.items())[0]
            what = f"pod {pod} was disrupted ({why})"
        return restart(plan, job, gen, what, now, pods, counts=not evicted)
    if missing:
        plan.create_gang = gen
        plan.create_static = True
        return plan
    report_pods_not_starting(plan, current, now)
    if phase == Phase.RUNNING and (why := stalled(job, st, now)):
        return restart(plan, job, gen, why, now, pods, reason="Stalled")
    if all(p.phase == PodPhase.RUNNING for p in current):
        if phase != Phase.RUNNING:
            enter(plan, Phase.RUNNING, "AllPodsRunning", f"{len(current)} pods running; training", now)
            set_condition(st, "Running", True, "AllPodsRunning", "the Ray cluster formed and the controller runs", now)
            st["lastProgressTime"] = st["startupTime"] = iso(now)  # the start-up deadline counts from here
    elif any(p.phase != PodPhase.PENDING for p in current) and phase == Phase.PENDING:
        enter(plan, Phase.INITIALIZING, "PodsStarting", "pods scheduled; waiting for the Ray cluster", now)
    return plan


def _succeeded(t: _Tick) -> Plan:
    """The head exited 0: the controller finished every step; the pool pods go, the head stays for its logs."""
    plan, st, now = t.plan, t.st, t.now
    enter(plan, Phase.SUCCEEDED, "Completed", "the controller finished every step", now)
    set_condition(st, "Succeeded", True, "Completed", "the controller finished every step", now)
    set_condition(st, "Running", False, "Completed", "job finished", now)
    st["completionTime"] = iso(now)
    if st.get("totalSteps"):  # the driver exits 0 only after its last step, which polling may have missed
        st["step"] = st["totalSteps"]
    plan.delete_pods += [p.name for p in t.current if p.role != "head"]
    return plan


# One function per phase a job can be in (terminal phases and a suspend asked for are handled before); a phase
# this operator does not know is treated as an active one.
PHASES: dict[str, Callable[[_Tick], Plan]] = {
    Phase.NEW: _new,
    Phase.SUSPENDING: _suspending,
    Phase.SUSPENDED: _paused,
    Phase.QUEUED: _paused,
    Phase.RESTARTING: _restarting,
    Phase.PENDING: _active,
    Phase.INITIALIZING: _active,
    Phase.RUNNING: _active,
}


def _observe_pools(status: JobStatus, job: RLHFJob | None, pods: list[PodView]) -> None:
    """status.pools from the pool pods of the generation the plan leaves current (after a gang restart: the new
    one's, none yet), so a rollout pool of its own shows as up or not beside the trainer's."""
    if job is None:
        return
    gen = int(status.get("restarts", 0))
    status["pools"] = pool_status(job.spec, [(p.pool, p.ready) for p in pods
                                             if p.role == "worker" and p.generation == gen and not p.deleting])
