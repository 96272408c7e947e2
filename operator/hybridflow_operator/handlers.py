"""kopf handlers: read the job and its pods, call the pure state machine, write what it planned.

One path reconciles a job: a timer, which kopf never runs twice at once for the same object (an `on.create`
beside it used to overlap the first tick and start jobs twice). Children are followed from kopf's in-memory index
of the jobs' pods, fed by one watch, instead of a LIST per job per tick, and the jobs' Services and NetworkPolicies
likewise, so that one deleted while its job lives is made again (FOLLOWED_CHILDREN); the accepted spec is read
once. Between a status write and the watch event that brings it back, the timer sees its own last write
(`_known_status`), so a fast tick never acts on a stale phase. Everything stays idempotent: objects are created by
name, and one already there (409) counts only when it is this job's (its controller ownerReference), else the job
fails naming it; children are deleted only when the job controls them, with their uid as the delete's
precondition. So an operator that restarts mid-job creates nothing twice, and an object that merely has a child's
name is never adopted nor deleted.
"""
from __future__ import annotations

import asyncio
import copy
import datetime as dt
import functools
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple, cast

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from hybridflow.api import API_GROUP as GROUP
from hybridflow.api import PLURAL, VERSION, RLHFJob, SpecError, parse_job
from hybridflow.api.agents import sandbox_replicas
from hybridflow.api.errors import last_error
from hybridflow.api.storage import is_url
from hybridflow.api.status import TERMINAL, JobStatus, Phase
from hybridflow_operator import kueue
from hybridflow_operator import manifests as mf
from hybridflow_operator.environments import (PoolPlan, environment_children, environment_policy_name,
                                              environment_pod, plan_pool, TOKEN_UID_ANNOTATION)
from hybridflow_operator.kube import API_TIMEOUT, Kube, controllers, ignore
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator import plan_pod as pp
from hybridflow_operator.phases import (Plan, PodPhase, PodView, Queue, admit_gang, backoff, decide, fail, invalid, iso,
                                         names_taken, parse_time, refused, resting, set_condition)
from hybridflow_operator.policy import Policy, queue_problem, unmarked, violations
from hybridflow_operator.progress import SANDBOX_MISSING, Poller, merge_progress, parse_progress

INTERVAL = float(os.environ.get("HYBRIDFLOW_RECONCILE_INTERVAL", "5"))
# Jobs labelled kueue.x-k8s.io/queue-name are admitted through Kueue (the chart's kueue.enabled): the operator then
# follows the jobs' Workloads with a watch, and holds the rights to make them (the chart grants them with it).
KUEUE = os.environ.get("HYBRIDFLOW_KUEUE", "").lower() in ("1", "true", "yes")
# The longest a job waiting for something outside it (a PVC, the reward ConfigMap, a quota) goes between looks.
RETRY_MAX_SECONDS = 60.0
log = logging.getLogger("hybridflow.operator")

# How long a pod this operator created counts as existing (Pending) while the pod watch has not shown it yet.
CREATED_GRACE_SECONDS = 60.0


@dataclass
class Shared:
    """What the handlers of every job share, made once by `configure` and reached through kopf's memo: kopf gives
    each object a shallow copy of the operator's memo, so `memo["shared"]` is this one object in every handler (the
    timer's, the pod index's, the deletion's) while each job's own keys ("written", "accepted", ...) stay its own.
    No module state: a test or a second operator in one process gets its own."""
    kube: Kube
    policy: Policy
    metrics: OperatorMetrics
    # The operator's own namespace: it polls the drivers' metrics, so the jobs' NetworkPolicies admit it.
    operator_namespace: str = ""
    # Every Running job's progress fetch, by a few threads shared by all jobs (a slow driver holds no tick).
    poller: Poller = field(default_factory=Poller)
    # Pods seen with a DisruptionTarget condition, by job: (namespace, job) -> pod -> (generation, reason). An
    # evicted pod may be gone before the next tick looks, and its gang's restart must still not use up backoffLimit.
    disrupted: dict[tuple[str, str], dict[str, tuple[int, str]]] = field(default_factory=dict)
    # Namespaces' verdicts (`_acts_in`): namespace -> (when read, time.monotonic(); acts there), and those whose
    # jobs were left alone, each logged once.
    namespaces: dict[str, tuple[float, bool]] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)


def _shared(memo: kopf.Memo) -> Shared:
    return memo["shared"]


def tune_kopf(settings: kopf.OperatorSettings) -> None:
    """kopf settings that decide how fast a deleted job is released.

    On deletion kopf stops the job's timer and cannot cancel a tick that is running (timers are never cancelled),
    so it re-checks only every `cancellation_polling` seconds, 60 by default: a job deleted mid-reconcile, as a
    TTL deletion always is (it is issued from the tick), kept its finalizer for a minute. Waiting briefly for the
    tick to end, and re-checking every second after that, releases it as soon as the tick returns."""
    settings.background.instant_exit_timeout = 2.0
    settings.background.cancellation_polling = 1.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330  # a watch the server silently dropped is noticed, and re-opened
    settings.networking.request_timeout = API_TIMEOUT
    settings.networking.connect_timeout = 10
    tune_kopf(settings)
    watch_children_only(settings)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    shared = memo["shared"] = Shared(kube=Kube(client.ApiClient()), policy=Policy.from_env(),
                                     metrics=OperatorMetrics(),
                                     operator_namespace=os.environ.get("HYBRIDFLOW_OPERATOR_NAMESPACE", ""))
    port = int(os.environ.get("HYBRIDFLOW_OPERATOR_METRICS_PORT", "8080"))
    if port:
        shared.metrics.serve(port, os.environ.get("HYBRIDFLOW_OPERATOR_METRICS_ADDRESS", "0.0.0.0"))


def _pod_view(pod: dict[str, Any]) -> PodView:
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
    view = _pod_view(body)
    if view.disruption:
        seen = _shared(memo).disrupted.setdefault((namespace, labels[mf.LABEL_JOB]), {})
        seen[view.name] = (view.generation, view.disruption)
    st = body.get("status") or {}
    owners = [r.get("uid") for r in body.get("metadata", {}).get("ownerReferences") or [] if r.get("controller")]
    return {(namespace, labels[mf.LABEL_JOB]): {"view": view, "podIP": st.get("podIP"),
                                                "owner": owners[0] if owners else None}}


