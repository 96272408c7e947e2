"""`placement: auto` on Kubernetes (issue 52): a plan pod resolves the job's placement before its first gang, and
the operator records the plan in status.plan for the job's life. Pure functions, no I/O, like manifests and phases;
the handler carries out what `plan_step` decides.

The plan pod (`<job>-plan`, role "plan") runs the job's image: `hybridflow plan <spec> --auto` on the spec as its
pods read it, writing the plan's record (hybridflow.api.plan: {"summary", "fields"}) to its termination log, which
the kubelet hands back as the container's termination message. It runs once, where the gang's first pods would be
made (after the inputs check; for a job queued through Kueue, before its Workload, outside the queue's quota: it is
small and short), with the job's spec ConfigMap and model claim read-only, a small scratch, no credential, no
ServiceAccount token and no generation: the plan outlives gang restarts and operator restarts, in status. Once it
succeeded, the record is checked (laid over the accepted spec, validated again), kept in status.plan, the pod goes,
and the job goes on: `with_plan` lays the plan over the accepted spec wherever the job is built (its pods, its
Workload, its sandbox pool, the phase machine), and the gang's containers get the record (PLAN_ENV) so the driver
builds the same job. A plan pod that fails (no placement fits the pools' devices, shapes that cannot be read) fails
the job, PlanFailed, with its message; it stays for its logs until the job goes.
"""
from __future__ import annotations

import datetime as dt
import json
from typing import Any

from hybridflow.api import TERMINAL, RLHFJob, SpecError
from hybridflow.api.names import LABEL_ROLE, names, plan_pod_name
from hybridflow.api.plan import PLAN_ENV, apply_plan, plan_from_text
from hybridflow.api.status import JobStatus, Phase

from hybridflow_operator.kueue import podset_problems, queue_name
from hybridflow_operator.meta import SCRATCH_MOUNT, SPEC_KEY, SPEC_MOUNT
from hybridflow_operator.plan import Plan, PodPhase, PodView, capped, fail, set_condition
from hybridflow_operator.pods import model_volume_mounts, pod_manifest
from hybridflow_operator.resolve import resolved_job

PLAN_ROLE = "plan"
# Where the plan pod writes its record: the default terminationMessagePath, whose content (up to 4096 bytes; a
# record is at most hybridflow.api.plan.MAX_PLAN_BYTES) the kubelet reports as the termination message.
TERMINATION_LOG = "/dev/termination-log"
PLAN_SCRATCH = "256Mi"
PLAN_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "64Mi"},
                  "limits": {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "512Mi"}}
# It runs outside Kueue's quota (before the Workload, which asks for the planned pools): held to one CPU and this
# long; past it the kubelet ends it (DeadlineExceeded) and the job fails PlanFailed, saying so.
PLAN_DEADLINE_SECONDS = 600


def with_plan(job: RLHFJob, status: JobStatus) -> RLHFJob:
    """The accepted job as it runs: status.plan's fields laid over it (apply_plan, validated again) for a
    `placement: auto` job whose plan is recorded; any other job as it is. A job still `auto` here has no plan yet:
    nothing of its gang is built from it."""
    record = status.get("plan")
    if job.spec.placement != "auto" or not record:
        return job
    return apply_plan(job, dict(record).get("fields") or {}, "status.plan")


def plan_pod(job: RLHFJob, uid: str) -> dict[str, Any]:
    """The plan pod: `hybridflow plan --auto` on the spec ConfigMap's spec, its record written to the termination
    log (the log's tail on a failure: FallbackToLogsOnError). It reads the spec and, for models on
    kubernetes.modelPvc, their config.json there (read-only, each model directory by its subPath, as the gang's
    pods see them); a small scratch for the CPU profile's measurement; no credential, no token."""
    vols: list[dict[str, Any]] = [
        {"name": "spec", "configMap": {"name": names(job.metadata.name)["configmap"]}},
        {"name": "scratch", "emptyDir": {"sizeLimit": PLAN_SCRATCH}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "scratch", "mountPath": SCRATCH_MOUNT},
    ]
    run = resolved_job(job)  # the model paths as the spec ConfigMap holds them
    if model_mounts := model_volume_mounts(run.spec):
        vols.append({"name": "models", "persistentVolumeClaim": {"claimName": run.spec.kubernetes.model_pvc,
                                                                 "readOnly": True}})
        mounts += model_mounts
    container = {
        "name": "plan",
        "command": ["hybridflow", "plan", f"{SPEC_MOUNT}/{SPEC_KEY}", "--auto", "--write-plan", TERMINATION_LOG],
        "env": [{"name": "HOME", "value": SCRATCH_MOUNT}],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": json.loads(json.dumps(PLAN_RESOURCES)),
    }
    pod = pod_manifest(job, uid, plan_pod_name(job.metadata.name), {LABEL_ROLE: PLAN_ROLE}, [container], [], None, "",
               volumes_and_mounts=(vols, mounts), gang=False)
    pod["spec"]["terminationGracePeriodSeconds"] = 5
    pod["spec"]["activeDeadlineSeconds"] = PLAN_DEADLINE_SECONDS
    return pod


