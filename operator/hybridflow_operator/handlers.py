"""kopf handlers: read the job and its pods, call the pure state machine, write what it planned. `kopf run -m
hybridflow_operator.handlers` loads this module: it imports every module that registers a handler (watch.py: the
indexes of the jobs' children; reconcile.py: the tick), and registers the operator's startup and the jobs' cleanup.

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
import functools
import logging
import os
from typing import Any

import kopf
from kubernetes import client, config

from hybridflow.api import API_GROUP as GROUP
from hybridflow.api import PLURAL, VERSION
from hybridflow_operator import manifests as mf
from hybridflow_operator.environments import environment_policy_name
from hybridflow_operator.kube import API_TIMEOUT, Kube, controllers
from hybridflow_operator.meta import SECRET_UID_KEYS
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator.policy import Policy
from hybridflow_operator.reconcile import reconcile  # registers the tick (kopf.timer)
from hybridflow_operator.state import KUEUE, Shared, operator_acts_in, shared_of
from hybridflow_operator.watch import (  # registers the indexes (kopf.index)
    job_network_policies, job_pods, job_services, job_workloads, watch_children_only,
)

__all__ = [  # the handlers kopf runs (registered on import)
    "configure", "cleanup", "reconcile", "job_pods", "job_services", "job_network_policies", "job_workloads",
    "tune_kopf", "watch_children_only",
]


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


# The children `cleanup` looks for by name: (kind, key in manifests.names).
NAMED_CHILDREN = (("Service", "service"), ("ConfigMap", "configmap"), ("ConfigMap", "reward"),
                  ("NetworkPolicy", "network_policy"), ("PodGroup", "podgroup"),
                  *((("Workload", "workload"),) if KUEUE else ()))


@kopf.on.delete(GROUP, VERSION, PLURAL, when=operator_acts_in)
async def cleanup(name: str, namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Remove the job's children, for clusters (and test doubles) without garbage collection: only those the job
    controls (its controller ownerReference), each deleted with its uid as the precondition, so an object that
    merely has a child's name (a namespace's `default-deny-ingress` under a job called `default-deny`) stays. The
    token Secrets, which the operator never reads, are deleted by the uid each create returned; one the operator did
    not make is never touched. The deletions go out together: the finalizer, and so the job, goes as soon as
    the slowest of them is answered."""
    shared, uid, names = shared_of(memo), body["metadata"].get("uid"), mf.names(name)
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
