"""What the operator's handlers share (`Shared`, one per operator) and what it remembers of each job between its
ticks (`JobMemory`, one per job), both reached through kopf's memo; the operator's settings; and which namespaces
it acts in (`operator_acts_in`, kopf's `when` filter)."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import kopf

from hybridflow.api import RLHFJob
from hybridflow.api.status import JobStatus
from hybridflow_operator.kube import API_TIMEOUT, Kube, ignore
from hybridflow_operator.kueue import Admission
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator.plan import PodView
from hybridflow_operator.policy import Policy
from hybridflow_operator.progress import Poller

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
    timer's, the pod index's, the deletion's) while each job's own memory (`memory_of`) stays its own.
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
    # Namespaces' verdicts (`operator_acts_in`): namespace -> (when read, time.monotonic(); acts there), and those whose
    # jobs were left alone, each logged once.
    namespaces: dict[str, tuple[float, bool]] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)


def shared_of(memo: kopf.Memo) -> Shared:
    return memo["shared"]


class Resting(NamedTuple):
    """A job resting (phases.resting): what it waits for, the job's resourceVersion when it began (any change to
    the object, its spec or status, ends the rest: kopf's timer body is live, fed by the watch), and when the rest
    ends by itself (time.monotonic(); None: only a change ends it)."""
    why: str
    version: str | None
    until: float | None
    workload: Admission | None = None  # a queued job's Workload when the rest began: a change ends it


@dataclass
class JobMemory:
    """What the operator remembers of one job between its ticks (kopf's memo is per object): in memory only, so a
    restarted operator reads it all again (or does it again: every create is idempotent)."""
    written: JobStatus | None = None  # the status this operator last wrote (`_known_status`)
    accepted: RLHFJob | None = None  # the spec the job was accepted with, read once from its ConfigMap
    accepted_fields: dict[str, Any] | None = None  # its fields that may not change (None: not resolvable)
    fields_checked: bool = False  # accepted_fields was resolved (the accepted spec never changes)
    created: dict[str, tuple[float, PodView]] = field(default_factory=dict)  # pods made, not yet seen by the watch
    children: tuple[tuple[int, str | None], set[tuple[str, str]]] | None = None  # (gang start, static children made)
    seen_children: set[tuple[str, str]] = field(default_factory=set)  # followed children the watch has shown
    rest: Resting | None = None  # the job rests (rest.py)
    rest_tries: int = 0  # rests in a row that wait for something outside the job (their backoff)
    workload_posted: float | None = None  # when its Workload was last created (time.monotonic())


def memory_of(memo: MutableMapping[str, Any] | JobMemory) -> JobMemory:
    """The job's memory, in its kopf memo under one key; made on first use. A mapping that holds its fields by name
    (what a test hands over) seeds it; a JobMemory is its own."""
    if isinstance(memo, JobMemory):
        return memo
    found = memo.get("job")
    if found is None:
        seeded = {f.name: memo[f.name] for f in fields(JobMemory) if f.name in memo}
        found = memo["job"] = JobMemory(**seeded, **({"fields_checked": True} if "accepted_fields" in memo else {}))
    return found


# A cluster-wide install acts only in namespaces carrying Policy.namespace_label: each namespace's labels are read
# (`get namespaces`, the one namespace asked about) and kept this long, so a label removed stops its jobs' ticks
# within that time, and a namespace labelled later is picked up at its jobs' next event (kopf re-lists them at
# every watch restart, 5 minutes at most).
NAMESPACE_TTL = 30.0


def operator_acts_in(memo: kopf.Memo, namespace: str | None = None, **_: Any) -> bool:
    """Whether the operator may act in the namespace: always when the install names its namespaces (kopf watches
    only those), else only when the namespace carries the label. kopf's `when` filter of the timer and the deletion
    handler too: a job elsewhere gets no finalizer, no tick, nothing written."""
    shared = shared_of(memo)
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
