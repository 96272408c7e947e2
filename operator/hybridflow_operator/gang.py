"""The transitions of a job that has (or is about to have) pods: its gang started, restarted, rescaled, its pool
pods replaced alone, queued and admitted through Kueue, stalled, finished. Pure helpers of phases.py's phase
functions, each editing the tick's plan."""
from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from hybridflow.api import RLHFJob
from hybridflow.api.run_policy import progress_deadline, startup_deadline
from hybridflow.api.scaling import replicas_now
from hybridflow.api.status import TERMINAL, JobStatus, Phase
from hybridflow_operator.meta import selector
from hybridflow_operator.plan import (
    Plan, PodPhase, PodView, Queue, capped, enter, fail, invalid, iso, parse_time, set_condition,
)

# A pod still Pending this long with no reason of its own is reported (not failed: a queue may be long).
PENDING_TOO_LONG_SECONDS = 600
# A pod still terminating this long past its grace period (a lost node) no longer holds a gang restart back. Long:
# on a partitioned (not dead) node the old driver may still be writing checkpoints; only a lost node ends so.
STUCK_TERMINATING_SECONDS = 300


def start(plan: Plan, job: RLHFJob, gen: int, now: dt.datetime, reason: str, message: str,
           static: bool = False) -> Plan:
    enter(plan, Phase.PENDING, reason, message, now)
    plan.status.setdefault("startTime", iso(now))
    set_condition(plan.status, "Created", True, reason, message, now)
    plan.create_static = True
    plan.create_gang = gen
    return plan


def restart(plan: Plan, job: RLHFJob, gen: int, what: str, now: dt.datetime, pods: list[PodView],
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
    enter(plan, Phase.RESTARTING, reason, f"{what}; restarting the whole gang {count}", now, "Warning")
    set_condition(plan.status, "Running", False, reason, what, now)
    plan.status.pop("replacing", None)  # a new generation makes every pod afresh
    plan.delete_pods = [p.name for p in pods if not p.deleting]
    return plan


def rescale(plan: Plan, job: RLHFJob, current: list[PodView], now: dt.datetime,
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


def queued(plan: Plan, why: str, now: dt.datetime, evicted: bool = False) -> None:
    """Queued: no pods until Kueue admits the job's Workload (again, after an eviction: `evicted` keeps that the
    reason)."""
    st = plan.status
    reason = "Evicted" if evicted else "WaitingForAdmission"
    if st.get("phase") != Phase.QUEUED or st.get("message") != capped(why):
        enter(plan, Phase.QUEUED, reason, why, now)
    set_condition(st, "Admitted", False, reason, why, now)


def admitted(plan: Plan, job: RLHFJob, gen: int, queue: Queue, now: dt.datetime) -> Plan:
    """Kueue admitted the job's Workload: its pods are made (placed on the flavors assigned), resuming from the
    last checkpoint after an eviction."""
    wl = queue.workload
    assert wl is not None
    again = any(c["type"] == "Created" for c in plan.status.get("conditions", []))  # it had pods before
    message = (f"Kueue admitted Workload {wl.name} in ClusterQueue {wl.cluster_queue or '?'}; " +
               ("resuming from the last checkpoint" if again else "creating the head, pool pods and Ray cluster"))
    set_condition(plan.status, "Admitted", True, "Admitted", message, now)
    return start(plan, job, gen, now, "Admitted", message, static=True)


def replaces_alone(job: RLHFJob, phase: str, head: PodView | None, failed: list[PodView], missing: int,
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


def replace(plan: Plan, job: RLHFJob, current: list[PodView], failed: list[PodView], missing: int,
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


def replaced_pods_back(st: JobStatus, current: list[PodView]) -> None:
    """Forget the replacements whose new pods exist."""
    if "replacing" in st:
        names = {p.name for p in current}
        left = [n for n in st["replacing"] if n not in names]
        if left:
            st["replacing"] = left
        else:
            st.pop("replacing")


def stalled(job: RLHFJob, st: JobStatus, now: dt.datetime) -> str | None:
    """Why a running job counts as stuck (api.run_policy): no step completed since the operator last saw the step
    move (or the gang start Running), within the start-up deadline while the gang has not completed its first step
    (startupTime, dropped at its driver's first step: progress.merge_progress), the progress deadline after. The
    clock is the same for both, so a default start-up is judged as before the start-up deadline existed."""
    since = parse_time(st.get("lastProgressTime"))
    if since is None:
        st["lastProgressTime"] = iso(now)  # a job running before the operator knew the field: counted from now
        return None
    policy, slowest = job.spec.run_policy, st.get("slowestStepSeconds")
    starting = "startupTime" in st
    deadline = (startup_deadline if starting else progress_deadline)(policy, slowest)
    quiet = (now - since).total_seconds()
    if quiet <= deadline:
        return None
    if starting:
        return (f"no step completed for {quiet:.0f}s of the gang's start-up (start-up deadline {deadline:.0f}s: "
                + ("runPolicy.startupDeadlineSeconds" if policy.startup_deadline_seconds else
                   "the default, the progress deadline and at least the floor") + ")")
    last = f"after step {st['step']}" if st.get("step") else "since the job started running"
    return (f"no step completed for {quiet:.0f}s {last} (progress deadline {deadline:.0f}s: "
            + ("runPolicy.progressDeadlineSeconds" if policy.progress_deadline_seconds else
               "the default, from the slowest step seen") + ")")


def stuck_terminating(p: PodView, now: dt.datetime) -> bool:
    return bool(p.deleting and p.deletion_deadline
                and (now - p.deletion_deadline).total_seconds() > STUCK_TERMINATING_SECONDS)


def report_pods_not_starting(plan: Plan, current: list[PodView], now: dt.datetime) -> None:
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


def finished(plan: Plan, job: RLHFJob, current: list[PodView], now: dt.datetime) -> None:
    """Terminal: worker pods go (they hold devices), the head stays for its logs until the TTL."""
    plan.delete_pods = [p.name for p in current if p.role != "head"]
    ttl = job.spec.run_policy.ttl_seconds_after_finished
    done = parse_time(plan.status.get("completionTime"))
    if ttl is not None and done is not None and (now - done).total_seconds() >= ttl:
        plan.delete_job = True


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
        enter(plan, Phase.PENDING, "InputsFound", found, now)
        set_condition(plan.status, "InputsReady", True, "InputsFound", found, now)
