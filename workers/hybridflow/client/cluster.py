"""The client's calls on a cluster: an RLHFJob created, read and deleted through the Kubernetes API with the
caller's own credentials (a kubeconfig, or a pod's ServiceAccount), the driver's log read from the head pod, and
the step log and checkpoints read where the job keeps them: object storage (trainer.checkpointDir s3://...) with
the caller's own credentials, or the checkpoint PersistentVolumeClaim where the caller has it mounted (a notebook
pod beside the jobs: `checkpoint_mount`). The operator is never asked for anything: what it knows is in status."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from hybridflow.api import API_GROUP, PLURAL, VERSION, SpecError, dump_job
from hybridflow.api.names import head_pod_name
from hybridflow.api.storage import CHECKPOINT_MOUNT, is_url, job_checkpoint_dir, job_checkpoint_url
from hybridflow.client import storage
from hybridflow.client.jobs import Snapshot, Source, manifest, snapshot_of, wait_for_end

HEAD_CONTAINER = "controller"  # the driver's container in the head pod (the operator's manifests name it)


class KubernetesJob:
    """One RLHFJob on the cluster (the Job protocol)."""

    def __init__(self, jobs: KubernetesJobs, name: str) -> None:
        self.jobs, self.name = jobs, name

    def _object(self) -> dict[str, Any]:
        try:
            return self.jobs.custom.get_namespaced_custom_object(API_GROUP, VERSION, self.jobs.namespace, PLURAL,
                                                                 self.name)
        except ApiException as err:
            raise _api_error(err, f"RLHFJob {self.jobs.namespace}/{self.name}") from None
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise _Transient(f"RLHFJob {self.jobs.namespace}/{self.name}: {err}") from err

    def status(self) -> Snapshot:
        snap = snapshot_of(self._object().get("status") or {})
        mount, seen = self.jobs.checkpoint_mount, snap.last_checkpoint
        if mount and seen.startswith(CHECKPOINT_MOUNT + "/"):  # the pod's path, as this client sees the claim
            snap = replace(snap, last_checkpoint=str(Path(mount) / seen[len(CHECKPOINT_MOUNT) + 1:]))
        return snap

    def wait(self, timeout: float | None = None, progress: bool = True, poll: float = 2.0) -> Snapshot:
        return wait_for_end(self.name, self._status_through_blips, time.sleep, timeout, progress, poll)

    def _status_through_blips(self) -> Snapshot:
        """status(), asked again over an API server's passing trouble (429, 5xx, a dropped connection) for up to
        TRANSIENT_SECONDS, so one blip does not end a wait of hours."""
        deadline = time.monotonic() + TRANSIENT_SECONDS
        pause = 1.0
        while True:
            try:
                return self.status()
            except _Transient:
                if time.monotonic() > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 15.0)

    def logs(self, follow: bool = False) -> Iterator[str]:
        """The driver's log: the head pod of the job's current gang generation (a finished job keeps its head pod,
        and so its log, until runPolicy.ttlSecondsAfterFinished). `follow`: waits for the head to start, and goes
        on to the next generation's head after a gang restart, until the job ends."""
        while True:
            snap = self.status()
            pod = head_pod_name(self.name, snap.restarts)
            try:
                resp = self.jobs.core.read_namespaced_pod_log(pod, self.jobs.namespace, container=HEAD_CONTAINER,
                                                              follow=follow, _preload_content=False)
            except ApiException as err:
                if follow and err.status in (400, 404) and not snap.done:  # not started yet, or between heads
                    time.sleep(2.0)
                    continue
                raise _api_error(err, f"the log of pod {self.jobs.namespace}/{pod}") from None
            try:
                yield from _lines(resp.stream(4096))
            finally:
                resp.release_conn()
            if not follow:
                return
            while not (now := self.status()).done and now.restarts == snap.restarts:
                time.sleep(2.0)  # the head ended: the job's end, or a new generation, is on its way
            if now.done and now.restarts == snap.restarts:
                return

    def checkpoint_dir(self) -> str:
        """Where the job keeps its checkpoints and step log, as this client reaches them."""
        spec, ns = self._object().get("spec") or {}, self.jobs.namespace
        where = (spec.get("trainer") or {}).get("checkpointDir", "")
        claim = (spec.get("kubernetes") or {}).get("checkpointPvc")
        if is_url(where):
            return job_checkpoint_url(where, ns, self.name)
        if claim and self.jobs.checkpoint_mount:
            return job_checkpoint_dir(str(self.jobs.checkpoint_mount), ns, self.name)
        if claim:
            raise SpecError(f"RLHFJob {ns}/{self.name} keeps its checkpoints on PersistentVolumeClaim {claim}: "
                            "connect(checkpoint_mount=...) with the path where this client has that claim mounted "
                            "(a pod mounting it), or give the job an object-storage trainer.checkpointDir")
        raise SpecError(f"RLHFJob {ns}/{self.name} keeps its checkpoints inside its pods only (no "
                        "kubernetes.checkpointPvc, no object-storage trainer.checkpointDir): nothing outside them "
                        "can read them")

    def steps(self) -> list[dict[str, Any]]:
        return storage.steps(self.checkpoint_dir())

    def checkpoints(self) -> list[str]:
        return storage.checkpoints(self.checkpoint_dir())

    def export(self, to: str | Path, checkpoint: str | int | None = None, role: str = "actor",
               dtype: str | None = None) -> Path:
        return storage.export(self.checkpoint_dir(), to, checkpoint, role, dtype)

    def delete(self) -> None:
        try:
            self.jobs.custom.delete_namespaced_custom_object(API_GROUP, VERSION, self.jobs.namespace, PLURAL,
                                                             self.name)
        except ApiException as err:
            if err.status != 404:
                raise _api_error(err, f"RLHFJob {self.jobs.namespace}/{self.name}") from None


