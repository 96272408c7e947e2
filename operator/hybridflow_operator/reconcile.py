"""The tick: a kopf timer per job, which kopf never runs twice at once for the same object (an `on.create` beside
it used to overlap the first tick and start jobs twice). Each tick observes (`_observe`: the job's status, its
accepted spec, its pods and children from the watches' indexes, its Workload), decides once (phases.decide, pure),
and carries the plan out (`_act`): the status written first, by its one writer (`_record`), then the children
created, pods deleted, events posted, the Workload synced and the job left to rest when it has nothing to do."""
from __future__ import annotations

import copy
import datetime as dt
import functools
import time
from dataclasses import replace
from typing import Any, NamedTuple, cast

import kopf
from kubernetes.client.rest import ApiException

from hybridflow.api import API_GROUP as GROUP
from hybridflow.api import PLURAL, VERSION, RLHFJob, SpecError, parse_job
from hybridflow.api.status import TERMINAL, JobStatus, Phase
from hybridflow_operator import kueue
from hybridflow_operator import manifests as mf
from hybridflow_operator import plan_pod as pp
from hybridflow_operator.accept import accepted_job, check_queueable, look_up_inputs, queue_of
from hybridflow_operator.children import PodNamesTaken, api_error_message, create_children
from hybridflow_operator.kube import API_TIMEOUT, Kube, ignore
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator.phases import CreateFailure, Inputs, Observed, Plan, Queue, decide, failed_create
from hybridflow_operator.plan import iso, parse_time, set_condition
from hybridflow_operator.policy import violations
from hybridflow_operator.progress import SANDBOX_MISSING, Poller, merge_progress, parse_progress
from hybridflow_operator.rest import rest_after, job_rests
from hybridflow_operator.state import INTERVAL, KUEUE, JobMemory, Shared, operator_acts_in, shared_of, memory_of
from hybridflow_operator.watch import lost_children, observed_pods, job_workload
from hybridflow_operator.workloads import sync_workload


@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL, when=operator_acts_in)
def reconcile(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, job_pods: kopf.Index,
              job_services: kopf.Index, job_network_policies: kopf.Index, job_workloads: kopf.Index | None = None,
              **_: Any) -> None:
    t0, metrics = time.perf_counter(), shared_of(memo).metrics
    try:
        _reconcile(body, name, namespace, memo, job_pods, [job_services, job_network_policies], job_workloads)
    except Exception:
        metrics.reconcile_errors.inc()
        raise
    finally:
        metrics.reconcile.observe(time.perf_counter() - t0)


class _Seen(NamedTuple):
    """A tick's observations: what `decide` reads (`observed`), and what only carrying its plan out needs."""
    observed: Observed
    job: RLHFJob | None  # the job as it runs: its accepted spec, its recorded placement plan, Kueue's admission
    accepted: RLHFJob | None  # the spec it was accepted with, as its ConfigMap holds it
    pods: list[dict[str, Any]]  # every pod it controls, from the pod index (`observed_pods`)


def _reconcile(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, index: kopf.Index,
               followed: list[kopf.Index], workloads: kopf.Index | None = None) -> None:
    """One tick: observe, decide (a second time only when the plan creates pods: with their inputs, read then), act."""
    if body["metadata"].get("deletionTimestamp"):
        return  # being deleted: `cleanup` owns it now; a tick must not create children after cleanup has run
    shared = shared_of(memo)
    if not operator_acts_in(memo, namespace):
        return  # the namespace lost its label since kopf started this timer
    memory, uid = memory_of(memo), body["metadata"].get("uid")
    if job_rests(body, memory, functools.partial(lost_children, followed, namespace, name, uid, memory),
              functools.partial(job_workload, workloads, namespace, name, uid)):
        shared.metrics.resting_ticks.inc()
        return
    seen = _observe(shared, body, name, namespace, uid, memory, index, workloads)
    plan = decide(seen.job, seen.observed)
    if plan.needs_inputs:  # about to create pods: are their inputs there?
        assert seen.job is not None
        missing, files = look_up_inputs(shared.kube, shared.policy, seen.job, namespace, seen.observed.status)
        seen = seen._replace(observed=replace(seen.observed, inputs=Inputs(missing, files)))
        plan = decide(seen.job, seen.observed)
    _act(shared, body, name, namespace, uid, memory, followed, seen, plan)