# The static children a live gang cannot do without, by kind: kopf's (group, version, plural) of each. A job's
# children are created once per gang start (`_create_children`), so one deleted while the job lives (by a namespace
# admin, a cleanup script, a mistake) would stay gone until the next gang start: without its NetworkPolicy the
# job's pods lose their ingress and egress fence, without its head Service the head's name stops resolving (a Ray
# worker reconnecting to the GCS cannot find it). These two are followed by a watch each, and one gone is made
# again at the job's next tick (`_lost_children`).
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
# are checked again at every gang start, a resume included (`_create_children`).
FOLLOWED_CHILDREN = {"Service": ("v1", "services"), "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies")}
# Rests (phases.resting) of a Pending job, whose pods may be on their way: a followed child lost ends them. A
# suspended or finished job has no running pod to fence; a resume is a gang start, which checks its children anyway.
PENDING_RESTS = ("inputs", "refused")


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
    seen as soon as it writes it, and a queued job rests until its Workload changes (`_rests`)."""
    return {(namespace, labels[mf.LABEL_JOB]): kueue.read_workload(dict(body))}


if KUEUE:
    kopf.index(*WORKLOADS, labels={mf.LABEL_JOB: kopf.PRESENT})(job_workloads)


def _workload(index: kopf.Index | None, namespace: str, name: str, uid: str | None) -> kueue.Admission | None:
    """The job's own Workload as last seen (only one it controls counts, as for pods), or None."""
    found = [w for w in (index or {}).get((namespace, name), []) if uid and w.owner == uid]
    return found[0] if found else None


def _lost_children(followed: list[kopf.Index], namespace: str, name: str, uid: str | None,
                   memo: kopf.Memo) -> set[tuple[str, str]]:
    """(kind, name) of the job's followed children that the watch showed and shows no more: deleted while the job
    lives. In memory only (no request). Only children the job controls count, so an object planted under a child's
    name is lost, not adopted (its create answers 409 and `_check_existing` fails the job, as at any create). A child
    counts as lost only after it was seen: one this operator has just created (`_create_children` forgets it), whose
    ADDED event the watch has not brought yet, is not created twice, and one never seen (no watch) is left as
    before."""
    present = {(e["kind"], e["name"]) for index in followed for e in index.get((namespace, name), [])
               if uid and e["owner"] == uid}
    seen: set[tuple[str, str]] = memo.setdefault("seen_children", set())
    seen |= present
    return seen - present


def _observed_pods(index: kopf.Index, namespace: str, name: str, uid: str | None,
                   memo: kopf.Memo) -> list[dict[str, Any]]:
    """The job's pods from the index, plus pods this operator created that the watch has not shown yet. Only pods
    the job controls count: anyone who may create pods could label one as this job's head or a failed worker."""
    seen = [p for p in index.get((namespace, name), []) if uid and p.get("owner") == uid]
    names = {p["view"].name for p in seen}
    created: dict[str, tuple[float, PodView]] = memo.setdefault("created", {})
    now = time.monotonic()
    for pod_name, (when, view) in list(created.items()):
        if pod_name in names or now - when > CREATED_GRACE_SECONDS:
            del created[pod_name]
        else:
            seen.append({"view": view, "podIP": None, "owner": uid})
    return seen


def _known_status(body: kopf.Body, memo: kopf.Memo) -> JobStatus:
    """The job's status: what this operator last wrote, since it is the status's only writer and the watch may
    still deliver versions from before that write (kopf's own annotation patches make such versions routinely);
    the body's status only before the first write of this process (a new or restarted operator)."""
    written = memo.get("written")
    if written is not None:
        return copy.deepcopy(written)
    return cast(JobStatus, {k: v for k, v in dict(body.get("status") or {}).items() if k != "kopf"})


def _accepted_job(kube: Kube, live: RLHFJob, uid: str | None, status: JobStatus,
                  memo: kopf.Memo) -> tuple[RLHFJob, bool]:
    """The spec the job was accepted with (its ConfigMap, read once), with the live runPolicy; and whether other
    fields changed. The ConfigMap is trusted only when this job owns it and holds what the operator wrote: the digest
    the operator put into status before creating it (the ConfigMap is immutable, but could be deleted and planted
    again). Anyone who may create ConfigMaps could otherwise choose what the pods run. Before the ConfigMap exists
    the live spec is the one being accepted, unless a digest was recorded already: then the live spec must still be
    exactly that one (a create refused or cut short is retried), never an edited one. A live spec that names what
    its pods may not have (mf.resolved_job: another namespace's checkpoint, object storage without credentials)
    is refused at acceptance, as a SpecError naming the field; once accepted, such an edit is only a change (the
    job keeps running what it was accepted with, as with any other edit), never a reason to fail it."""
    if "accepted" not in memo:
        namespace = mf.job_namespace(live)
        name = mf.names(live.metadata.name)["configmap"]
        cm = kube.read("ConfigMap", namespace, name)
        known = status.get("acceptedSpecDigest")
        if cm is None:
            if known and known != mf.content_digest(mf.spec_text(live)):
                raise SpecError(f"ConfigMap {namespace}/{name}, which held the spec this job was accepted with, is "
                                "gone, and the job's spec is no longer that one; delete the job and create it again")
            mf.resolved_job(live)  # not yet accepted: what it may not have fails it now (SpecError)
            return live, False
        _check_owner("ConfigMap", namespace, name, cm, uid)
        text = (cm.get("data") or {}).get(mf.SPEC_KEY)  # JSON only: the operator never parses YAML it did not write
        digest = mf.content_digest(text) if text is not None else f"none (no key {mf.SPEC_KEY})"
        if known != digest:
            raise SpecError(f"ConfigMap {namespace}/{name} does not hold the spec this job started with (digest "
                            f"{digest}, accepted {known or 'none'}); delete the job and create it again")
        memo["accepted"] = parse_job(json.loads(text), "accepted spec")
    if "accepted_fields" not in memo:  # the accepted spec never changes: resolved once, not at every tick
        try:  # resolved: a spec accepted by an older operator (its paths resolved otherwise) is not an edit
            memo["accepted_fields"] = _spec_fields(mf.resolved_job(memo["accepted"]))
        except SpecError:
            memo["accepted_fields"] = None
    accepted = memo["accepted"].model_copy(deep=True)
    accepted.spec.run_policy = live.spec.run_policy
    if accepted.spec.rollout_pool is not None and live.spec.rollout_pool is not None:  # (the CRD keeps it there)
        accepted.spec.rollout_pool = live.spec.rollout_pool
    try:
        changed = memo["accepted_fields"] is None or _spec_fields(mf.resolved_job(live)) != memo["accepted_fields"]
    except SpecError:  # an edit naming what the pods may not have: they never get it (the accepted spec runs)
        changed = True
    return accepted, changed


