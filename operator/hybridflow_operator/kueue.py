"""Kueue admission of a job: the Workload the operator makes for it, what Kueue's answer in that Workload means for
the job, and what the operator writes back into it. Pure functions, objects in and dicts out, like manifests.

Kueue admits its own integrations (batch Job, JobSet, RayJob) in its job framework (`pkg/controller/jobframework`):
a controller per kind creates the Workload, keeps the job suspended until Kueue admits it, gives the pods the node
labels and tolerations of the ResourceFlavors assigned, stops the job when Kueue evicts it and then gives the quota
back. An RLHFJob is not a kind Kueue knows, so this operator plays that controller's part for its own jobs, against
Kueue's v1beta1 API (kueue.x-k8s.io/v1beta1: Workload, ResourceFlavor), as the job framework does:

- one podSet per pool, plus the head ("head") and the environment pool ("environments"), each from the pod the
  operator would create (its requests are what Kueue counts);
- an elastic rollout pool asks for maxReplicas with minCount minReplicas (Kueue's partial admission): the count
  Kueue admits caps the pool's size for as long as the admission lasts. A pool scaled down keeps its quota (Kueue
  refuses a reclaimablePods count that shrinks while admitted, so quota given back could not be taken again without
  a new admission; Kueue's ElasticJobsViaWorkloadSlices is alpha); one scaled past the admitted count waits at it.
- evicted (preempted, a stopped queue, PodsReady timeout, deactivated): the job is suspended, its pods deleted, and
  once none is left the admission is cleared (QuotaReserved False, Requeued True after a preemption or node
  failures), so that Kueue queues it again; re-admitted, it resumes from its last checkpoint.
- Finished True once the job succeeded or failed (Kueue releases its quota); PodsReady while the job runs.
- runPolicy.suspend is `spec.active: false` (Kueue evicts the Workload, "Deactivated", and keeps it out of the queue);
  a Workload Kueue deactivated itself stays so (the job waits, saying why) until runPolicy.suspend is toggled.
- the queue is the label's value when the job is accepted (status.queueName); renaming it while the job waits moves
  its Workload to the new queue; adding or removing the label later changes nothing.

Not done: topology-aware scheduling (a topologyAssignment's node placement and scheduling gate are not applied:
pods follow the flavors' node labels only). Kueue's pod integration must not manage the jobs' namespaces (a
`default` LocalQueue, or manageJobsWithoutQueueName): it would gate and count the job's pods a second time.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from hybridflow.api import RLHFJob, SpecError
from hybridflow.api.agents import sandbox_pool
from hybridflow.api.names import LABEL_JOB, LABEL_POOL, LABEL_ROLE, names
from hybridflow.api.scaling import replicas_now, sized
from hybridflow.api.status import TERMINAL, Phase
from hybridflow_operator.meta import object_meta

GROUP, VERSION = "kueue.x-k8s.io", "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOADS, FLAVORS = "workloads", "resourceflavors"
QUEUE_LABEL = f"{GROUP}/queue-name"  # on the RLHFJob: the LocalQueue (in its namespace) that admits it
PODSET_LABEL = f"{GROUP}/podset"  # on each pod: its podSet, as Kueue's own integrations label them
PRIORITY_SOURCE = "scheduling.k8s.io/priorityclass"
HEAD_PODSET, ENVIRONMENT_PODSET = "head", "environments"
# Evictions after which Kueue's job framework marks the Workload Requeued (it tries again by itself).
REQUEUED_AFTER = ("Preempted", "NodeFailures")


def queue_name(labels: dict[str, str] | None) -> str | None:
    """The LocalQueue a job is labelled for, or None: the job is not queued through Kueue."""
    return (labels or {}).get(QUEUE_LABEL) or None


def workload_name(job_name: str) -> str:
    return names(job_name)["workload"]


def podset_of(pod: dict[str, Any]) -> str:
    """The podSet a pod of the job counts in: its pool's, the head's or the environment pool's."""
    labels = pod["metadata"].get("labels") or {}
    role = labels.get(LABEL_ROLE)
    if role == "head":
        return HEAD_PODSET
    return labels.get(LABEL_POOL) or ENVIRONMENT_PODSET


# The most podSets a Workload may have in every Kueue that serves v1beta1 with the fields used here (v0.9-v0.13
# allow 8, later ones 18).
MAX_PODSETS = 8


