"""A queued job's Kueue Workload: made when it has none, its pods placed where Kueue admitted them, and what Kueue
needs from its owner written back (`sync_workload`)."""
from __future__ import annotations

import datetime as dt
import time
from collections.abc import MutableMapping
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from hybridflow.api import RLHFJob
from hybridflow.api.agents import sandbox_replicas
from hybridflow.api.status import TERMINAL
from hybridflow_operator import kueue
from hybridflow_operator import manifests as mf
from hybridflow_operator.accept import check_owner
from hybridflow_operator.environments import environment_pod
from hybridflow_operator.kube import Kube, ignore
from hybridflow_operator.plan import Plan, Queue
from hybridflow_operator.state import CREATED_GRACE_SECONDS, INTERVAL, JobMemory, log, memory_of

def make_workload(kube: Kube, job: RLHFJob, uid: str | None, queue: str,
                   memo: MutableMapping[str, Any] | JobMemory, runtime_class: str = "") -> None:
    """Create the job's Workload (it has none, or it was deleted), at most once per CREATED_GRACE_SECONDS while the
    watch has not shown it. One found under its name must be the job's own (`check_owner`). `runtime_class`: the
    sandbox pods' default RuntimeClass (Policy.sandbox_runtime_class), so its podSets are the pods made later."""
    memory = memory_of(memo)
    posted = memory.workload_posted
    if posted is not None and time.monotonic() - posted < CREATED_GRACE_SECONDS:
        return
    memory.workload_posted = time.monotonic()  # a refused create too is tried again only after the grace
    pods = mf.gang_pods(job, uid or "", 0)
    pods += [environment_pod(job, uid or "", i, runtime_class) for i in range(len(sandbox_replicas(job.spec)))]
    obj = kueue.workload(job, uid or "", queue, pods, _priority(kube, job))
    try:
        made = kube.create(obj)
    except ApiException as err:
        err.hybridflow_object = f"Workload {obj['metadata']['name']}"  # type: ignore[attr-defined]
        raise
    if made is None:
        ns, wl = obj["metadata"]["namespace"], obj["metadata"]["name"]
        found = kube.read("Workload", ns, wl)
        if found is not None:
            check_owner("Workload", ns, wl, found, uid)


def _priority(kube: Kube, job: RLHFJob) -> tuple[str, int] | None:
    """(name, value) of runPolicy.priorityClassName, which Kueue orders and preempts the queue's Workloads by (its
    Workload must state the value); None without one, or when it does not exist (the pods would be refused)."""
    name = job.spec.run_policy.priority_class_name
    if not name:
        return None
    found = ignore(404, kube.scheduling.read_priority_class, name)
    return None if found is None else (name, int(found.value))


def place_pods(kube: Kube, queue: Queue, new_pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods placed where Kueue admitted them (kueue.place: the flavors' node labels and tolerations). None is
    created for a job whose Workload is not admitted: `decide` plans none, and this holds even if it did."""
    if queue.workload is None or kueue.held(queue.workload, queue.name):
        log.error("not creating %d pod(s): %s", len(new_pods), kueue.held(queue.workload, queue.name))
        return []
    flavors = {}
    for name in sorted({f for names_ in queue.workload.flavors.values() for f in names_}):
        found = ignore(404, kube.custom.get_cluster_custom_object, kueue.GROUP, kueue.VERSION, kueue.FLAVORS, name)
        if found is None:
            raise kopf.TemporaryError(f"ResourceFlavor {name}, which Kueue assigned to the job, is not there; "
                                      "trying again", delay=INTERVAL)
        flavors[name] = found
    return kueue.place(new_pods, kueue.placements(queue.workload, flavors))


def sync_workload(kube: Kube, namespace: str, queue: Queue, plan: Plan, pods_left: int,
                   now: dt.datetime) -> bool:
    """Write back into the job's Workload what Kueue needs from its owner (kueue.status_patch): the quota of an
    evicted job given back once all its pods are gone, Finished, PodsReady; and its spec: runPolicy.suspend as
    spec.active (plan.workload_spec, kueue.active_update), the LocalQueue renamed while it waits. A conflict
    (Kueue wrote in between) is left for the next tick, which reads the Workload again. Returns whether the job is
    owed a next tick (no rest): its Workload is still to be made, or a status write was due this tick."""
    wl = queue.workload
    if wl is None:
        return plan.status.get("phase") not in TERMINAL
    args = (kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, wl.name)
    patch = kueue.status_patch(wl, plan.status.get("phase", ""), pods_left, plan.status.get("message", ""), now)
    if patch is not None:
        ignore((404, 409), kube.custom.patch_namespaced_custom_object_status, *args, patch)
    spec = dict((plan.workload_spec or {}).get("spec") or {})
    if wl.queue != queue.name and not wl.quota_reserved:  # Kueue refuses a new queueName while quota is reserved
        spec["queueName"] = queue.name
    if spec:
        ignore((404, 409), kube.custom.patch_namespaced_custom_object, *args, {"spec": spec})
    return patch is not None
