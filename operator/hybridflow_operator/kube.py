"""The operator's calls to the Kubernetes API, over one client made at startup (`handlers.configure`).

One object, not module functions over a global client: the handlers reach it through kopf's memo with everything
else the operator shares, and tests hand the helpers that read the cluster a double with the same methods.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple

from kubernetes import client
from kubernetes.client.rest import ApiException

from hybridflow_operator import kueue
from hybridflow_operator import manifests as mf

USER_AGENT = "hybridflow-operator"
# Seconds any one Kubernetes API call may take: a hung connection must not wedge a job's timer.
API_TIMEOUT = float(os.environ.get("HYBRIDFLOW_API_TIMEOUT", "30"))


def ignore(status: int | tuple[int, ...], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call fn (with the API timeout); an ApiException with one of these statuses (409: exists, 404: gone) counts
    as success."""
    kwargs.setdefault("_request_timeout", API_TIMEOUT)
    try:
        return fn(*args, **kwargs)
    except ApiException as err:
        if err.status not in ((status,) if isinstance(status, int) else status):
            raise
        return None


def controllers(obj: dict[str, Any]) -> list[str]:
    """The uids of the object's controller ownerReferences (a child of a job has exactly its job's)."""
    return [r.get("uid") for r in obj.get("metadata", {}).get("ownerReferences") or [] if r.get("controller")]


# The custom resources the operator makes for a job: (group, version, plural) by kind.
CUSTOM_KINDS = {"PodGroup": ("scheduling.volcano.sh", "v1beta1", "podgroups"),
                "Workload": (kueue.GROUP, kueue.VERSION, kueue.WORKLOADS)}


class _Kind(NamedTuple):
    """How to create (namespace, body), read (namespace, name) and delete (namespace, name) one kind of child."""
    create: Callable[..., Any]
    read: Callable[..., Any]
    delete: Callable[..., Any]


class Kube:
    """The API calls of the operator's own handlers (kopf makes its own): one connection pool for every call (a
    client per call opened a connection each), tagged with the operator's User-Agent, so audit logs (and the tests'
    API double) tell its requests apart."""

    def __init__(self, api: client.ApiClient) -> None:
        api.user_agent = USER_AGENT
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.networking = client.NetworkingV1Api(api)
        self.scheduling = client.SchedulingV1Api(api)

    def _kind(self, kind: str) -> _Kind:
        """The API calls of a kind of child (manifests builds only these kinds)."""
        if kind in CUSTOM_KINDS:
            custom, (group, version, plural) = self.custom, CUSTOM_KINDS[kind]
            return _Kind(
                lambda ns, body, **kw: custom.create_namespaced_custom_object(group, version, ns, plural, body, **kw),
                lambda ns, name, **kw: custom.get_namespaced_custom_object(group, version, ns, plural, name, **kw),
                lambda ns, name, **kw: custom.delete_namespaced_custom_object(group, version, ns, plural, name,
                                                                              **kw))
        api, suffix = {"Pod": (self.core, "pod"), "Service": (self.core, "service"),
                       "ConfigMap": (self.core, "config_map"), "Secret": (self.core, "secret"),
                       "NetworkPolicy": (self.networking, "network_policy")}[kind]
        return _Kind(lambda ns, body, **kw: getattr(api, f"create_namespaced_{suffix}")(ns, body, **kw),
                     lambda ns, name, **kw: getattr(api, f"read_namespaced_{suffix}")(name, ns, **kw),
                     lambda ns, name, **kw: getattr(api, f"delete_namespaced_{suffix}")(name, ns, **kw))

    def create(self, obj: dict[str, Any]) -> Any:
        """Create by name; None when it already exists (409)."""
        return ignore(409, self._kind(obj["kind"]).create, obj["metadata"]["namespace"], obj)

    def read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as plain JSON, or None when it is not there (404; 405: a kind this cluster lacks). Never a
        Secret: the operator does not read them (and holds no verb to)."""
        resp = ignore((404, 405), self._kind(kind).read, namespace, name, _preload_content=False)
        return None if resp is None else json.loads(resp.data)

    def delete(self, kind: str, namespace: str, name: str, uid: str, **options: Any) -> None:
        """Delete this very object (its uid the precondition: 409 when the name now holds another, which stays)."""
        body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid), **options)
        ignore((404, 409), self._kind(kind).delete, namespace, name, body=body)

    def delete_owned(self, kind: str, namespace: str, name: str, job_uid: str | None) -> None:
        """Delete the object of that name only if this job controls it."""
        found = self.read(kind, namespace, name)
        if found is not None and job_uid and controllers(found) == [job_uid]:
            self.delete(kind, namespace, name, found["metadata"]["uid"])

    def list_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """The job's pods, by its label. Raw JSON rather than the client's models: the pure functions work on plain
        dicts."""
        resp = self.core.list_namespaced_pod(namespace, label_selector=mf.selector(name), _preload_content=False,
                                             _request_timeout=API_TIMEOUT)
        return json.loads(resp.data).get("items", [])