def podset_problems(job: RLHFJob) -> list[str]:
    """A pool whose name is one of the podSets the operator names itself would share its podSet; more pools than a
    Workload holds podSets cannot be queued."""
    out = [f"spec.resourcePools[{i}].name: '{p.name}' is the name of the job's {p.name} podSet in its Kueue "
           f"Workload (kueue.x-k8s.io/queue-name is set); rename the pool"
           for i, p in enumerate(job.spec.resource_pools) if p.name in (HEAD_PODSET, ENVIRONMENT_PODSET)]
    podsets = 1 + len(job.spec.resource_pools) + (sandbox_pool(job.spec) is not None)
    if podsets > MAX_PODSETS:
        out.append(f"spec.resourcePools: {len(job.spec.resource_pools)} pools make {podsets} Kueue podSets (with the "
                   f"head{' and the sandbox pool' if sandbox_pool(job.spec) else ''}); a Workload holds at most "
                   f"{MAX_PODSETS}: merge pools, or remove the kueue.x-k8s.io/queue-name label")
    return out


def workload(job: RLHFJob, uid: str, queue: str, pods: list[dict[str, Any]],
             priority: tuple[str, int] | None = None) -> dict[str, Any]:
    """The job's Workload: one podSet per kind of pod (`pods`: the head, every pool pod and every environment pod a
    gang start makes), its template the first such pod, its count how many there are; an elastic rollout pool asks
    for maxReplicas, at least minReplicas. `priority`: (PriorityClass, value) of runPolicy.priorityClassName."""
    if problems := podset_problems(job):
        raise SpecError("; ".join(problems))
    grouped: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        grouped.setdefault(podset_of(pod), []).append(pod)
    rp, rollout = job.spec.rollout_pool, job.spec.pool("rollout").name
    podsets = []
    for name, members in grouped.items():
        template = members[0]
        labels = {k: v for k, v in (template["metadata"].get("labels") or {}).items()
                  if k in (LABEL_JOB, LABEL_ROLE, LABEL_POOL)}
        podset: dict[str, Any] = {"name": name, "count": len(members),
                                  "template": {"metadata": {"labels": labels}, "spec": template["spec"]}}
        if rp is not None and name == rollout:
            podset.update(count=rp.max_replicas, minCount=rp.min_replicas)
        podsets.append(podset)
    spec: dict[str, Any] = {"queueName": queue, "podSets": podsets, "active": not job.spec.run_policy.suspend}
    if priority is not None:
        spec.update(priorityClassName=priority[0], priority=priority[1], priorityClassSource=PRIORITY_SOURCE)
    return {"apiVersion": API_VERSION, "kind": "Workload",
            "metadata": object_meta(job, uid, workload_name(job.metadata.name)), "spec": spec}


@dataclass(frozen=True)
class Placement:
    """What Kueue's admission adds to one podSet's pods: the assigned ResourceFlavors' nodeLabels and tolerations,
    and the podSetUpdates of the Workload's admission checks."""
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Admission:
    """The job's Workload as the operator reads it (from its watch), and Kueue's verdict in it."""
    name: str
    admitted: bool  # condition Admitted True
    quota_reserved: bool  # condition QuotaReserved True (what the job holds until it gives it back)
    queue: str = ""  # spec.queueName
    evicted: str = ""  # condition Evicted True: "<reason>: <message>"
    evicted_reason: str = ""
    waiting: str = ""  # why it is not admitted, in Kueue's words (QuotaReserved False's message)
    cluster_queue: str = ""
    counts: dict[str, int] = field(default_factory=dict)  # podSet -> pods admitted
    flavors: dict[str, list[str]] = field(default_factory=dict)  # podSet -> ResourceFlavors assigned
    updates: dict[str, Placement] = field(default_factory=dict)  # podSet -> admission checks' podSetUpdates
    active: bool = True
    finished: bool = False
    pods_ready: bool | None = None
    conditions: list[dict[str, Any]] = field(default_factory=list)
    generation: int = 1
    resource_version: str = ""
    owner: str | None = None  # the uid of its controller (the job's, when it is the job's own)


def _condition(conditions: list[dict[str, Any]], ctype: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == ctype), None)


def _true(conditions: list[dict[str, Any]], ctype: str) -> bool:
    return (_condition(conditions, ctype) or {}).get("status") == "True"