class KubernetesJobs:
    """RLHFJobs in one namespace, with the caller's credentials: `kubeconfig` (default: $KUBECONFIG or
    ~/.kube/config, else the pod's ServiceAccount) and its context's namespace unless `namespace` is given.
    `checkpoint_mount`: where this client sees the jobs' checkpoint PersistentVolumeClaim (`<mount>/<namespace>/<job>`
    is a job's directory on it)."""

    def __init__(self, namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None,
                 checkpoint_mount: str | Path | None = None, api_client: client.ApiClient | None = None) -> None:
        if api_client is None:
            api_client, ns = _api_client(kubeconfig, context)
            namespace = namespace or ns
        self.namespace = namespace or "default"
        self.checkpoint_mount = checkpoint_mount
        api_client.user_agent = "hybridflow-client"
        self.custom, self.core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)

    def submit(self, source: Source, name: str | None = None) -> KubernetesJob:
        """Create the RLHFJob (validated here first, as `hybridflow validate` does: a SpecError names the field)."""
        job = manifest(source, name=name, namespace=self.namespace)
        doc = json.loads(json.dumps(dump_job(job)))
        try:
            self.custom.create_namespaced_custom_object(API_GROUP, VERSION, self.namespace, PLURAL, doc)
        except ApiException as err:
            if err.status == 409:
                raise FileExistsError(f"RLHFJob {self.namespace}/{job.metadata.name} exists already; submit it "
                                      "under another name (submit(..., name=...)), or delete that one") from None
            raise _api_error(err, f"RLHFJob {self.namespace}/{job.metadata.name}") from None
        return KubernetesJob(self, job.metadata.name)

    def get(self, name: str) -> KubernetesJob:
        job = KubernetesJob(self, name)
        job.status()  # there, and readable by this caller
        return job


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
TRANSIENT_SECONDS = 300.0  # how long a wait rides out the API server's trouble
TRANSIENT_STATUSES = (429, 500, 502, 503, 504)


class _Transient(RuntimeError):
    """The API server's passing trouble: asked again (KubernetesJob._status_through_blips)."""


def _api_client(kubeconfig: str | None, context: str | None) -> tuple[client.ApiClient, str | None]:
    """A client from the kubeconfig (the one named, else $KUBECONFIG or ~/.kube/config) and its context's
    namespace; inside a pod with no kubeconfig at all, its ServiceAccount's. A kubeconfig that is there but wrong
    (an unknown context, a bad file) is an error saying so, not a silent try of the in-cluster config."""
    from kubernetes.config.kube_config import KUBE_CONFIG_DEFAULT_LOCATION

    default = os.path.expanduser(os.environ.get("KUBECONFIG", KUBE_CONFIG_DEFAULT_LOCATION).split(os.pathsep)[0])
    if kubeconfig is None and context is None and not os.path.exists(default) \
            and os.path.exists(SERVICE_ACCOUNT_NAMESPACE):
        config.load_incluster_config()
        return client.ApiClient(), Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip()
    contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)
    chosen = next((c for c in contexts if c["name"] == context), None) if context else current
    if chosen is None:
        raise LookupError(f"kubeconfig {kubeconfig or default}: no context {context!r} (its contexts: "
                          f"{', '.join(c['name'] for c in contexts)})")
    return (config.new_client_from_config(config_file=kubeconfig, context=chosen["name"]),
            chosen["context"].get("namespace"))


def _lines(chunks: Iterator[bytes]) -> Iterator[str]:
    """Lines from a byte stream, each decoded whole (a UTF-8 character split between chunks stays one)."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (ln.decode(errors="replace") for ln in lines)
    if pending:
        yield pending.decode(errors="replace")


def _api_error(err: ApiException, what: str) -> Exception:
    """The API server's answer, in its own words, as the exception a script expects."""
    try:
        message = json.loads(err.body).get("message") or err.reason
    except (TypeError, ValueError, AttributeError):
        message = err.reason
    text = f"{what}: {message} ({err.status})"
    if err.status in TRANSIENT_STATUSES or err.status == 0:
        return _Transient(text)
    if err.status == 404:
        return LookupError(text)
    if err.status in (401, 403):
        return PermissionError(text)
    if err.status == 422:
        return SpecError(text)
    return RuntimeError(text)