def _observe(shared: Shared, body: kopf.Body, name: str, namespace: str, uid: str | None, memory: JobMemory,
             index: kopf.Index, workloads: kopf.Index | None) -> _Seen:
    """Everything the tick decides from, read once; a spec that cannot run is an observation too (its error)."""
    now = dt.datetime.now(dt.timezone.utc)
    status = _known_status(body, memory)
    job: RLHFJob | None = None
    accepted: RLHFJob | None = None
    error: str | None = None
    changed = False
    queue_name = queue_of(body, status)
    try:
        live = parse_job({"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                          "metadata": {"name": name, "namespace": namespace}, "spec": dict(body.get("spec") or {})},
                         f"RLHFJob {namespace}/{name}")
        accepted, changed = accepted_job(shared.kube, live, uid, status, memory)
        job = pp.with_plan(accepted, status)  # placement auto: its recorded plan laid over it (plan_pod.py)
        if not status.get("phase"):  # checked once, at acceptance: a running job is never failed
            check_queueable(job, queue_name, shared.policy)
    except SpecError as err:
        error, changed, job, accepted = str(err), False, None, None
    queue = Queue(queue_name, job_workload(workloads, namespace, name, uid)) if queue_name and KUEUE else None
    asked = None  # an elastic rollout pool's size, when more than Kueue admitted (the job runs at what it admitted)
    if job is not None and queue is not None:
        job, asked = kueue.within_admission(job, queue.workload)
    pods = observed_pods(index, namespace, name, uid, memory)
    views = [p["view"] for p in pods]
    gen = int(status.get("restarts", 0))
    disrupted = {pod: why for pod, (g, why) in shared.disrupted.get((namespace, name), {}).items() if g == gen}
    observed = Observed(
        status=status, now=now, error=error, disrupted=disrupted, queue=queue, rollout_asked=asked, changed=changed,
        # The environment pool's pods live beside the gang, not in it: decided on apart (environments.plan_pool).
        pods=[v for v in views if v.role not in (mf.ENVIRONMENT_ROLE, pp.PLAN_ROLE)],
        pool_pods=[v for v in views if v.role == mf.ENVIRONMENT_ROLE],
        plan_pod=next((v for v in views if v.role == pp.PLAN_ROLE), None),
        broken=violations(job, shared.policy) if job is not None else ())
    return _Seen(observed, job, accepted, pods)


def _act(shared: Shared, body: kopf.Body, name: str, namespace: str, uid: str | None, memory: JobMemory,
         followed: list[kopf.Index], seen: _Seen, plan: Plan) -> None:
    """Carry the plan out. The status is written before anything is done about it: a tick that fails half-way is
    redone from the new status (missing pods are created again, stale ones deleted again), never from the old one."""
    if plan.needs_inputs:  # decided before its inputs were read: half a plan (steps.complete stopped early)
        raise RuntimeError("a plan that still needs its inputs looked up cannot be carried out")
    job, status, now = seen.job, seen.observed.status, seen.observed.now
    record = functools.partial(_record, shared.kube, namespace, name, memory, status)
    if job is not None and plan.status.get("phase") == Phase.RUNNING:
        _poll_progress(shared.poller, namespace, job, seen.pods, plan.status, now)
    else:
        shared.poller.forget((namespace, name))
    record(plan.status)
    if job is not None:
        # A followed child gone is made again while the job has (or is about to have) pods: not once it finished,
        # nor while suspended (its resume is a gang start, which checks every child).
        lost = (lost_children(followed, namespace, name, uid, memory)
                if plan.status.get("phase") not in (*TERMINAL, Phase.SUSPENDED) else set())
        try:
            create_children(shared, job, uid, plan, seen.pods, memory, first_start=not status.get("phase"),
                             record=record, lost=lost, queue=seen.observed.queue, accepted=seen.accepted)
        except (PodNamesTaken, SpecError, ApiException) as err:
            plan = failed_create(plan, _failure(err), namespace, seen.observed)
            record(plan.status)
    for pod_name in plan.delete_pods:  # each with its own terminationGracePeriodSeconds: a rollout pod's preStop
        memory.created.pop(pod_name, None)  # hands its replicas back within it (manifests)
        ignore(404, shared.kube.core.delete_namespaced_pod, pod_name, namespace)
    for etype, reason, message in plan.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    _count(shared.metrics, namespace, name, status, plan, now)
    owed = False  # the Workload is to be made, or owed a write (a quota to give back): the job may not rest
    if job is not None and seen.observed.queue is not None:
        owed = sync_workload(shared.kube, namespace, seen.observed.queue, plan, len(seen.pods), now)
    if plan.delete_job:
        ignore(404, shared.kube.custom.delete_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)
    if owed:
        memory.rest = None
        return
    rest_after(body, memory, job, status, plan, now, seen.observed.queue)


def _failure(err: Exception) -> CreateFailure:
    """What a failed create makes of the job (phases.failed_create); an API error that a later tick may get past
    (a conflict, a server error) is raised again, for kopf to retry."""
    if isinstance(err, PodNamesTaken):  # someone else's pods under the names of the job's: said, tried again later
        return CreateFailure("names", err.pods)
    if isinstance(err, SpecError):  # a child that exists but is not this job's: fail now, before any pod runs it
        return CreateFailure("invalid", str(err))
    assert isinstance(err, ApiException)
    if err.status not in (403, 404, 422):
        raise err
    return CreateFailure("refused", api_error_message(err), getattr(err, "hybridflow_object", "a child object"),
                         err.status)


def _count(metrics: OperatorMetrics, namespace: str, name: str, status: JobStatus, plan: Plan,
           now: dt.datetime) -> None:
    """The operator's metrics of the job, from the tick's status and the plan's."""
    if plan.status.get("restarts", 0) > status.get("restarts", 0):
        metrics.restarts.labels(namespace).inc()
    if (more := plan.status.get("podReplacements", 0) - status.get("podReplacements", 0)) > 0:
        metrics.replacements.labels(namespace).inc(more)
    if plan.status.get("phase") in TERMINAL and status.get("phase") not in TERMINAL:
        started = parse_time(plan.status.get("startTime"))
        if started:
            metrics.duration.labels(plan.status["phase"]).observe((now - started).total_seconds())
    metrics.set_phase(namespace, name, plan.status.get("phase"))
    metrics.job_restarts.labels(namespace, name).set(plan.status.get("restarts", 0))


def _known_status(body: kopf.Body, memory: JobMemory) -> JobStatus:
    """The job's status: what this operator last wrote, since it is the status's only writer and the watch may
    still deliver versions from before that write (kopf's own annotation patches make such versions routinely);
    the body's status only before the first write of this process (a new or restarted operator)."""
    if memory.written is not None:
        return copy.deepcopy(memory.written)
    return cast(JobStatus, {k: v for k, v in dict(body.get("status") or {}).items() if k != "kopf"})


def _record(kube: Kube, namespace: str, name: str, memory: JobMemory, tick_status: JobStatus,
            new: JobStatus) -> None:
    """The one writer of the job's status: when it differs from what was last written (the tick's status before
    this process's first write), merge-patch the status subresource now (not after the tick, as kopf's `patch`
    would), so that the write is known to have landed before anything relies on it; fields dropped are removed."""
    old = memory.written if memory.written is not None else tick_status
    if new == old:
        return
    patch = {"status": {**{k: None for k in old if k not in new}, **new}}
    kube.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, patch,
                                                      _request_timeout=API_TIMEOUT)
    memory.written = copy.deepcopy(new)