def read_workload(obj: dict[str, Any]) -> Admission:
    """An Admission from a Workload object (as the API server returns it)."""
    meta, spec, st = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    conds = list(st.get("conditions") or [])
    admission = st.get("admission") or {}
    counts, flavors = {}, {}
    requested = {p.get("name"): int(p.get("count", 1)) for p in spec.get("podSets") or []}
    for a in admission.get("podSetAssignments") or []:
        counts[a["name"]] = int(a["count"]) if a.get("count") is not None else requested.get(a["name"], 0)
        flavors[a["name"]] = sorted(set((a.get("flavors") or {}).values()))
    updates = {}
    for check in st.get("admissionChecks") or []:
        for u in check.get("podSetUpdates") or []:
            updates[u["name"]] = Placement(dict(u.get("nodeSelector") or {}), list(u.get("tolerations") or []),
                                           dict(u.get("labels") or {}), dict(u.get("annotations") or {}))
    evicted = _condition(conds, "Evicted") if _true(conds, "Evicted") else None
    reserved = _condition(conds, "QuotaReserved") or {}
    owners = [r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("controller")]
    return Admission(
        name=meta.get("name", ""), queue=spec.get("queueName", ""), admitted=_true(conds, "Admitted"),
        quota_reserved=_true(conds, "QuotaReserved"),
        evicted=f"{evicted.get('reason', '')}: {evicted.get('message', '')}".strip(": ") if evicted else "",
        evicted_reason=evicted.get("reason", "") if evicted else "",
        waiting="" if reserved.get("status") == "True" else reserved.get("message", ""),
        cluster_queue=admission.get("clusterQueue", ""), counts=counts, flavors=flavors, updates=updates,
        active=spec.get("active", True) is not False, finished=_true(conds, "Finished"),
        pods_ready=None if _condition(conds, "PodsReady") is None else _true(conds, "PodsReady"),
        conditions=conds, generation=int(meta.get("generation") or 1),
        resource_version=str(meta.get("resourceVersion") or ""), owner=owners[0] if owners else None)


def held(admission: Admission | None, queue: str) -> str | None:
    """Why a queued job may not have pods now, or None when Kueue admitted it (and has not evicted it)."""
    if admission is None:
        return f"no Workload of the job in LocalQueue {queue} yet (the operator makes it)"
    if not admission.active:
        return (f"Workload {admission.name} is inactive (spec.active false{': ' + admission.evicted if admission.evicted else ''}"
                "); set runPolicy.suspend true, then false, to queue the job again")
    if admission.evicted:
        return f"Kueue evicted Workload {admission.name} ({admission.evicted})"
    if not admission.admitted:
        why = f": {admission.waiting}" if admission.waiting else ""
        return f"Workload {admission.name} waits for admission in LocalQueue {queue}{why}"
    return None


def admitted_count(admission: Admission | None, podset: str) -> int | None:
    """How many pods of a podSet Kueue admitted (None: no admission, or no such podSet in it)."""
    if admission is None or not admission.admitted:
        return None
    return admission.counts.get(podset)


def within_admission(job: RLHFJob, admission: Admission | None) -> tuple[RLHFJob, int | None]:
    """The job as it may run under Kueue's admission: an elastic rollout pool sized to at most the pods admitted for
    it (Kueue's partial admission), and the size asked for when that is more (else None)."""
    asked = replicas_now(job.spec)
    cap = admitted_count(admission, job.spec.pool("rollout").name) if asked is not None else None
    if cap is None or asked is None or asked <= cap:
        return job, None
    return sized(job, cap), asked


def placements(admission: Admission, flavors: dict[str, dict[str, Any]]) -> dict[str, Placement]:
    """Each podSet's Placement: the nodeLabels and tolerations of the ResourceFlavors assigned to it (`flavors`:
    name -> ResourceFlavor object), then its admission checks' podSetUpdates, merged as Kueue's podset.Merge does
    (a key set twice to different values is an error, naming both)."""
    out = {}
    for podset, assigned in admission.flavors.items():
        sel: dict[str, str] = {}
        tol: list[dict[str, Any]] = []
        for name in assigned:
            fspec = (flavors.get(name) or {}).get("spec") or {}
            _merge(sel, fspec.get("nodeLabels") or {}, f"ResourceFlavor {name}'s nodeLabels", podset)
            tol += [t for t in fspec.get("tolerations") or [] if t not in tol]
        update = admission.updates.get(podset, Placement())
        _merge(sel, update.node_selector, "an admission check's podSetUpdates", podset)
        tol += [t for t in update.tolerations if t not in tol]
        out[podset] = Placement(sel, tol, dict(update.labels), dict(update.annotations))
    return out


def _merge(into: dict[str, str], more: dict[str, str], what: str, podset: str) -> None:
    for k, v in more.items():
        if into.get(k, v) != v:
            raise SpecError(f"Kueue's admission of podSet {podset} sets node label {k} to both {into[k]!r} and "
                            f"{v!r} ({what}); the cluster's ResourceFlavors disagree, ask its admin")
        into[k] = v


