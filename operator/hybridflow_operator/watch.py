"""kopf's watches of the jobs' children: one pod watch and one per followed kind (FOLLOWED_CHILDREN) feed in-memory
indexes by job, so that a tick reads its job's pods, Services, NetworkPolicies and Workload without a request;
and what a tick observes from them (`observed_pods`, `lost_children`, `job_workload`)."""
from __future__ import annotations

import datetime as dt
import time
from typing import Any

import kopf

from hybridflow.api.errors import last_error
from hybridflow_operator import kueue
from hybridflow_operator import manifests as mf
from hybridflow_operator.environments import TOKEN_UID_ANNOTATION
from hybridflow_operator.kube import controllers
from hybridflow_operator.plan import PodPhase, PodView, parse_time
from hybridflow_operator.state import CREATED_GRACE_SECONDS, KUEUE, JobMemory, shared_of

def pod_view(pod: dict[str, Any]) -> PodView:
    meta, st = pod["metadata"], pod.get("status") or {}
    labels = meta.get("labels") or {}
    message = st.get("message") or st.get("reason") or ""
    exit_code, output = None, ""
    for kind, key in (("init container", "initContainerStatuses"), ("container", "containerStatuses")):
        for cs in st.get(key) or []:
            term = (cs.get("state") or {}).get("terminated")
            if term and not term.get("exitCode") and kind == "container":
                output = output or term.get("message") or ""
            if term and term.get("exitCode"):
                exit_code = int(term["exitCode"])
                message = f"{kind} {cs['name']} exited with code {exit_code} ({term.get('reason', 'Error')})"
                if term.get("message"):
                    message += f": {last_error(term['message'])}"
    phase = st.get("phase") or PodPhase.PENDING
    return PodView(
        name=meta["name"],
        role=labels.get(mf.LABEL_ROLE, "worker"),
        generation=int(labels.get(mf.LABEL_GENERATION, "0")),
        phase=phase,
        deleting=bool(meta.get("deletionTimestamp")),
        message=message,
        exit_code=exit_code,
        waiting=_waiting(st) if phase == PodPhase.PENDING else "",
        disruption=next((c.get("reason") or "DisruptionTarget" for c in st.get("conditions") or []
                         if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), ""),
        deletion_deadline=_time(meta.get("deletionTimestamp")),
        pending_since=_time(meta.get("creationTimestamp")) if phase == PodPhase.PENDING else None,
        pool=labels.get(mf.LABEL_POOL, ""),
        index=int(labels.get(mf.LABEL_INDEX, "-1")),
        token_uid=(meta.get("annotations") or {}).get(TOKEN_UID_ANNOTATION, ""),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or []),
        output=output,
    )


# Container waiting reasons that mean "will not start without someone changing something".
STUCK_WAITING = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError", "RunContainerError", "ErrImageNeverPull")


def _waiting(st: dict[str, Any]) -> str:
    """Why a Pending pod is not starting, in the kubelet's or the scheduler's words; "" if nothing is wrong yet."""
    for key in ("initContainerStatuses", "containerStatuses"):
        for cs in st.get(key) or []:
            w = (cs.get("state") or {}).get("waiting") or {}
            if w.get("reason") in STUCK_WAITING:
                return f"{w['reason']}: container {cs.get('name')}: {w.get('message', '')}".rstrip(": ")[:500]
    for c in st.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return f"Unschedulable: {c.get('message', '')}"[:500]
    return ""


def _time(value: Any) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value
    try:
        return parse_time(value) if value else None
    except ValueError:
        return None


@kopf.index("pods", labels={mf.LABEL_JOB: kopf.PRESENT})
def job_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, memo: kopf.Memo,
             **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """The jobs' pods by (namespace, job), kept current by one pod watch: what a tick used to LIST; and the pods
    seen disrupted (Shared.disrupted)."""
    view = pod_view(body)
    if view.disruption:
        seen = shared_of(memo).disrupted.setdefault((namespace, labels[mf.LABEL_JOB]), {})
        seen[view.name] = (view.generation, view.disruption)
    st = body.get("status") or {}
    owners = [r.get("uid") for r in body.get("metadata", {}).get("ownerReferences") or [] if r.get("controller")]
    return {(namespace, labels[mf.LABEL_JOB]): {"view": view, "podIP": st.get("podIP"),
                                                "owner": owners[0] if owners else None}}


# The static children a live gang cannot do without, by kind: kopf's (group, version, plural) of each. A job's
# children are created once per gang start (`create_children`), so one deleted while the job lives (by a namespace
# admin, a cleanup script, a mistake) would stay gone until the next gang start: without its NetworkPolicy the
# job's pods lose their ingress and egress fence, without its head Service the head's name stops resolving (a Ray
# worker reconnecting to the GCS cannot find it). These two are followed by a watch each, and one gone is made
# again at the job's next tick (`lost_children`).
#
# Why watches, not a periodic GET of each child (one per child a minute is ~70 requests a second at 1,000 running
# jobs, and leaves a job unfenced for up to that minute): the API server filters each watch by the job label
# (`watch_children_only`, kopf's server-side `labelSelector`), so the operator receives the jobs' own Services and
# NetworkPolicies only, once at start (a LIST) and then only their changes: no request at all while nothing
# changes, resting jobs included, and a deletion noticed within a tick. It costs `list`/`watch` on two kinds that
# hold nothing secret (the chart grants them for this alone). Not followed: the Ray token Secret (the operator holds
# no verb that reads a Secret, and a token made again mid-generation would not be the one the running Ray cluster
# knows), the spec ConfigMap and the PodGroup (read only when pods are created or scheduled, never by running ones;
# and `list` on ConfigMaps, which RBAC cannot narrow to a label, would let the operator read every tenant's). Those
# are checked again at every gang start, a resume included (`create_children`).
FOLLOWED_CHILDREN = {"Service": ("v1", "services"), "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies")}