def _spec_fields(job: RLHFJob) -> dict[str, Any]:
    """What may not change on a live job: all but runPolicy and an elastic rollout pool's size and bounds. A
    checkpoint directory on the claim is the operator's choice (jobs started before it was per-job keep theirs), so
    it is left out; an object-storage URL is the author's and counts (editing it must not pass unnoticed while the
    job goes on writing to the old bucket)."""
    spec = job.spec.model_dump(exclude={"run_policy", "rollout_pool"})
    if not is_url(job.spec.trainer.checkpoint_dir):
        spec["trainer"].pop("checkpoint_dir", None)
    return spec


def _missing_inputs(kube: Kube, policy: Policy, job: RLHFJob, namespace: str,
                    status: JobStatus) -> tuple[str, dict[str, str] | None]:
    """What the job's pods would mount but does not exist, or exists unmarked for jobs: its PVCs, and until its code
    files were copied (status.codeDigests) the code ConfigMap (kubernetes.rewardConfigMap) and each file's key in
    it; and the files' texts by key, when all are found and yet to be copied. Checked before pods are created, so
    the job waits with a reason instead of pods stuck creating. (The Secrets the spec names, rayAuthSecret and
    checkpointSecret, are not looked at: the operator never reads Secrets; the admission policy checks that the
    job's author may read them, and a missing one keeps the pods in CreateContainerConfigError, which the job's
    PodsStarting condition reports. An object-storage trainer.checkpointDir (s3://...) needs no checkpointPvc.)"""
    k8s = job.spec.kubernetes
    problems = []
    for spec_field, claim in (("checkpointPvc", k8s.checkpoint_pvc), ("modelPvc", k8s.model_pvc),
                         ("dataPvc", k8s.data_pvc)):
        if not claim:
            continue
        pvc = ignore(404, kube.core.read_namespaced_persistent_volume_claim, claim, namespace)
        if pvc is None:
            problems.append(f"spec.kubernetes.{spec_field}: PersistentVolumeClaim '{claim}' not found in namespace "
                            f"{namespace}; create it")
        elif why := unmarked("PersistentVolumeClaim", f"spec.kubernetes.{spec_field}", claim, pvc.metadata.labels, policy):
            problems.append(why)
    files = None
    if k8s.reward_config_map and _code_digests(status, mf.reward_key(job)) is None:
        why, files = _code_files(kube, policy, job, namespace)
        problems += [why] if why else []
    return "; ".join(problems), files


def _code_files(kube: Kube, policy: Policy, job: RLHFJob, namespace: str) -> tuple[str, dict[str, str] | None]:
    """(what is wrong, the code files' texts by key) from kubernetes.rewardConfigMap: every key the job names
    (mf.code_keys: the reward function's, the tools file's, the environment file's). Its mark for jobs is checked
    before anything about its content: the keys of a ConfigMap its owner did not mark are not this job's to list."""
    name, keys = job.spec.kubernetes.reward_config_map, mf.code_keys(job)
    cm = kube.read("ConfigMap", namespace, name)
    if cm is None:
        args = " ".join(f"--from-file={key}" for key in keys) or "--from-file=my_reward.py"
        return (f"spec.kubernetes.rewardConfigMap: ConfigMap '{name}' not found in namespace {namespace}; create it, "
                f"e.g. kubectl create configmap {name} {args}"), None
    meta, data = cm.get("metadata") or {}, cm.get("data") or {}
    if why := unmarked("ConfigMap", "spec.kubernetes.rewardConfigMap", name, meta.get("labels"), policy):
        return why, None
    if missing := [f"{field}: ConfigMap '{name}' has no key '{key}' (its keys: {', '.join(sorted(data)) or 'none'})"
                   for key, field in keys.items() if key not in data]:
        return "; ".join(missing), None
    files = {key: data[key] for key in keys}
    if why := mf.code_copy_problem(files):
        return why, None
    return "", files


def _code_digests(status: JobStatus, reward_key: str) -> dict[str, str] | None:
    """The code files' digests status recorded when they were first found (None before): status.codeDigests, or for
    a job accepted when only its reward file was copied, status.rewardDigest under the reward file's key."""
    if (digests := status.get("codeDigests")) is not None:
        return dict(digests)
    if reward_key and (reward := status.get("rewardDigest")):
        return {reward_key: reward}
    return None


def _check_owner(kind: str, namespace: str, name: str, obj: dict[str, Any], uid: str | None) -> None:
    """A child's name is no proof: an object found under it must be controlled by this job, else the job fails
    naming it (whoever made it could otherwise choose what the job's pods run, or who may reach them)."""
    owners = controllers(obj)
    if not uid or owners != [uid]:
        raise SpecError(f"{kind} {namespace}/{name} exists but was not made for this job (its owner: "
                        f"{owners[0] if owners else 'none'}); the job cannot start with a child it did not make. "
                        f"Delete that {kind}, or give the job another name")


# A cluster-wide install acts only in namespaces carrying Policy.namespace_label: each namespace's labels are read
# (`get namespaces`, the one namespace asked about) and kept this long, so a label removed stops its jobs' ticks
# within that time, and a namespace labelled later is picked up at its jobs' next event (kopf re-lists them at
# every watch restart, 5 minutes at most).
NAMESPACE_TTL = 30.0


def _acts_in(memo: kopf.Memo, namespace: str | None = None, **_: Any) -> bool:
    """Whether the operator may act in the namespace: always when the install names its namespaces (kopf watches
    only those), else only when the namespace carries the label. kopf's `when` filter of the timer and the deletion
    handler too: a job elsewhere gets no finalizer, no tick, nothing written."""
    shared = _shared(memo)
    policy = shared.policy
    if not policy.namespace_label or not namespace:
        return True
    now = time.monotonic()
    known = shared.namespaces.get(namespace)
    if known is None or now - known[0] > NAMESPACE_TTL:
        try:
            found = ignore(404, shared.kube.core.read_namespace, namespace, _request_timeout=min(API_TIMEOUT, 5.0))
        except Exception as err:  # noqa: BLE001 - cannot tell: act as before, or not at all; ask again next time
            log.warning("cannot read namespace %s (%s); acting there as %s", namespace, err,
                        "before" if known else "not yet")
            return bool(known and known[1])
        known = (now, policy.acts_in(None if found is None else (found.metadata.labels or {})))
        shared.namespaces[namespace] = known
    if not known[1] and namespace not in shared.skipped:
        shared.skipped.add(namespace)
        log.warning("namespace %s does not carry %s: the operator leaves its RLHFJobs alone (kubectl label "
                    "namespace %s %s)", namespace, policy.namespace_label, namespace, policy.namespace_label)
    elif known[1]:
        shared.skipped.discard(namespace)
    return known[1]