def place(pods: list[dict[str, Any]], where: dict[str, Placement]) -> list[dict[str, Any]]:
    """The pods with their podSet's Placement added (nodeSelector, tolerations, labels, annotations) and their
    podSet label. A node label the pool already selects on with another value cannot be both: that fails the job,
    naming the pool field and the flavor's label, as Kueue fails a job whose template disagrees with its flavor."""
    for pod in pods:
        podset = podset_of(pod)
        spec, meta = pod["spec"], pod["metadata"]
        meta.setdefault("labels", {})[PODSET_LABEL] = podset
        p = where.get(podset)
        if p is None:
            continue
        sel = spec.setdefault("nodeSelector", {})
        for k, v in p.node_selector.items():
            if sel.get(k, v) != v:
                raise SpecError(f"spec.resourcePools (pool {podset}).nodeSelector: {k}={sel[k]!r}, but Kueue "
                                f"admitted the pool on nodes with {k}={v!r}; drop that key from the pool, or use a "
                                "LocalQueue whose flavors match it")
            sel[k] = v
        if not sel:
            spec.pop("nodeSelector")
        tol = spec.get("tolerations") or []
        tol += [t for t in p.tolerations if t not in tol]
        if tol:
            spec["tolerations"] = tol
        meta["labels"].update({k: v for k, v in p.labels.items() if k not in meta["labels"]})
        if p.annotations:
            meta.setdefault("annotations", {}).update(p.annotations)
    return pods


def _set(conds: list[dict[str, Any]], ctype: str, status: bool, reason: str, message: str, now: dt.datetime,
         generation: int) -> bool:
    """metav1.Condition semantics (lastTransitionTime moves when the status flips); whether anything changed."""
    new = "True" if status else "False"
    old = _condition(conds, ctype)
    entry = {"type": ctype, "status": new, "reason": reason, "message": message[:32768],
             "observedGeneration": generation,
             "lastTransitionTime": (old["lastTransitionTime"] if old and old.get("status") == new
                                    else now.strftime("%Y-%m-%dT%H:%M:%SZ"))}
    if old is not None and {k: old.get(k) for k in entry} == entry:
        return False
    if old is not None:
        conds[conds.index(old)] = entry
    else:
        conds.append(entry)
    return True


def status_patch(admission: Admission | None, phase: str, pods_left: int, message: str,
                 now: dt.datetime) -> dict[str, Any] | None:
    """What the operator writes into its Workload's status after a tick, or None: the admission given back once an
    evicted job has no pod left (Kueue's job framework: QuotaReserved False "Pending", Admitted False, Requeued
    True after a preemption or node failures), Finished once the job ended, PodsReady while it runs. A merge patch
    carrying the resourceVersion read: one written by Kueue in between is not overwritten (409, the next tick reads
    it again)."""
    if admission is None or admission.finished:
        return None
    conds = [dict(c) for c in admission.conditions]
    gen, changed, body = admission.generation, False, {}
    if phase in TERMINAL:
        reason = "Succeeded" if phase == Phase.SUCCEEDED else "Failed"
        changed = _set(conds, "Finished", True, reason, message or f"the RLHFJob {reason.lower()}", now, gen)
    elif admission.evicted and admission.quota_reserved and pods_left == 0:
        changed |= _set(conds, "Requeued", admission.evicted_reason in REQUEUED_AFTER,
                        admission.evicted_reason or "Evicted", admission.evicted, now, gen)
        changed |= _set(conds, "QuotaReserved", False, "Pending", admission.evicted, now, gen)
        changed |= _set(conds, "Admitted", False, "NoReservation", "The workload has no reservation", now, gen)
        body["admission"] = None
    elif admission.admitted and not admission.evicted:
        # Kueue's reasons: waitForPodsReady times out only a PodsReady False of WaitForStart or WaitForRecovery
        running, was = phase == Phase.RUNNING, _condition(conds, "PodsReady")
        if admission.pods_ready is not running:
            again = bool(was and was.get("reason") in ("Started", "Recovered", "WaitForRecovery"))
            changed = _set(conds, "PodsReady", running,
                           ("Recovered" if again else "Started") if running else
                           ("WaitForRecovery" if again else "WaitForStart"),
                           "All pods reached readiness and the workload is running" if running else
                           "Not all pods are ready or succeeded", now, gen)
    if not changed:
        return None
    return {"metadata": {"resourceVersion": admission.resource_version},
            "status": {"conditions": conds, **body}}


def active_update(admission: Admission | None, suspend: bool,
                  recorded: bool | None) -> tuple[dict[str, Any] | None, bool | None]:
    """runPolicy.suspend as the Workload's spec.active (Kueue evicts an inactive Workload and queues it no more):
    (the spec patch to write, or None; the value for status.workloadActive once the Workload holds it, or None).
    Written only when runPolicy.suspend changed since it was last recorded: Kueue deactivates Workloads itself (a
    rejected admission check, its requeuing limit, a maximum execution time), and the operator must not undo that."""
    want = not suspend
    if admission is None or admission.finished or recorded == want:
        return None, None
    if admission.active is want:  # the Workload holds it (made so, or the patch seen back): recorded now
        return None, want
    return {"spec": {"active": want}}, None