def watch_children_only(settings: kopf.OperatorSettings) -> None:
    """Have the API server send the pod watch (`job_pods`) and the followed kinds' watches only objects carrying the
    job label (a label only the operator may set), instead of every pod, Service and NetworkPolicy of every
    namespace served: on a busy cluster the pod watch alone would stream every pod's every status change."""
    for resource in (("v1", "pods"), *FOLLOWED_CHILDREN.values(), *([WORKLOADS] if KUEUE else [])):
        settings.watching.label_selectors[resource] = mf.LABEL_JOB


def _followed_child(kind: str, namespace: str, name: str, labels: kopf.Labels,
                    body: kopf.Body) -> dict[tuple[str, str], dict[str, Any]]:
    """One followed child, by its job's (namespace, job): its kind, name and controller (the job's uid if it is the
    job's own)."""
    owners = controllers(body)
    return {(namespace, labels[mf.LABEL_JOB]): {"kind": kind, "name": name, "owner": owners[0] if owners else None}}


@kopf.index(*FOLLOWED_CHILDREN["Service"], labels={mf.LABEL_JOB: kopf.PRESENT})
def job_services(namespace: str, name: str, labels: kopf.Labels, body: kopf.Body,
                 **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """The jobs' head Services, kept current by one watch (FOLLOWED_CHILDREN)."""
    return _followed_child("Service", namespace, name, labels, body)


@kopf.index(*FOLLOWED_CHILDREN["NetworkPolicy"], labels={mf.LABEL_JOB: kopf.PRESENT})
def job_network_policies(namespace: str, name: str, labels: kopf.Labels, body: kopf.Body,
                         **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """The jobs' NetworkPolicies, kept current by one watch (FOLLOWED_CHILDREN)."""
    return _followed_child("NetworkPolicy", namespace, name, labels, body)


WORKLOADS = (kueue.GROUP, kueue.VERSION, kueue.WORKLOADS)


def job_workloads(namespace: str, labels: kopf.Labels, body: kopf.Body,
                  **_: Any) -> dict[tuple[str, str], kueue.Admission]:
    """The jobs' Kueue Workloads, as read from one watch (registered only with Kueue on): what Kueue decided is
    seen as soon as it writes it, and a queued job rests until its Workload changes (`job_rests`)."""
    return {(namespace, labels[mf.LABEL_JOB]): kueue.read_workload(dict(body))}


if KUEUE:
    kopf.index(*WORKLOADS, labels={mf.LABEL_JOB: kopf.PRESENT})(job_workloads)


def job_workload(index: kopf.Index | None, namespace: str, name: str, uid: str | None) -> kueue.Admission | None:
    """The job's own Workload as last seen (only one it controls counts, as for pods), or None."""
    found = [w for w in (index or {}).get((namespace, name), []) if uid and w.owner == uid]
    return found[0] if found else None


def lost_children(followed: list[kopf.Index], namespace: str, name: str, uid: str | None,
                   memory: JobMemory) -> set[tuple[str, str]]:
    """(kind, name) of the job's followed children that the watch showed and shows no more: deleted while the job
    lives. In memory only (no request). Only children the job controls count, so an object planted under a child's
    name is lost, not adopted (its create answers 409 and `_check_existing` fails the job, as at any create). A child
    counts as lost only after it was seen: one this operator has just created (`create_children` forgets it), whose
    ADDED event the watch has not brought yet, is not created twice, and one never seen (no watch) is left as
    before."""
    present = {(e["kind"], e["name"]) for index in followed for e in index.get((namespace, name), [])
               if uid and e["owner"] == uid}
    seen = memory.seen_children
    seen |= present
    return seen - present


def observed_pods(index: kopf.Index, namespace: str, name: str, uid: str | None,
                   memory: JobMemory) -> list[dict[str, Any]]:
    """The job's pods from the index, plus pods this operator created that the watch has not shown yet. Only pods
    the job controls count: anyone who may create pods could label one as this job's head or a failed worker."""
    seen = [p for p in index.get((namespace, name), []) if uid and p.get("owner") == uid]
    names = {p["view"].name for p in seen}
    created = memory.created
    now = time.monotonic()
    for pod_name, (when, view) in list(created.items()):
        if pod_name in names or now - when > CREATED_GRACE_SECONDS:
            del created[pod_name]
        else:
            seen.append({"view": view, "podIP": None, "owner": uid})
    return seen