def with_plan_env(pods: list[dict[str, Any]], record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The gang's pods with the plan's record in each main container (PLAN_ENV): the driver lays the same fields
    over the same accepted spec (hybridflow.cli.device_map.placed), so it builds the job the operator built."""
    if record:
        value = json.dumps(record, separators=(",", ":"), sort_keys=True)
        for pod in pods:
            for c in pod["spec"]["containers"]:
                c["env"] = [*c.get("env", []), {"name": PLAN_ENV, "value": value}]
    return pods


def plan_step(plan: Plan, job: RLHFJob | None, view: PodView | None, now: dt.datetime,
              unqueued: bool = False) -> Plan:
    """The tick's plan, held to `placement: auto`: a job still `auto` (no status.plan when the tick began) gets no
    gang pod; where its gang would be made (`create_gang`, or `unqueued`: a Kueue job whose Workload is yet to be
    made) its plan pod is made instead. `view`: the plan pod as seen (None: none). Its plan, once it succeeded, is
    recorded (the gang follows at the next tick, built from it); its failure fails the job. A plan pod with nothing
    left to do goes (one that failed stays for its logs once the job has ended)."""
    st = plan.status
    ended = st.get("phase") in TERMINAL
    if job is None or job.spec.placement != "auto" or ended:
        if view is not None and not view.deleting and not (ended and view.phase == PodPhase.FAILED):
            plan.delete_pods += [] if view.name in plan.delete_pods else [view.name]
        return plan
    wanted = plan.create_gang is not None or unqueued
    plan.create_gang = None  # never a pod of the gang before its plan
    if view is None:
        if wanted:
            _planning(plan, plan_pod_name(job.metadata.name), now)
        return plan
    if view.deleting:
        return plan  # made again once gone, if still wanted
    _created(st, view, now)
    if view.phase == PodPhase.SUCCEEDED:
        return _record(plan, job, view, now)
    if view.phase in (PodPhase.FAILED, PodPhase.UNKNOWN):
        fail(plan, "PlanFailed", f"spec.placement auto: the plan pod {view.name} failed"
             + (f": {view.message}" if view.message else "") + "; the job's pools (spec.resourcePools) are what "
             "it plans for", now, [])
    elif not wanted:  # suspended, queued again: no pods
        plan.delete_pods.append(view.name)
    elif view.waiting:
        set_condition(st, "Planned", False, "Planning", f"pod {view.name} does not start: {view.waiting}", now)
    return plan


def _planning(plan: Plan, pod: str, now: dt.datetime) -> None:
    """The plan pod is to be made: the job is Pending (or Queued, its Workload made after the plan), saying so."""
    st = plan.status
    message = f"spec.placement auto: pod {pod} plans the job's placement onto its pools' devices; the gang follows"
    plan.create_plan_pod = True
    plan.events = [e for e in plan.events if e[0] != "Normal"]  # no "creating the pods" when none are
    if not any(c["type"] == "Planned" and c["reason"] == "Planning" for c in st.get("conditions", [])):
        plan.events.append(("Normal", "Planning", message))
    if st.get("phase") == Phase.PENDING:
        st.update(reason="Planning", message=message)
    set_condition(st, "Planned", False, "Planning", message, now)


def _created(st: JobStatus, view: PodView, now: dt.datetime) -> None:
    """A create refused earlier (CreateRefused) that has now made the plan pod: cleared, so the job does not rest
    as refused while it plans."""
    if any(c["type"] == "CreateRefused" and c["status"] == "True" for c in st.get("conditions", [])):
        set_condition(st, "CreateRefused", False, "Created", f"the API server admitted pod {view.name}", now)


def _record(plan: Plan, job: RLHFJob, view: PodView, now: dt.datetime) -> Plan:
    """The plan pod's record, checked as the job will run it (laid over the accepted spec, validated again), kept
    in status.plan; the pod goes."""
    st = plan.status
    try:
        record = plan_from_text(view.output, f"pod {view.name}'s termination message")
        json.dumps(record, allow_nan=False)  # status is JSON: no NaN nor Infinity (the API server refuses them)
        planned = apply_plan(job, record["fields"], f"pod {view.name}'s plan")
        labels = (job.metadata.model_extra or {}).get("labels")
        if queue_name(labels) and (too_many := podset_problems(planned)):  # as judged at acceptance
            raise SpecError("; ".join(too_many))
    except (SpecError, ValueError) as err:
        fail(plan, "PlanFailed", f"spec.placement auto: the plan pod {view.name} gave no plan this job can run: {err}",
             now, [])
        return plan
    st["plan"] = record
    message = capped(f"spec.placement auto: {describe(record['summary'])} (status.plan); creating the head, pool "
                     "pods and Ray cluster")
    if st.get("phase") == Phase.PENDING:
        st.update(reason="Planned", message=message)
    set_condition(st, "Planned", True, "Planned", message, now)
    plan.events.append(("Normal", "Planned", message))
    plan.delete_pods.append(view.name)
    return plan


def describe(summary: dict[str, Any]) -> str:
    """A plan's summary in one line (what the pod printed: placement, pools' devices, layout, prediction)."""
    pools = summary.get("pools") or {}
    where = ", ".join(f"{name} {count}" for name, count in pools.items()) if isinstance(pools, dict) else ""
    out = f"{summary.get('placement', '?')}, {summary.get('layout', '?')}, mode {summary.get('mode', '?')}"
    out += f"; pools {where}" if where else ""
    if (step := summary.get("predictedStepSeconds")) is not None:
        out += f"; predicted {step} s a step"
    return out