@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL, when=_acts_in)
def reconcile(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, job_pods: kopf.Index,
              job_services: kopf.Index, job_network_policies: kopf.Index, job_workloads: kopf.Index | None = None,
              **_: Any) -> None:
    t0, metrics = time.perf_counter(), _shared(memo).metrics
    try:
        _reconcile(body, name, namespace, memo, job_pods, [job_services, job_network_policies], job_workloads)
    except Exception:
        metrics.reconcile_errors.inc()
        raise
    finally:
        metrics.reconcile.observe(time.perf_counter() - t0)


class _Resting(NamedTuple):
    """A job resting (phases.resting): what it waits for, the job's resourceVersion when it began (any change to
    the object, its spec or status, ends the rest: kopf's timer body is live, fed by the watch), and when the rest
    ends by itself (time.monotonic(); None: only a change ends it)."""
    why: str
    version: str | None
    until: float | None
    workload: kueue.Admission | None = None  # a queued job's Workload when the rest began: a change ends it


def _rests(body: kopf.Body, memo: kopf.Memo, lost: Callable[[], set[tuple[str, str]]],
           workload: Callable[[], kueue.Admission | None]) -> bool:
    """Whether this tick has nothing to do: the job rests, unchanged since, and its time is not up. No API call,
    no parse, no decide: 5,000 suspended jobs at a 5 s interval are 1,000 ticks a second (a job waiting for a PVC
    used to make 8 requests at each). A Pending job's rest also ends when one of its followed children is gone
    (`lost`, from the watches' index: still no request), so that the tick makes it again; no other event of its
    children ends a rest."""
    rest = memo.get("rest")
    if rest is None:
        return False
    if body["metadata"].get("resourceVersion") != rest.version:  # edited (e.g. unsuspended): act, back off anew
        memo.pop("rest", None)
        memo.pop("rest_tries", None)
        return False
    if rest.until is not None and time.monotonic() >= rest.until:
        memo.pop("rest", None)
        return False
    if rest.why in PENDING_RESTS and lost():
        memo.pop("rest", None)
        return False
    if rest.why == "queued" and workload() != rest.workload:  # Kueue decided (or the Workload went)
        memo.pop("rest", None)
        return False
    return True


def _rest_after(body: kopf.Body, memo: kopf.Memo, job: RLHFJob | None, status: JobStatus, plan: Plan,
                now: dt.datetime, queue: Queue | None = None) -> None:
    """After a tick that did nothing (no write, create, delete or event), let the job rest if phases.resting says
    it has nothing to do: until a change when suspended or finished without a TTL; until its TTL; when it waits for
    something outside it, for a backoff (INTERVAL doubling up to RETRY_MAX_SECONDS, never past its deadline)."""
    idle = (plan.status == status and not plan.delete_pods and plan.create_gang is None and not plan.events
            and not plan.delete_job)
    rest = resting(job, plan.status, now) if idle else None
    if rest is None:
        memo.pop("rest", None)
        memo.pop("rest_tries", None)
        return
    tries = memo.get("rest_tries", 0) if rest.retry else 0
    wait = backoff(tries, INTERVAL, RETRY_MAX_SECONDS) if rest.retry else None
    if rest.at_most is not None:
        wait = rest.at_most if wait is None else min(wait, rest.at_most)
    memo["rest_tries"] = tries + 1
    memo["rest"] = _Resting(rest.why, body["metadata"].get("resourceVersion"),
                            None if wait is None else time.monotonic() + wait, queue.workload if queue else None)


