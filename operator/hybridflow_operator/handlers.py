"""kopf handlers: read the job and its pods, call the pure state machine, write what it planned.

Every handler is idempotent: objects are created by name (409 means already there), deleted by name (404 means
already gone), and status is recomputed from what exists, so a handler that runs twice, or an operator that
restarts mid-job, creates nothing twice.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import time
from typing import Any

import kopf
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from hybridflow.spec import API_GROUP as GROUP
from hybridflow.spec import PLURAL, VERSION, RLHFJob, SpecError, parse_job
from hybridflow_operator import manifests as mf
from hybridflow_operator.metrics import OperatorMetrics
from hybridflow_operator.phases import TERMINAL, PodView, decide, iso, parse_time, set_condition
from hybridflow_operator.progress import fetch, merge_progress, parse_progress

INTERVAL = float(os.environ.get("HYBRIDFLOW_RECONCILE_INTERVAL", "5"))
METRICS = OperatorMetrics()
log = logging.getLogger("hybridflow.operator")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    port = int(os.environ.get("HYBRIDFLOW_OPERATOR_METRICS_PORT", "8080"))
    if port:
        METRICS.serve(port, os.environ.get("HYBRIDFLOW_OPERATOR_METRICS_ADDRESS", "0.0.0.0"))


def _core() -> client.CoreV1Api:
    return client.CoreV1Api()


def _ignore(status: int | tuple[int, ...], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call fn; an ApiException with one of these statuses (409: exists, 404: gone) counts as success."""
    try:
        return fn(*args, **kwargs)
    except ApiException as err:
        if err.status not in ((status,) if isinstance(status, int) else status):
            raise
        return None


def _pod_view(pod: dict[str, Any]) -> PodView:
    meta, st = pod["metadata"], pod.get("status") or {}
    labels = meta.get("labels") or {}
    message = st.get("message") or st.get("reason") or ""
    for kind, key in (("init container", "initContainerStatuses"), ("container", "containerStatuses")):
        for cs in st.get(key) or []:
            term = (cs.get("state") or {}).get("terminated")
            if term and term.get("exitCode"):
                message = f"{kind} {cs['name']} exited with code {term['exitCode']} ({term.get('reason', 'Error')})"
    return PodView(
        name=meta["name"],
        role=labels.get(mf.LABEL_ROLE, "worker"),
        generation=int(labels.get(mf.LABEL_GENERATION, "0")),
        phase=st.get("phase") or "Pending",
        deleting=bool(meta.get("deletionTimestamp")),
        message=message,
    )


def _list_pods(namespace: str, name: str) -> list[dict[str, Any]]:
    # Raw JSON rather than the client's models: the pure functions work on plain dicts.
    resp = _core().list_namespaced_pod(namespace, label_selector=mf.selector(name), _preload_content=False)
    return json.loads(resp.data).get("items", [])


def _accepted_job(live: RLHFJob, namespace: str) -> tuple[RLHFJob, bool]:
    """The spec the job started with (its ConfigMap), with the live runPolicy; and whether other fields changed."""
    cm = _ignore(404, _core().read_namespaced_config_map, mf.names(live.metadata.name)["configmap"], namespace)
    if cm is None:
        return live, False
    accepted = parse_job(yaml.safe_load(cm.data["job.yaml"]), "accepted spec")
    accepted.spec.run_policy = live.spec.run_policy
    resolved_live = mf.resolved_job(live)
    changed = resolved_live.spec.model_dump(exclude={"run_policy"}) != accepted.spec.model_dump(exclude={"run_policy"})
    return accepted, changed


def _create(obj: dict[str, Any]) -> None:
    ns, kind = obj["metadata"]["namespace"], obj["kind"]
    if kind == "Pod":
        _ignore(409, _core().create_namespaced_pod, ns, obj)
    elif kind == "Service":
        _ignore(409, _core().create_namespaced_service, ns, obj)
    elif kind == "ConfigMap":
        _ignore(409, _core().create_namespaced_config_map, ns, obj)
    elif kind == "PodGroup":
        _ignore(409, client.CustomObjectsApi().create_namespaced_custom_object,
                "scheduling.volcano.sh", "v1beta1", ns, "podgroups", obj)
    else:  # pragma: no cover - manifests only builds the kinds above
        raise ValueError(f"unexpected kind {kind}")


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL, initial_delay=INTERVAL)
def reconcile(body: kopf.Body, name: str, namespace: str, patch: kopf.Patch, **_: Any) -> None:
    t0 = time.perf_counter()
    try:
        _reconcile(body, name, namespace, patch)
    except Exception:
        METRICS.reconcile_errors.inc()
        raise
    finally:
        METRICS.reconcile.observe(time.perf_counter() - t0)


