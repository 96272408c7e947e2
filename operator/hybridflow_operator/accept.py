"""Accepting a job: the spec it was accepted with (read once from its own ConfigMap, trusted only when it is the
job's and holds what status recorded), whether the live spec changed since, its Kueue queue, and the inputs its pods
would mount (looked up when a gang is about to start)."""
from __future__ import annotations

import json
from collections.abc import MutableMapping
from typing import Any

import kopf

from hybridflow.api import RLHFJob, SpecError, parse_job
from hybridflow.api.status import JobStatus, Phase
from hybridflow.api.storage import is_url
from hybridflow_operator import kueue
from hybridflow_operator import manifests as mf
from hybridflow_operator.kube import Kube, controllers, ignore
from hybridflow_operator.policy import Policy, queue_problem, unmarked
from hybridflow_operator.state import KUEUE, memory_of

def accepted_job(kube: Kube, live: RLHFJob, uid: str | None, status: JobStatus,
                  memo: MutableMapping[str, Any]) -> tuple[RLHFJob, bool]:
    """The spec the job was accepted with (its ConfigMap, read once), with the live runPolicy; and whether other
    fields changed. The ConfigMap is trusted only when this job owns it and holds what the operator wrote: the digest
    the operator put into status before creating it (the ConfigMap is immutable, but could be deleted and planted
    again). Anyone who may create ConfigMaps could otherwise choose what the pods run. Before the ConfigMap exists
    the live spec is the one being accepted, unless a digest was recorded already: then the live spec must still be
    exactly that one (a create refused or cut short is retried), never an edited one. A live spec that names what
    its pods may not have (mf.resolved_job: another namespace's checkpoint, object storage without credentials)
    is refused at acceptance, as a SpecError naming the field; once accepted, such an edit is only a change (the
    job keeps running what it was accepted with, as with any other edit), never a reason to fail it."""
    memory = memory_of(memo)
    if memory.accepted is None:
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
        check_owner("ConfigMap", namespace, name, cm, uid)
        text = (cm.get("data") or {}).get(mf.SPEC_KEY)  # JSON only: the operator never parses YAML it did not write
        digest = mf.content_digest(text) if text is not None else f"none (no key {mf.SPEC_KEY})"
        if known != digest:
            raise SpecError(f"ConfigMap {namespace}/{name} does not hold the spec this job started with (digest "
                            f"{digest}, accepted {known or 'none'}); delete the job and create it again")
        memory.accepted = parse_job(json.loads(text), "accepted spec")
    if not memory.fields_checked:  # the accepted spec never changes: resolved once, not at every tick
        try:  # resolved: a spec accepted by an older operator (its paths resolved otherwise) is not an edit
            memory.accepted_fields = spec_fields(mf.resolved_job(memory.accepted))
        except SpecError:
            memory.accepted_fields = None
        memory.fields_checked = True
    accepted = memory.accepted.model_copy(deep=True)
    accepted.spec.run_policy = live.spec.run_policy
    if accepted.spec.rollout_pool is not None and live.spec.rollout_pool is not None:  # (the CRD keeps it there)
        accepted.spec.rollout_pool = live.spec.rollout_pool
    try:
        changed = memory.accepted_fields is None or spec_fields(mf.resolved_job(live)) != memory.accepted_fields
    except SpecError:  # an edit naming what the pods may not have: they never get it (the accepted spec runs)
        changed = True
    return accepted, changed


def spec_fields(job: RLHFJob) -> dict[str, Any]:
    """What may not change on a live job: all but runPolicy and an elastic rollout pool's size and bounds. A
    checkpoint directory on the claim is the operator's choice (jobs started before it was per-job keep theirs), so
    it is left out; an object-storage URL is the author's and counts (editing it must not pass unnoticed while the
    job goes on writing to the old bucket)."""
    spec = job.spec.model_dump(exclude={"run_policy", "rollout_pool"})
    if not is_url(job.spec.trainer.checkpoint_dir):
        spec["trainer"].pop("checkpoint_dir", None)
    return spec


def look_up_inputs(kube: Kube, policy: Policy, job: RLHFJob, namespace: str,
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
    if k8s.reward_config_map and code_digests_of(status, mf.reward_key(job)) is None:
        why, files = read_code_files(kube, policy, job, namespace)
        problems += [why] if why else []
    return "; ".join(problems), files


def read_code_files(kube: Kube, policy: Policy, job: RLHFJob, namespace: str) -> tuple[str, dict[str, str] | None]:
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


def code_digests_of(status: JobStatus, reward_key: str) -> dict[str, str] | None:
    """The code files' digests status recorded when they were first found (None before): status.codeDigests, or for
    a job accepted when only its reward file was copied, status.rewardDigest under the reward file's key."""
    if (digests := status.get("codeDigests")) is not None:
        return dict(digests)
    if reward_key and (reward := status.get("rewardDigest")):
        return {reward_key: reward}
    return None


def check_owner(kind: str, namespace: str, name: str, obj: dict[str, Any], uid: str | None) -> None:
    """A child's name is no proof: an object found under it must be controlled by this job, else the job fails
    naming it (whoever made it could otherwise choose what the job's pods run, or who may reach them)."""
    owners = controllers(obj)
    if not uid or owners != [uid]:
        raise SpecError(f"{kind} {namespace}/{name} exists but was not made for this job (its owner: "
                        f"{owners[0] if owners else 'none'}); the job cannot start with a child it did not make. "
                        f"Delete that {kind}, or give the job another name")


def check_queueable(job: RLHFJob, queue: str | None, policy: Policy) -> None:
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


def queue_of(body: kopf.Body, status: JobStatus) -> str | None:
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
