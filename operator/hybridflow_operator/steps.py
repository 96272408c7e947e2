"""What completes a tick's plan once its phase has decided (phases.decide runs these in order, pure): Kueue's
bookkeeping, the gang held to its inputs and the job policy, the `placement: auto` plan pod, the digests recorded
before their children are made, the sandbox pool, and an ignored spec change. Each used to be a patch the handler
made to the plan after `decide`; the order is the one those patches were made in."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hybridflow.api import RLHFJob
from hybridflow.api.status import TERMINAL, Phase
from hybridflow_operator import kueue
from hybridflow_operator import plan_pod as pp
from hybridflow_operator.environments import PoolPlan, plan_pool
from hybridflow_operator.gang import admit_gang
from hybridflow_operator.meta import SECRET_UID_KEYS
from hybridflow_operator.plan import Observed, Plan, fail, set_condition
from hybridflow_operator.resolve import code_digests, content_digest, reward_key, spec_text

Step = Callable[[Plan, "RLHFJob | None", Observed], Plan]


def complete(plan: Plan, job: RLHFJob | None, seen: Observed) -> Plan:
    """The phase's plan completed by every step; one that creates pods before its inputs were looked up stops at
    `_inputs_and_policy`, marked `needs_inputs` (the handler looks them up and decides again)."""
    for step in STEPS:
        plan = step(plan, job, seen)
        if plan.needs_inputs:
            return plan
    return plan


def _queue_bookkeeping(plan: Plan, job: RLHFJob | None, seen: Observed) -> Plan:
    """A queued job keeps its LocalQueue in status.queueName, and runPolicy.suspend once the Workload holds it."""
    if job is not None and seen.queue is not None:
        plan.status["queueName"] = seen.queue.name
        _, recorded = _active_update(job, seen)
        if recorded is not None:
            plan.status["workloadActive"] = recorded
    return plan


def _active_update(job: RLHFJob, seen: Observed) -> tuple[dict | None, bool | None]:
    assert seen.queue is not None
    return kueue.active_update(seen.queue.workload, job.spec.run_policy.suspend, seen.status.get("workloadActive"))


def _inputs_and_policy(plan: Plan, job: RLHFJob | None, seen: Observed) -> Plan:
    """A plan that creates pods waits for its inputs (looked up only then) and fails on the job policy."""
    if job is None or plan.create_gang is None:
        return plan
    if seen.inputs is None:
        return replace(plan, needs_inputs=True)
    return admit_gang(plan, seen.status, list(seen.pods), seen.now, seen.inputs.missing, seen.broken)


def _plan_pod(plan: Plan, job: RLHFJob | None, seen: Observed) -> Plan:
    """A `placement: auto` job's plan pod where its gang would start (plan_pod.plan_step)."""
    unqueued = seen.queue is not None and seen.queue.workload is None
    return pp.plan_step(plan, job, seen.plan_pod, seen.now, unqueued=unqueued)


def _policy_before_queueing(plan: Plan, job: RLHFJob | None, seen: Observed) -> Plan:
    """A new job judged against the job policy before it queues: Kueue's quota is not spent on a job never to run."""
    if job is not None and seen.queue is not None and not seen.status.get("phase") and \
            plan.status.get("phase") == Phase.QUEUED and seen.broken:
        return admit_gang(replace(plan, create_gang=0), seen.status, list(seen.pods), seen.now, None, seen.broken)
    return plan


def _digests(plan: Plan, job: RLHFJob | None, seen: Observed) -> Plan:
    """Recorded before the ConfigMaps are created, so one planted under their names is told apart by content."""
    if job is not None and plan.create_static and not plan.status.get("acceptedSpecDigest"):
        plan.status["acceptedSpecDigest"] = content_digest(spec_text(job))
    files = seen.inputs.files if seen.inputs is not None else None
    if job is not None and files is not None and plan.create_gang is not None:  # likewise their copy
        plan.status["codeDigests"] = code_digests(files)
        if (key := reward_key(job)) in files:
            plan.status["rewardDigest"] = content_digest(files[key])
        plan.copy_code = files
    return plan


def _sandbox_pool(plan: Plan, job: RLHFJob | None, seen: Observed) -> Plan:
    """The sandbox pool's part of the tick, folded into the plan: its pods to delete and status.environments, and
    the job failed when a replica refused to run without the whole sandbox; the replicas to create."""
    pool_views, views, now = list(seen.pool_pods), list(seen.pods), seen.now
    if job is None:  # a spec that does not parse: the job fails, its pool goes
        pool = PoolPlan(delete=[v.name for v in pool_views if not v.deleting])
    else:
        # a Pending job's pool is made along with its gang's pods: as they are created, or once they are there (a
        # sandbox pod deleted at a gang start, its token made anew, is made again before the gang runs)
        gen = int(plan.status.get("restarts", 0))
        gang = plan.create_gang is not None or any(v.generation == gen and not v.deleting for v in views)
        pool = plan_pool(job, plan.status.get("phase"), pool_views, gang,
                         plan.status.get(SECRET_UID_KEYS["sandbox_token"], ""))
        if pool.refused and plan.status.get("phase") not in TERMINAL:
            fail(plan, "SandboxUnavailable", pool.refused, now, views)
            pool = plan_pool(job, plan.status.get("phase"), pool_views, False)  # Failed: every replica goes
    plan.delete_pods += [n for n in pool.delete if n not in plan.delete_pods]
    if pool.status is not None:
        plan.status["environments"] = pool.status
    plan.create_sandbox = list(pool.create)
    return plan


def _spec_change(plan: Plan, job: RLHFJob | None, seen: Observed) -> Plan:
    """A live job's spec edited beyond runPolicy: said once (an event), kept as a condition; the job runs on."""
    if seen.changed and seen.status.get("phase") not in TERMINAL:
        msg = "spec changed while the job exists; only runPolicy can change: the job keeps its original spec"
        if not any(c.get("reason") == "SpecChangeIgnored" and c.get("status") == "True"
                   for c in plan.status.get("conditions", [])):
            plan.events.append(("Warning", "SpecChangeIgnored", msg))
        set_condition(plan.status, "SpecChangeIgnored", True, "SpecChangeIgnored", msg, seen.now)
    return plan


def _workload_spec(plan: Plan, job: RLHFJob | None, seen: Observed) -> Plan:
    """The Workload's spec.active to write (runPolicy.suspend changed since recorded: kueue.active_update)."""
    if job is not None and seen.queue is not None:
        plan.workload_spec = _active_update(job, seen)[0]
    return plan


STEPS: tuple[Step, ...] = (_queue_bookkeeping, _inputs_and_policy, _plan_pod, _policy_before_queueing, _digests,
                           _sandbox_pool, _spec_change, _workload_spec)