def _poll_progress(poller: Poller, namespace: str, job: RLHFJob, pods: list[dict[str, Any]], status: JobStatus,
                   now: dt.datetime) -> None:
    """Progress from the current generation's head (`pods` holds only pods the job owns: `observed_pods`); an old
    head that still has an IP must not move step back (the poller keeps only the answer of this very head pod). The
    answer is the fetch the previous tick handed over: the tick never waits for a driver."""
    gen = int(status.get("restarts", 0))
    head = [p for p in pods if p["view"].role == "head" and p["podIP"] and p["view"].generation == gen
            and not p["view"].deleting]
    if not head:
        poller.forget((namespace, job.metadata.name))
        return
    text = poller.poll((namespace, job.metadata.name), head[-1]["podIP"], mf.metrics_port(job),
                       target=head[-1]["view"].name)
    if text:
        progress = parse_progress(text, job.metadata.name)
        if missing := progress.pop(SANDBOX_MISSING, None):
            set_condition(status, "SandboxPartial", True, "LayersMissing",
                          f"the sandbox pool runs the job's user code without: {', '.join(missing)} "
                          "(spec.sandbox.allowPartial; its pods hold no credential and reach nothing)", now)
        merge_progress(status, progress, job.spec.trainer.checkpoint_dir, iso(now))
