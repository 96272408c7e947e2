"""Creating a job's children as its plan says, and checking the ones found already there: an object under a
child's name counts only when it is this job's (its controller ownerReference) and, for its ConfigMaps, holds what
status recorded; else the job fails naming it (`_check_existing`)."""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from hybridflow.api import RLHFJob, SpecError
from hybridflow.api.status import JobStatus, TERMINAL
from hybridflow_operator import manifests as mf
from hybridflow_operator import plan_pod as pp
from hybridflow_operator.accept import check_owner, code_digests_of, read_code_files
from hybridflow_operator.environments import TOKEN_UID_ANNOTATION, environment_children, environment_pod
from hybridflow_operator.kube import Kube
from hybridflow_operator.meta import SECRET_UID_KEYS
from hybridflow_operator.plan import Plan, Queue
from hybridflow_operator.policy import Policy
from hybridflow_operator.state import INTERVAL, JobMemory, Shared
from hybridflow_operator.watch import pod_view
from hybridflow_operator.workloads import make_workload, place_pods

def create_children(shared: Shared, job: RLHFJob, uid: str | None, plan: Plan, pods: list[dict[str, Any]],
                     memory: JobMemory, first_start: bool, record: Callable[[JobStatus], None],
                     lost: set[tuple[str, str]] | None = None, queue: Queue | None = None,
                     accepted: RLHFJob | None = None) -> None:
    """The static children, the job's copy of its code files and the missing pods of the planned generation; a
    refused create raises, naming the object it was about. The pods may use only what the accepted spec names
    (`foreign_references`). A child that already exists must be this job's (`_check_existing`).

    Static children are POSTed once per gang start (a new generation, or a resume: the key is the generation and
    status.startTime), then remembered (JobMemory.children), not re-POSTed at every tick; `lost` (kind, name), the
    followed children deleted since (`lost_children`), are made again at any tick, with a Warning event; and
    `plan.create_sandbox`, the environment pool's replicas to create (environments.plan_pool), at any tick. `record`
    writes the status (the tick's one writer) once a token Secret's uid is in it. `queue`: a job queued through
    Kueue: its Workload is made when it has none, and its pods are placed where Kueue admitted them (`place_pods`).
    `accepted`: the spec the job was accepted with, before status.plan (what its ConfigMap holds); a plan pod is
    made outside Kueue, and no Workload nor gang pod from a job whose placement is still auto (plan_pod.py)."""
    lost = lost or set()
    if queue is not None and queue.workload is None and plan.status.get("phase") not in TERMINAL \
            and job.spec.placement != "auto":
        make_workload(shared.kube, job, uid, queue.name, memory, shared.policy.sandbox_runtime_class)
    objs: list[dict[str, Any]] = []
    if plan.create_static or lost:
        policy, own = shared.policy, shared.operator_namespace
        scrapers = [*policy.metrics_namespaces, *([own] if own else [])]
        static = mf.static_children(job, uid, secrets.token_hex(32), scrapers, policy.egress, accepted)
        static += environment_children(job, uid, secrets.token_hex(32))
        objs += static if plan.create_static else [o for o in static if (o["kind"], o["metadata"]["name"]) in lost]
    new_pods: list[dict[str, Any]] = [environment_pod(job, uid, i, shared.policy.sandbox_runtime_class)
                                      for i in plan.create_sandbox]
    if new_pods and plan.create_gang is None:  # a sandbox pod remade mid-run: what it mounts is checked first
        _check_pool_inputs(shared.kube, job, uid, plan.status)
    if plan.create_gang is not None:
        if job.spec.kubernetes.reward_config_map and (
                files := reward_to_copy(shared.kube, shared.policy, job, uid, plan.status, plan.copy_code)):
            objs.append(mf.reward_configmap(job, uid, files))
        new_pods += pp.with_plan_env(mf.gang_pods(job, uid, plan.create_gang), plan.status.get("plan"))
    if new_pods:
        if foreign := mf.foreign_references(new_pods, memory.accepted or job):
            raise SpecError(f"the job's pods would use {', '.join(foreign)}, which the spec it was accepted with "
                            "does not name; they are not created")
        existing = {p["view"].name for p in pods}
        new_pods = [p for p in new_pods if p["metadata"]["name"] not in existing]
        objs += place_pods(shared.kube, queue, new_pods) if queue is not None and new_pods else new_pods
    if plan.create_plan_pod and not any(p["view"].name == pp.plan_pod_name(job.metadata.name) for p in pods):
        objs.append(pp.plan_pod(job, uid or ""))  # outside Kueue's quota: small, and before the Workload
    created = memory.created
    start = (int(plan.status.get("restarts", 0)), plan.status.get("startTime"))
    known = memory.children
    if known is None or known[0] != start:  # a new gang generation, or a resume, checks its static children again
        known = memory.children = (start, set())
    known[1].difference_update(lost)
    seen = memory.seen_children
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
            record(plan.status)  # known to `cleanup` before anything else can fail
            if role == "sandbox_token" and any(p["view"].role == mf.ENVIRONMENT_ROLE for p in pods):
                plan.events.append(("Warning", "SandboxPodsReplaced", f"Secret {obj['metadata']['name']} was "
                                    "deleted and is made anew with a new token; the sandbox pods started with the "
                                    "old one are made again (environments.plan_pool)"))
        if obj["kind"] == "Pod":
            created[obj["metadata"]["name"]] = (time.monotonic(), pod_view(obj))
            continue
        known[1].add(key)
        seen.discard(key)  # lost again only once the watch has shown this one (`lost_children`)
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
    ever counted (`observed_pods`), so a stranger's under a gang pod's name is never taken for the job's (its
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
    check_owner(kind, ns, name, found, uid)
    role = next((k for k, v in mf.names(job_name).items() if v == name), "")
    if kind == "ConfigMap" and role == "reward":  # (a job accepted before codeDigests: its reward file alone)
        reward_key = next(iter(obj["data"])) if len(obj["data"]) == 1 else ""
        _check_code(ns, name, found, code_digests_of(status, reward_key))
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