def _reconcile(body: kopf.Body, name: str, namespace: str, patch: kopf.Patch) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    raw = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": dict(body["metadata"]),
           "spec": dict(body.get("spec") or {})}
    status = {k: v for k, v in dict(body.get("status") or {}).items() if k != "kopf"}
    job: RLHFJob | None = None
    error: str | None = None
    try:
        live = parse_job({"apiVersion": raw["apiVersion"], "kind": raw["kind"],
                          "metadata": {"name": name, "namespace": namespace}, "spec": raw["spec"]},
                         f"RLHFJob {namespace}/{name}")
        job, changed = _accepted_job(live, namespace)
    except SpecError as err:
        error, changed = str(err), False
    pods = _list_pods(namespace, name)
    plan = decide(job, error, status, [_pod_view(p) for p in pods], now)

    if changed and status.get("phase") not in TERMINAL:
        msg = "spec changed while the job exists; only runPolicy can change: the job keeps its original spec"
        if not any(c.get("reason") == "SpecChangeIgnored" and c.get("status") == "True"
                   for c in plan.status.get("conditions", [])):
            plan.events.append(("Warning", "SpecChangeIgnored", msg))
        set_condition(plan.status, "SpecChangeIgnored", True, "SpecChangeIgnored", msg, now)

    if job is not None and plan.create_static:
        for obj in mf.static_children(raw, job):
            _create(obj)
    if job is not None and plan.create_gang is not None:
        existing = {p["metadata"]["name"] for p in pods}
        for pod in mf.gang_pods(raw, job, plan.create_gang):
            if pod["metadata"]["name"] not in existing:
                _create(pod)
    for pod_name in plan.delete_pods:
        _ignore(404, _core().delete_namespaced_pod, pod_name, namespace, grace_period_seconds=30)
    if job is not None and plan.status.get("phase") == "Running":
        _poll_progress(job, pods, plan.status, now)
    for etype, reason, message in plan.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    if plan.status.get("restarts", 0) > status.get("restarts", 0):
        METRICS.restarts.labels(namespace).inc()
    if plan.status.get("phase") in TERMINAL and status.get("phase") not in TERMINAL:
        started = parse_time(plan.status.get("startTime"))
        if started:
            METRICS.duration.labels(plan.status["phase"]).observe((now - started).total_seconds())
    METRICS.set_phase(namespace, name, plan.status.get("phase"))
    METRICS.job_restarts.labels(namespace, name).set(plan.status.get("restarts", 0))
    if plan.status != status:
        for k, v in plan.status.items():
            patch.status[k] = v
    if plan.delete_job:
        _ignore(404, client.CustomObjectsApi().delete_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                name)


def _poll_progress(job: RLHFJob, pods: list[dict[str, Any]], status: dict[str, Any], now: dt.datetime) -> None:
    head = [p for p in pods if (p["metadata"].get("labels") or {}).get(mf.LABEL_ROLE) == "head"
            and (p.get("status") or {}).get("podIP")]
    if not head or not job.spec.metrics.port:
        return
    ip = head[-1]["status"]["podIP"]
    text = fetch(f"http://{ip}:{job.spec.metrics.port}/metrics")
    if text:
        merge_progress(status, parse_progress(text, job.metadata.name), job.spec.trainer.checkpoint_dir, iso(now))


@kopf.on.delete(GROUP, VERSION, PLURAL)
def cleanup(name: str, namespace: str, **_: Any) -> None:
    """Remove every child by label, for clusters (and test doubles) without garbage collection."""
    core = _core()
    for pod in _list_pods(namespace, name):
        _ignore(404, core.delete_namespaced_pod, pod["metadata"]["name"], namespace, grace_period_seconds=0)
    names = mf.names(name)
    _ignore(404, core.delete_namespaced_service, names["service"], namespace)
    _ignore(404, core.delete_namespaced_config_map, names["configmap"], namespace)
    _ignore((404, 405), client.CustomObjectsApi().delete_namespaced_custom_object,  # 405: no Volcano installed
            "scheduling.volcano.sh", "v1beta1", namespace, "podgroups", names["podgroup"])
    METRICS.set_phase(namespace, name, None)