def _reconcile(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, index: kopf.Index,
               followed: list[kopf.Index], workloads: kopf.Index | None = None) -> None:
    if body["metadata"].get("deletionTimestamp"):
        return  # being deleted: `cleanup` owns it now; a tick must not create children after cleanup has run
    shared = _shared(memo)
    if not _acts_in(memo, namespace):
        return  # the namespace lost its label since kopf started this timer
    uid = body["metadata"].get("uid")
    if _rests(body, memo, functools.partial(_lost_children, followed, namespace, name, uid, memo),
              functools.partial(_workload, workloads, namespace, name, uid)):
        shared.metrics.resting_ticks.inc()
        return
    now = dt.datetime.now(dt.timezone.utc)
    status = _known_status(body, memo)
    job: RLHFJob | None = None
    error: str | None = None
    queue_name = _queue_of(body, status)
    try:
        live = parse_job({"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                          "metadata": {"name": name, "namespace": namespace}, "spec": dict(body.get("spec") or {})},
                         f"RLHFJob {namespace}/{name}")
        accepted, changed = _accepted_job(shared.kube, live, uid, status, memo)
        job = pp.with_plan(accepted, status)  # placement auto: its recorded plan laid over it (plan_pod.py)
        if not status.get("phase"):  # checked once, at acceptance: a running job is never failed
            _check_queueable(job, queue_name, shared.policy)
    except SpecError as err:
        error, changed, job, accepted = str(err), False, None, None
    queue = Queue(queue_name, _workload(workloads, namespace, name, uid)) if queue_name and KUEUE else None
    asked = None  # an elastic rollout pool's size, when more than Kueue admitted (the job runs at what it admitted)
    if job is not None and queue is not None:
        job, asked = kueue.within_admission(job, queue.workload)
    pods = _observed_pods(index, namespace, name, uid, memo)
    # The environment pool's pods live beside the gang, not in it: decided on apart (environments.plan_pool).
    pool_views = [p["view"] for p in pods if p["view"].role == mf.ENVIRONMENT_ROLE]
    views = [p["view"] for p in pods if p["view"].role not in (mf.ENVIRONMENT_ROLE, pp.PLAN_ROLE)]
    gen = int(status.get("restarts", 0))
    disrupted = {pod: why for pod, (g, why) in shared.disrupted.get((namespace, name), {}).items() if g == gen}
    plan = decide(job, error, status, views, now, disrupted=disrupted, queue=queue, rollout_asked=asked)
    active_patch = None
    if job is not None and queue is not None:
        plan.status["queueName"] = queue.name
        active_patch, recorded = kueue.active_update(queue.workload, job.spec.run_policy.suspend,
                                                     status.get("workloadActive"))
        if recorded is not None:
            plan.status["workloadActive"] = recorded
    reward: dict[str, str] | None = None  # the code files (kubernetes.rewardConfigMap), read to be copied
    if job is not None and plan.create_gang is not None:  # about to create pods: are their inputs there?
        missing, reward = _missing_inputs(shared.kube, shared.policy, job, namespace, status)
        plan = admit_gang(plan, status, views, now, missing, violations(job, shared.policy))
    plan = pp.plan_step(plan, job, next((p["view"] for p in pods if p["view"].role == pp.PLAN_ROLE), None), now,
                        unqueued=queue is not None and queue.workload is None)
    if job is not None and queue is not None and not status.get("phase") and plan.status.get("phase") == Phase.QUEUED \
            and (broken := violations(job, shared.policy)):  # judged before it queues: Kueue's quota is not spent
        plan = admit_gang(replace(plan, create_gang=0), status, views, now, None, broken)  # on a job never to run
    if job is not None and plan.create_static and not plan.status.get("acceptedSpecDigest"):
        # Recorded before the ConfigMap is created, so a ConfigMap planted under its name is told apart by content.
        plan.status["acceptedSpecDigest"] = mf.content_digest(mf.spec_text(job))
    if reward is not None and plan.create_gang is not None:  # likewise, before their copy is created
        plan.status["codeDigests"] = mf.code_digests(reward)
        if (key := mf.reward_key(job)) in reward:
            plan.status["rewardDigest"] = mf.content_digest(reward[key])

    pool = _plan_pool(job, plan, pool_views, views, now)

    if changed and status.get("phase") not in TERMINAL:
        msg = "spec changed while the job exists; only runPolicy can change: the job keeps its original spec"
        if not any(c.get("reason") == "SpecChangeIgnored" and c.get("status") == "True"
                   for c in plan.status.get("conditions", [])):
            plan.events.append(("Warning", "SpecChangeIgnored", msg))
        set_condition(plan.status, "SpecChangeIgnored", True, "SpecChangeIgnored", msg, now)

    if job is not None and plan.status.get("phase") == Phase.RUNNING:
        _poll_progress(shared.poller, namespace, job, pods, plan.status, now)
    else:
        shared.poller.forget((namespace, name))
    # The status is written before anything is done about it: a tick that fails half-way is redone from the
    # new status (missing pods are created again, stale ones deleted again), never from the old one.
    if plan.status != status:
        _write_status(shared.kube, namespace, name, status, plan.status, memo)
    if job is not None:
        # A followed child gone is made again while the job has (or is about to have) pods: not once it finished,
        # nor while suspended (its resume is a gang start, which checks every child).
        lost = (_lost_children(followed, namespace, name, uid, memo)
                if plan.status.get("phase") not in (*TERMINAL, Phase.SUSPENDED) else set())
        try:
            _create_children(shared, job, uid, plan, pods, memo, first_start=not status.get("phase"), reward=reward,
                             lost=lost, pool=pool, queue=queue, accepted=accepted)
        except PodNamesTaken as err:  # someone else's pods under the names of the job's: said, tried again later
            planned = plan
            plan = names_taken(planned.status, namespace, err.pods, now)
            plan.events[:0] = planned.events
            plan.delete_pods = list(planned.delete_pods)
            if plan.status != planned.status:
                _write_status(shared.kube, namespace, name, planned.status, plan.status, memo)
        except SpecError as err:  # a child that exists but is not this job's: fail now, before any pod runs it
            planned = plan
            plan = invalid(planned.status, str(err), now, views)
            plan.events[:0] = planned.events
            _write_status(shared.kube, namespace, name, planned.status, plan.status, memo)
        except ApiException as err:
            if err.status not in (403, 404, 422):
                raise
            what = getattr(err, "hybridflow_object", "a child object")
            planned = plan
            plan = refused(planned.status, what, err.status, _api_message(err), now, views)
            plan.events[:0] = planned.events
            plan.delete_pods = sorted(set(plan.delete_pods) | set(planned.delete_pods))
            if plan.status != planned.status:
                _write_status(shared.kube, namespace, name, planned.status, plan.status, memo)
    for pod_name in plan.delete_pods:  # each with its own terminationGracePeriodSeconds: a rollout pod's preStop
        memo.setdefault("created", {}).pop(pod_name, None)  # hands its replicas back within it (manifests)
        ignore(404, shared.kube.core.delete_namespaced_pod, pod_name, namespace)
    for etype, reason, message in plan.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    metrics = shared.metrics
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
    owed = False  # the Workload is to be made, or owed a write (a quota to give back): the job may not rest
    if job is not None and queue is not None:
        owed = _sync_workload(shared.kube, namespace, queue, plan, len(pods), now, active_patch)
    if plan.delete_job:
        ignore(404, shared.kube.custom.delete_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)
    if owed:
        memo.pop("rest", None)
        return
    _rest_after(body, memo, job, status, plan, now, queue)


def _check_queueable(job: RLHFJob, queue: str | None, policy: Policy) -> None:
    """A job labelled for a Kueue queue, accepted only where the operator admits jobs through Kueue: anywhere else
    it would run past the queue's quota; and, with kueue.required (policy.queue_problem), one not labelled is not
    accepted at all."""
    if why := queue_problem(queue, policy):
        raise SpecError(why)
    if not queue:
        return
    if not KUEUE:
        raise SpecError(f"metadata.labels[{kueue.QUEUE_LABEL}]: this operator was installed without Kueue (the "
                        "chart's kueue.enabled), so it cannot queue the job; remove the label, or ask the cluster's "
                        "admin to enable it")
    if problems := kueue.podset_problems(job):
        raise SpecError("; ".join(problems))


def _make_workload(kube: Kube, job: RLHFJob, uid: str | None, queue: str, memo: kopf.Memo,
                   runtime_class: str = "") -> None:
    """Create the job's Workload (it has none, or it was deleted), at most once per CREATED_GRACE_SECONDS while the
    watch has not shown it. One found under its name must be the job's own (`_check_owner`). `runtime_class`: the
    sandbox pods' default RuntimeClass (Policy.sandbox_runtime_class), so its podSets are the pods made later."""
    posted = memo.get("workload_posted")
    if posted is not None and time.monotonic() - posted < CREATED_GRACE_SECONDS:
        return
    memo["workload_posted"] = time.monotonic()  # a refused create too is tried again only after the grace
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
            _check_owner("Workload", ns, wl, found, uid)


def _priority(kube: Kube, job: RLHFJob) -> tuple[str, int] | None:
    """(name, value) of runPolicy.priorityClassName, which Kueue orders and preempts the queue's Workloads by (its
    Workload must state the value); None without one, or when it does not exist (the pods would be refused)."""
    name = job.spec.run_policy.priority_class_name
    if not name:
        return None
    found = ignore(404, kube.scheduling.read_priority_class, name)
    return None if found is None else (name, int(found.value))


def _placed(kube: Kube, queue: Queue, new_pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def _sync_workload(kube: Kube, namespace: str, queue: Queue, plan: Plan, pods_left: int, now: dt.datetime,
                   active_patch: dict[str, Any] | None) -> bool:
    """Write back into the job's Workload what Kueue needs from its owner (kueue.status_patch): the quota of an
    evicted job given back once all its pods are gone, Finished, PodsReady; and its spec: runPolicy.suspend as
    spec.active (`active_patch`, kueue.active_update), the LocalQueue renamed while it waits. A conflict (Kueue wrote
    in between) is left for the next tick, which reads the Workload again. Returns whether the job is owed a next
    tick (no rest): its Workload is still to be made, or a status write was due this tick."""
    wl = queue.workload
    if wl is None:
        return plan.status.get("phase") not in TERMINAL
    args = (kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, wl.name)
    patch = kueue.status_patch(wl, plan.status.get("phase", ""), pods_left, plan.status.get("message", ""), now)
    if patch is not None:
        ignore((404, 409), kube.custom.patch_namespaced_custom_object_status, *args, patch)
    spec = dict((active_patch or {}).get("spec") or {})
    if wl.queue != queue.name and not wl.quota_reserved:  # Kueue refuses a new queueName while quota is reserved
        spec["queueName"] = queue.name
    if spec:
        ignore((404, 409), kube.custom.patch_namespaced_custom_object, *args, {"spec": spec})
    return patch is not None


def _queue_of(body: kopf.Body, status: JobStatus) -> str | None:
    """The job's LocalQueue: its label's value when it is accepted, kept in status.queueName for its life (a label
    removed or added later changes nothing: it would let a job run past its queue, or evict a running one); a new
    value while the job still waits for admission moves it to that queue."""
    label = kueue.queue_name(body["metadata"].get("labels"))
    if not status.get("phase"):
        return label
    known = status.get("queueName")
    if known and label and label != known and status.get("phase") == Phase.QUEUED:
        return label
    return known


def _plan_pool(job: RLHFJob | None, plan: Plan, pool_views: list[PodView], views: list[PodView],
               now: dt.datetime) -> PoolPlan:
    """The sandbox pool's part of the tick, folded into the plan: its pods to delete and status.environments, and
    the job failed when a replica refused to run without the whole sandbox; the replicas to create are returned,
    for `_create_children`."""
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
    return pool


def _create_children(shared: Shared, job: RLHFJob, uid: str | None, plan: Plan, pods: list[dict[str, Any]],
                     memo: kopf.Memo, first_start: bool, reward: dict[str, str] | None,
                     lost: set[tuple[str, str]] | None = None, pool: PoolPlan | None = None,
                     queue: Queue | None = None, accepted: RLHFJob | None = None) -> None:
    """The static children, the job's copy of its code files and the missing pods of the planned generation; a
    refused create raises, naming the object it was about. The pods may use only what the accepted spec names
    (`foreign_references`). A child that already exists must be this job's (`_check_existing`).

    Static children are POSTed once per gang start (a new generation, or a resume: the key is the generation and
    status.startTime), then remembered (`memo["children"]`), not re-POSTed at every tick; `lost` (kind, name), the
    followed children deleted since (`_lost_children`), are made again at any tick, with a Warning event. `pool`:
    the environment pool's replicas to create (environments.plan_pool), at any tick. `queue`: a job queued through
    Kueue: its Workload is made when it has none, and its pods are placed where Kueue admitted them (`_placed`).
    `accepted`: the spec the job was accepted with, before status.plan (what its ConfigMap holds); a plan pod is
    made outside Kueue, and no Workload nor gang pod from a job whose placement is still auto (plan_pod.py)."""
    lost = lost or set()
    if queue is not None and queue.workload is None and plan.status.get("phase") not in TERMINAL \
            and job.spec.placement != "auto":
        _make_workload(shared.kube, job, uid, queue.name, memo, shared.policy.sandbox_runtime_class)
    objs: list[dict[str, Any]] = []
    if plan.create_static or lost:
        policy, own = shared.policy, shared.operator_namespace
        scrapers = [*policy.metrics_namespaces, *([own] if own else [])]
        static = mf.static_children(job, uid, secrets.token_hex(32), scrapers, policy.egress, accepted)
        static += environment_children(job, uid, secrets.token_hex(32))
        objs += static if plan.create_static else [o for o in static if (o["kind"], o["metadata"]["name"]) in lost]
    new_pods: list[dict[str, Any]] = [environment_pod(job, uid, i, shared.policy.sandbox_runtime_class)
                                      for i in (pool.create if pool else [])]
    if new_pods and plan.create_gang is None:  # a sandbox pod remade mid-run: what it mounts is checked first
        _check_pool_inputs(shared.kube, job, uid, plan.status)
    if plan.create_gang is not None:
        if job.spec.kubernetes.reward_config_map and (
                files := _reward_to_copy(shared.kube, shared.policy, job, uid, plan.status, reward)):
            objs.append(mf.reward_configmap(job, uid, files))
        new_pods += pp.with_plan_env(mf.gang_pods(job, uid, plan.create_gang), plan.status.get("plan"))
    if new_pods:
        if foreign := mf.foreign_references(new_pods, memo.get("accepted") or job):
            raise SpecError(f"the job's pods would use {', '.join(foreign)}, which the spec it was accepted with "
                            "does not name; they are not created")
        existing = {p["view"].name for p in pods}
        new_pods = [p for p in new_pods if p["metadata"]["name"] not in existing]
        objs += _placed(shared.kube, queue, new_pods) if queue is not None and new_pods else new_pods
    if plan.create_plan_pod and not any(p["view"].name == pp.plan_pod_name(job.metadata.name) for p in pods):
        objs.append(pp.plan_pod(job, uid or ""))  # outside Kueue's quota: small, and before the Workload
    created = memo.setdefault("created", {})
    start = (int(plan.status.get("restarts", 0)), plan.status.get("startTime"))
    known = memo.get("children")
    if known is None or known[0] != start:  # a new gang generation, or a resume, checks its static children again
        known = memo["children"] = (start, set())
    known[1].difference_update(lost)
    seen: set[tuple[str, str]] = memo.setdefault("seen_children", set())
    taken: list[str] = []  # pods whose names someone else's pods hold
    for obj in objs:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in known[1]:
            continue  # created, or found to be this job's, by an earlier tick: no POST (and 409) every tick
        if obj["kind"] == "Pod" and obj["metadata"]["labels"].get(mf.LABEL_ROLE) == mf.ENVIRONMENT_ROLE and \
                (token_uid := plan.status.get(SECRET_UID_KEYS["sandbox_token"])):
            # the token it will read: the Secret's now (made above in this tick, or before)
            obj["metadata"].setdefault("annotations", {})[TOKEN_UID_ANNOTATION] = token_uid
        try:
            made = shared.kube.create(obj)
        except ApiException as err:
            err.hybridflow_object = f"{obj['kind']} {obj['metadata']['name']}"  # type: ignore[attr-defined]
            raise
        if made is None and obj["kind"] == "Pod":
            # `new_pods` left out every pod the job controls (and those it created and has not seen yet): a name
            # that is taken all the same is held by someone else's pod, never counted as the job's (L4)
            taken.append(obj["metadata"]["name"])
            continue
        if made is None:
            _check_existing(shared.kube, obj, job.metadata.name, uid, plan.status, first_start)
        elif obj["kind"] == "Secret":
            # The operator never reads Secrets: the uid its create returned is how `cleanup` knows this one.
            role = next(k for k, v in mf.names(job.metadata.name).items() if v == obj["metadata"]["name"])
            plan.status[SECRET_UID_KEYS[role]] = made.metadata.uid
            _write_status(shared.kube, obj["metadata"]["namespace"], job.metadata.name, memo.get("written") or {},
                          plan.status, memo)
            if role == "sandbox_token" and any(p["view"].role == mf.ENVIRONMENT_ROLE for p in pods):
                plan.events.append(("Warning", "SandboxPodsReplaced", f"Secret {obj['metadata']['name']} was "
                                    "deleted and is made anew with a new token; the sandbox pods started with the "
                                    "old one are made again (environments.plan_pool)"))
        if obj["kind"] == "Pod":
            created[obj["metadata"]["name"]] = (time.monotonic(), _pod_view(obj))
            continue
        known[1].add(key)
        seen.discard(key)  # lost again only once the watch has shown this one (`_lost_children`)
        if key in lost and made is not None:
            plan.events.append(("Warning", "ChildRecreated", f"{obj['kind']} {obj['metadata']['name']} was deleted "
                                "while the job lives; the operator made it again (a job's children go with it: "
                                "delete the RLHFJob to remove them)"))
    if taken:
        raise PodNamesTaken(taken)


class PodNamesTaken(Exception):
    """Pod creates answered 409 (AlreadyExists) for names no pod of the job holds: other pods sit under the names
    of the job's (phases.names_taken makes it a condition naming them)."""

    def __init__(self, pods: list[str]) -> None:
        super().__init__(", ".join(pods))
        self.pods = pods


# The status field holding the digest each of the job's ConfigMaps must match (by their key in manifests.names);
# the copy of the code files ("reward") must match status.codeDigests, key by key (`_check_code`).
DIGEST_OF = {"configmap": "acceptedSpecDigest", "reward": "codeDigests"}


def _check_existing(kube: Kube, obj: dict[str, Any], job_name: str, uid: str | None, status: JobStatus,
                    first_start: bool) -> None:
    """A child the create found already there (409): ours from an earlier tick, or someone else's under its name?
    Raises unless it is this job's: read and owned by the job, and the ConfigMaps holding what status recorded. A
    Ray token Secret is never read: one there when the job first starts was planted (its token would be known to
    whoever made it); later it is the one this job made. A pod is not checked here: only pods the job controls are
    ever counted (`_observed_pods`), so a stranger's under a gang pod's name is never taken for the job's (its
    create's 409 is a condition naming it: `PodNamesTaken`)."""
    kind, ns, name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
    if kind == "Pod":
        return
    if kind == "Secret":
        if first_start:
            raise SpecError(f"Secret {ns}/{name} existed before this job started, so its token may be known to "
                            "others; delete it (or name a Secret of yours in spec.kubernetes.rayAuthSecret) and create "
                            "the job again")
        return
    found = kube.read(kind, ns, name)
    if found is None:  # deleted since the create: no pod may start without it, so the tick is redone
        raise kopf.TemporaryError(f"{kind} {ns}/{name} was deleted while being created; creating it again",
                                  delay=INTERVAL)
    _check_owner(kind, ns, name, found, uid)
    role = next((k for k, v in mf.names(job_name).items() if v == name), "")
    if kind == "ConfigMap" and role == "reward":  # (a job accepted before codeDigests: its reward file alone)
        reward_key = next(iter(obj["data"])) if len(obj["data"]) == 1 else ""
        _check_code(ns, name, found, _code_digests(status, reward_key))
    elif kind == "ConfigMap" and role in DIGEST_OF:
        (key,) = obj["data"]
        _check_holds(ns, name, found, key, status.get(DIGEST_OF[role]))


def _check_pool_inputs(kube: Kube, job: RLHFJob, uid: str | None, status: JobStatus) -> None:
    """Before a sandbox pod is made outside a gang start (one replaced mid-run): the ConfigMaps it mounts by name,
    the job's spec and its copy of the code files, must still be the job's own, holding what status recorded, as a
    gang start checks them (`_check_existing`). Deleted and made again by someone who may write ConfigMaps, they
    would hand the new pod their code and the job's data; the job fails instead, naming the ConfigMap."""
    children = [mf.configmap(job, uid or "")]
    if keys := mf.code_keys(job):
        own = mf.names(job.metadata.name)["reward"]
        children.append({"kind": "ConfigMap", "metadata": {"namespace": mf.job_namespace(job), "name": own},
                         "data": dict.fromkeys(keys, "")})
    for obj in children:
        _check_existing(kube, obj, job.metadata.name, uid, status, first_start=False)


def _check_holds(namespace: str, name: str, cm: dict[str, Any], key: str, accepted: str | None) -> None:
    """One of the job's own ConfigMaps must hold, under `key`, the content whose digest status recorded before
    creating it: it is immutable, but could have been deleted and made again by someone else."""
    text = (cm.get("data") or {}).get(key)
    digest = mf.content_digest(text) if text is not None else f"none (no key {key})"
    if digest != accepted:
        raise SpecError(f"ConfigMap {namespace}/{name} does not hold what this job was accepted with (digest "
                        f"{digest}, accepted {accepted or 'none'}); delete the job and create it again")


def _check_code(namespace: str, name: str, cm: dict[str, Any], accepted: dict[str, str] | None) -> None:
    """The job's copy of its code files must hold exactly the files whose digests status recorded before creating
    it, every key (the reward file's, the tools file's, the environment file's) and no other: it is immutable, but
    could have been deleted and made again by someone else."""
    held = {key: mf.content_digest(text) for key, text in (cm.get("data") or {}).items()}
    held |= {key: "binaryData" for key in cm.get("binaryData") or {}}  # mounted as files too
    accepted = accepted or {}
    if differ := [f"{key}: digest {held.get(key, 'none')}, accepted {accepted.get(key, 'none')}"
                  for key in sorted(held.keys() | accepted.keys()) if held.get(key) != accepted.get(key)]:
        raise SpecError(f"ConfigMap {namespace}/{name} does not hold what this job was accepted with "
                        f"({'; '.join(differ)}); delete the job and create it again")


def _reward_to_copy(kube: Kube, policy: Policy, job: RLHFJob, uid: str | None, status: JobStatus,
                    found: dict[str, str] | None) -> dict[str, str] | None:
    """The code files (key -> text) to copy into the job's own ConfigMap at this gang start, or None when its copy
    is there (and is this job's, holding every file accepted). `found`: the files just read from the user's
    ConfigMap (no copy was made yet; status.codeDigests now records them). A copy that is gone (its first create
    failed, or someone deleted it) is made again only from the very files accepted, never from edited ones."""
    if found is not None:
        return found
    ns, own = mf.job_namespace(job), mf.names(job.metadata.name)["reward"]
    accepted = _code_digests(status, mf.reward_key(job))
    if (copy_ := kube.read("ConfigMap", ns, own)) is not None:
        _check_owner("ConfigMap", ns, own, copy_, uid)
        _check_code(ns, own, copy_, accepted)
        return None
    _, files = _code_files(kube, policy, job, ns)
    if files is None or accepted is None or mf.code_digests(files) != dict(sorted(accepted.items())):
        raise SpecError(f"ConfigMap {ns}/{own}, the job's copy of its code files, is gone, and ConfigMap "
                        f"{ns}/{job.spec.kubernetes.reward_config_map} no longer holds the files accepted "
                        f"({', '.join(f'{k} {v}' for k, v in sorted((accepted or {}).items())) or 'none'}); delete "
                        f"the job and create it again")
    return files


def _api_message(err: ApiException) -> str:
    """The API server's own words (its Status object's message), else the HTTP reason."""
    try:
        return str(json.loads(err.body).get("message") or err.reason)[:1000]
    except (TypeError, ValueError, AttributeError):
        return str(err.reason)


def _write_status(kube: Kube, namespace: str, name: str, old: JobStatus, new: JobStatus, memo: kopf.Memo) -> None:
    """Merge-patch the status subresource now (not after the tick, as kopf's `patch` would), so that the write is
    known to have landed before anything relies on it; fields the plan dropped are removed."""
    patch = {"status": {**{k: None for k in old if k not in new}, **new}}
    kube.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, patch,
                                                      _request_timeout=API_TIMEOUT)
    memo["written"] = copy.deepcopy(new)


def _poll_progress(poller: Poller, namespace: str, job: RLHFJob, pods: list[dict[str, Any]], status: JobStatus,
                   now: dt.datetime) -> None:
    """Progress from the current generation's head (`pods` holds only pods the job owns: `_observed_pods`); an old
    head that still has an IP must not move step back (the poller keeps only the answer of this very head pod). The
    answer is the fetch the previous tick handed over: the tick never waits for a driver."""
    gen = int(status.get("restarts", 0))
    head = [p for p in pods if p["view"].role == "head" and p["podIP"] and p["view"].generation == gen
            and not p["view"].deleting]
    if not head or not job.spec.metrics.port:
        poller.forget((namespace, job.metadata.name))
        return
    text = poller.poll((namespace, job.metadata.name), head[-1]["podIP"], job.spec.metrics.port,
                       target=head[-1]["view"].name)
    if text:
        progress = parse_progress(text, job.metadata.name)
        if missing := progress.pop(SANDBOX_MISSING, None):
            set_condition(status, "SandboxPartial", True, "LayersMissing",
                          f"the sandbox pool runs the job's user code without: {', '.join(missing)} "
                          "(spec.sandbox.allowPartial; its pods hold no credential and reach nothing)", now)
        merge_progress(status, progress, job.spec.trainer.checkpoint_dir, iso(now))


# The Secrets the operator makes for a job (key in manifests.names) -> the status field holding the uid its create
# returned: the operator never reads a Secret, so that uid is how `cleanup` deletes the job's own and no other.
SECRET_UID_KEYS = {"ray_token": "rayTokenSecretUid", "sandbox_token": "sandboxTokenSecretUid"}
# The children `cleanup` looks for by name: (kind, key in manifests.names).
NAMED_CHILDREN = (("Service", "service"), ("ConfigMap", "configmap"), ("ConfigMap", "reward"),
                  ("NetworkPolicy", "network_policy"), ("PodGroup", "podgroup"),
                  *((("Workload", "workload"),) if KUEUE else ()))


@kopf.on.delete(GROUP, VERSION, PLURAL, when=_acts_in)
async def cleanup(name: str, namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Remove the job's children, for clusters (and test doubles) without garbage collection: only those the job
    controls (its controller ownerReference), each deleted with its uid as the precondition, so an object that
    merely has a child's name (a namespace's `default-deny-ingress` under a job called `default-deny`) stays. The
    token Secrets, which the operator never reads, are deleted by the uid each create returned; one the operator did
    not make is never touched. The deletions go out together: the finalizer, and so the job, goes as soon as
    the slowest of them is answered."""
    shared, uid, names = _shared(memo), body["metadata"].get("uid"), mf.names(name)
    kube = shared.kube
    pods = await asyncio.to_thread(kube.list_pods, namespace, name)
    calls = [functools.partial(kube.delete, "Pod", namespace, p["metadata"]["name"], p["metadata"]["uid"],
                               grace_period_seconds=0) for p in pods if uid and controllers(p) == [uid]]
    calls += [functools.partial(kube.delete_owned, kind, namespace, names[key], uid) for kind, key in NAMED_CHILDREN]
    calls += [functools.partial(kube.delete_owned, kind, namespace, child, uid) for kind, child in
              (("Service", mf.environment_service_name(name)), ("NetworkPolicy", environment_policy_name(name)))]
    for role, key in SECRET_UID_KEYS.items():  # the job's tokens, by the uid each create returned
        if token := (body.get("status") or {}).get(key):
            calls.append(functools.partial(kube.delete, "Secret", namespace, names[role], token))
    await asyncio.gather(*(asyncio.to_thread(c) for c in calls))
    shared.poller.forget((namespace, name))
    shared.metrics.set_phase(namespace, name, None)
    shared.disrupted.pop((namespace, name), None)