def reward_to_copy(kube: Kube, policy: Policy, job: RLHFJob, uid: str | None, status: JobStatus,
                    found: dict[str, str] | None) -> dict[str, str] | None:
    """The code files (key -> text) to copy into the job's own ConfigMap at this gang start, or None when its copy
    is there (and is this job's, holding every file accepted). `found`: the files just read from the user's
    ConfigMap (no copy was made yet; status.codeDigests now records them). A copy that is gone (its first create
    failed, or someone deleted it) is made again only from the very files accepted, never from edited ones."""
    if found is not None:
        return found
    ns, own = mf.job_namespace(job), mf.names(job.metadata.name)["reward"]
    accepted = code_digests_of(status, mf.reward_key(job))
    if (copy_ := kube.read("ConfigMap", ns, own)) is not None:
        check_owner("ConfigMap", ns, own, copy_, uid)
        _check_code(ns, own, copy_, accepted)
        return None
    _, files = read_code_files(kube, policy, job, ns)
    if files is None or accepted is None or mf.code_digests(files) != dict(sorted(accepted.items())):
        raise SpecError(f"ConfigMap {ns}/{own}, the job's copy of its code files, is gone, and ConfigMap "
                        f"{ns}/{job.spec.kubernetes.reward_config_map} no longer holds the files accepted "
                        f"({', '.join(f'{k} {v}' for k, v in sorted((accepted or {}).items())) or 'none'}); delete "
                        f"the job and create it again")
    return files


def api_error_message(err: ApiException) -> str:
    """The API server's own words (its Status object's message), else the HTTP reason."""
    try:
        return str(json.loads(err.body).get("message") or err.reason)[:1000]
    except (TypeError, ValueError, AttributeError):
        return str(err.reason)
