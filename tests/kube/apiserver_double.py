"""A test double of the kube-apiserver: kmock's stateful Kubernetes emulator served over real HTTP, plus what a
real API server does and kmock 0.8 does not (see STACK.md): resourceVersion/uid/creationTimestamp/generation,
`generateName`, 422 on a failed JSON-patch `test`, a delete's preconditions (uid, resourceVersion: 409 Conflict when
the object is another), label selectors on lists, `kind` on lists, Table rendering of our printer columns, our CRD's
scale subresource (`kubectl scale`), pods' logs (as the kubelet double put them), the discovery of our CRD, and the core group's discovery spelled as kubectl
expects ("v1", not "/v1").

It stands in for the API server only; kopf, kubectl and our operator talk to it as they would to a cluster."""
from __future__ import annotations

import asyncio
import datetime
import itertools
import threading
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import apps, enums, k8s, k8s_views, rendering

RESOURCES = {
    "hybridflow.io/v1alpha1/rlhfjobs": kmock.ResourceInfo(
        kind="RLHFJob", singular="rlhfjob", namespaced=True, shortnames={"rlhf"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"}, subresources={"status", "scale"}),
    "v1/pods": kmock.ResourceInfo(kind="Pod", singular="pod", namespaced=True,
                                  verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"}),
    "v1/services": kmock.ResourceInfo(kind="Service", singular="service", namespaced=True,
                                      verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "v1/configmaps": kmock.ResourceInfo(kind="ConfigMap", singular="configmap", namespaced=True,
                                        verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "v1/persistentvolumeclaims": kmock.ResourceInfo(kind="PersistentVolumeClaim", singular="persistentvolumeclaim",
                                                    namespaced=True, shortnames={"pvc"},
                                                    verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "v1/secrets": kmock.ResourceInfo(kind="Secret", singular="secret", namespaced=True,
                                     verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "v1/events": kmock.ResourceInfo(kind="Event", singular="event", namespaced=True,
                                    verbs={"get", "list", "create", "patch"}),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", singular="namespace", namespaced=False,
                                        verbs={"get", "list", "watch"}),
    "networking.k8s.io/v1/networkpolicies": kmock.ResourceInfo(
        kind="NetworkPolicy", singular="networkpolicy", namespaced=True, shortnames={"netpol"},
        verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "scheduling.volcano.sh/v1beta1/podgroups": kmock.ResourceInfo(
        kind="PodGroup", singular="podgroup", namespaced=True, verbs={"get", "list", "watch", "create", "delete"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False,
        verbs={"get", "list", "watch", "create", "patch", "delete"}),
    "scheduling.k8s.io/v1/priorityclasses": kmock.ResourceInfo(
        kind="PriorityClass", singular="priorityclass", namespaced=False, shortnames={"pc"},
        verbs={"get", "list", "watch", "create", "patch", "delete"}),
}
# Kueue's Workload and ResourceFlavor, from the CRDs written from Kueue's v1beta1 API reference (kueue-v1beta1.yaml):
# served as a cluster with Kueue installed serves them.
KUEUE_CRDS = list(yaml.safe_load_all((Path(__file__).with_name("kueue-v1beta1.yaml")).read_text()))
for _crd in KUEUE_CRDS:
    _names, _version = _crd["spec"]["names"], _crd["spec"]["versions"][0]
    RESOURCES[f"{_crd['spec']['group']}/{_version['name']}/{_names['plural']}"] = kmock.ResourceInfo(
        kind=_names["kind"], singular=_names["singular"], namespaced=_crd["spec"]["scope"] == "Namespaced",
        shortnames=set(_names.get("shortNames", [])), verbs={"get", "list", "watch", "create", "patch", "delete"},
        subresources=set(_version.get("subresources", {})))


class MatchedAlone(apps.RawHandler):
    """kmock's matching of a request with its reaction, over a log that holds only that request.

    kmock finds a request's reaction by looking for the request, by identity, among every request it has received,
    through each reaction's filter: a request costs (reactions x requests logged) filter checks, 7 ms after 200
    requests and 100 ms after 1,000. Trimming the log to the last 50 still left it the double's largest cost (41%
    of the bench's samples with 5,000 jobs), and a request that waited behind 50 newer ones would not be found
    (500). The matching runs without a pause from here to the reaction it picks (no custom reactions, no slicers:
    only kmock's own fallbacks, whose filters look at the request alone), so the log needs only this request. The
    tests read requests from the double's own `log`, not kmock's."""
    __slots__ = ()  # kmock's handlers are slotted: this class sits between two of them (see KubeApiServerDouble)

    async def _handle(self, request: rendering.Request) -> Any:
        self._requests[:] = [request]
        return await super()._handle(request)


@attrs.frozen(eq=False, order=False)
class IndexedObjects(k8s_views.ObjectsArray):
    """kmock's store of objects, with each resource's keys also kept apart (in the store's own order).

    kmock 0.8 answers every fetch, create, patch and delete by comparing the request with every object stored, of
    every resource, events included, and every list by the same scan plus one more for the resources known: each
    request costs time in proportion to all the objects, and a run of N jobs, each making a few requests, grows as
    N squared (bench/operator_scale.py's 5,000 suspended jobs took 296 s only to be created). The API server finds
    an object by its key; this index lets the double do the same, and list one resource without reading the
    others."""
    _keys: dict = attrs.field(factory=dict, init=False)  # resource -> {(resource, namespace, name): None}

    def __setitem__(self, key: Any, value: Any, /) -> None:
        k8s_views.ObjectsArray.__setitem__(self, key, value)
        if len(key) == 3:  # an object (a 4-item key is a version in its history)
            resource = k8s_views._parse_resource(key[0])
            self._keys.setdefault(resource, {})[(resource, key[1], key[2])] = None

    def __delitem__(self, key: Any, /) -> None:
        k8s_views.ObjectsArray.__delitem__(self, key)
        if len(key) == 3:
            resource = k8s_views._parse_resource(key[0])
            self._keys.get(resource, {}).pop((resource, key[1], key[2]), None)

    def clear(self) -> None:
        k8s_views.ObjectsArray.clear(self)
        self._keys.clear()

    def get(self, key: tuple) -> Any:
        """The object stored under (resource, namespace, name), soft-deleted or not; None if none ever was."""
        return self._objects.get(key)

    def of(self, resource: Any) -> list[tuple[tuple, Any]]:
        """(key, object) of every object of this resource ever stored, in the order kmock's own scan finds them."""
        return [(key, self._objects[key]) for key in self._keys.get(resource, ())]

    def resources(self) -> set:
        """The resources of the objects stored (what kmock's discovery adds to those declared)."""
        return {resource for resource, keys in self._keys.items() if keys}


@attrs.frozen
class Seen:
    """One request as the double saw it."""
    method: str
    action: Any
    plural: str | None
    namespace: str | None
    data: dict | None
    agent: str = ""  # the client's User-Agent: which program asked
    status: int | None = None  # the HTTP status it was answered with (None: not answered yet, or a stream)


@attrs.define(eq=False)
class KubeApiServerDouble(kmock.KubernetesEmulator, MatchedAlone):  # kmock's emulator, then MatchedAlone's matching
    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    peers: set = attrs.field(factory=set, init=False)  # (host, port) of every client connection seen
    log: list = attrs.field(factory=list, init=False)  # a Seen per request, for the tests' assertions
    # plural -> (status, message): creates an admission controller would refuse (Pod Security admission: 403,
    # a webhook: 403 or 422), set by a test with `refuse_creates`.
    refusals: dict = attrs.field(factory=dict, init=False)
    # name -> Namespace object, for GET /api/v1/namespaces/{name} (`put_namespace`). kmock cannot serve namespaces
    # (it parses /api/v1/namespaces/X as the namespace of a resource; its lists and creates of them 500, STACK.md),
    # and objects here live in namespaces nobody created: a namespace not put here answers 404, as a real API
    # server answers for one that does not exist.
    namespaces: dict = attrs.field(factory=dict, init=False)
    # (namespace, pod) -> its containers' log, for GET pods/NAME/log (`put_log`: the kubelet double's part).
    pod_logs: dict = attrs.field(factory=dict, init=False)

    def refuse_creates(self, plural: str, status: int | None, message: str = "") -> None:
        """Stand in for an admission controller refusing every create of `plural` (None: admit them again)."""
        if status is None:
            self.refusals.pop(plural, None)
        else:
            self.refusals[plural] = (status, message)

    def put_namespace(self, name: str, labels: dict[str, str]) -> None:
        """Create the Namespace or replace its labels (a `kubectl label namespace`), with the
        kubernetes.io/metadata.name label the API server gives every namespace."""
        known = self.namespaces.get(name)
        meta = dict(known["metadata"]) if known else {"name": name, "uid": str(uuid.uuid4()),
                                                      "creationTimestamp": _now()}
        meta.update(resourceVersion=str(next(self._versions)),
                    labels={**labels, "kubernetes.io/metadata.name": name})
        self.namespaces[name] = {"apiVersion": "v1", "kind": "Namespace", "metadata": meta,
                                 "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._objects = IndexedObjects()  # before anything is stored
        for key, info in RESOURCES.items():
            self.resources[key] = info

    def _KubernetesEmulator__get_objs(self, request: rendering.Request, strict: bool) -> list:
        """kmock's lookup of the objects a request names (its private `__get_objs`: the same objects, in the same
        order), by key and by resource instead of a comparison with every object stored (see IndexedObjects)."""
        objects: IndexedObjects = self._objects
        if request.resource is None:
            return []
        if strict and request.name is not None:  # fetch, create, patch, delete: one key
            obj = objects.get((request.resource, request.namespace, request.name))
            return [] if obj is None else [obj]
        return [obj for (_, namespace, name), obj in objects.of(request.resource)
                if (namespace == request.namespace if strict else request.namespace in (None, namespace))
                and (request.name is None or name == request.name)]

    def _get_resources(self) -> list:
        """The resources declared or seen in an object (kmock's own reads every object for it: see IndexedObjects)."""
        return list(set(k8s.KubernetesScaffold._get_resources(self)) | self._objects.resources())

    async def _handle(self, request: rendering.Request) -> Any:
        raw = request._raw_request
        if raw is not None and raw.transport is not None:  # which TCP connection: counts clients' connections
            self.peers.add(raw.transport.get_extra_info("peername"))
        namespace_get = _namespace_get(request)
        seen = Seen(str(request.method).upper().rsplit(".", 1)[-1], request.action,
                    request.resource.plural if request.resource is not None else None, request.namespace,
                    request.data if isinstance(request.data, dict) else None, request.headers.get("User-Agent", ""))
        if namespace_get:  # what it is: a get of the cluster-scoped namespace, not a list in a namespace
            seen = attrs.evolve(seen, action=enums.action.FETCH, plural="namespaces", namespace=None)
        self.log.append(seen)
        at = len(self.log) - 1  # one event loop: nothing was appended since
        try:
            response = await (self._serve_namespace(namespace_get) if namespace_get else self._answer(request))
        except kmock.KubernetesError as err:
            self.log[at] = attrs.evolve(seen, status=err.status)  # e.g. 409 to a create of an existing object
            raise
        self.log[at] = attrs.evolve(seen, status=getattr(response, "status", None))
        return response

    async def _serve_namespace(self, name: str) -> Any:
        if name not in self.namespaces:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f'namespaces "{name}" not found',
                                        details={"name": name, "kind": "namespaces"})
        return aiohttp.web.json_response(self.namespaces[name])

    def put_log(self, namespace: str, name: str, text: str) -> None:
        """What the pod's containers wrote (a kubelet keeps it; the API server proxies `pods/log` to it)."""
        self.pod_logs[(namespace, name)] = text

    async def _serve_log(self, request: rendering.Request) -> Any:
        """GET pods/NAME/log: the text put_log stored (the whole of it: the pod has ended, so `follow` ends too)."""
        obj = self._objects.get((request.resource, request.namespace, request.name))
        if obj is None or obj.deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f'pods "{request.name}" not found')
        return aiohttp.web.Response(text=self.pod_logs.get((request.namespace, request.name), ""),
                                    content_type="text/plain")

    async def _answer(self, request: rendering.Request) -> Any:
        if request.subresource == "log" and request.resource is not None and request.resource.plural == "pods":
            return await self._serve_log(request)
        if request.subresource == "scale" and request.resource is not None \
                and _resource_key(request.resource) in SCALE_PATHS:
            return await self._serve_scale(request)
        refusal = self.refusals.get(request.resource.plural) if request.resource is not None else None
        if refusal and request.action == enums.action.CREATE:
            status, message = refusal
            raise kmock.KubernetesError(status=status, reason="Forbidden" if status == 403 else "Invalid",
                                        message=message)
        if request.resource is not None and request.action == enums.action.CREATE and isinstance(request.data, dict):
            # The request is frozen, its parsed body is not: stamp the fields in place.
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            meta["resourceVersion"] = str(next(self._versions))
            meta.setdefault("generation", 1)
            if request.namespace and "namespace" not in meta:
                meta["namespace"] = request.namespace
        elif request.resource is not None and request.action == enums.action.UPDATE and request.name:
            self._stamp_update(request)
        elif request.resource is not None and request.action == enums.action.DELETE and request.name:
            self._check_preconditions(request)
        return await super()._handle(request)

    async def _serve_scale(self, request: rendering.Request) -> Any:
        """The CRD's scale subresource (`kubectl scale`, an HPA): an autoscaling/v1 Scale read from the paths the
        CRD names; a write of spec.replicas is a merge patch of the object at specReplicasPath (a change of its
        spec, with the resourceVersion and generation such a patch gets)."""
        paths = SCALE_PATHS[_resource_key(request.resource)]
        if request.action not in (enums.action.FETCH, enums.action.UPDATE):
            raise kmock.KubernetesError(status=405, reason="MethodNotAllowed", message="scale: get, update, patch")
        if request.action == enums.action.UPDATE:
            replicas = ((request.data or {}).get("spec") or {}).get("replicas") if isinstance(request.data, dict) \
                else None
            if not isinstance(replicas, int) or replicas < 0:
                raise KubeUnprocessable(message="Scale.spec.replicas: Invalid value: must be a non-negative integer")
            patch: dict[str, Any] = {"replicas": replicas}
            for part in reversed(paths["specReplicasPath"].strip(".").split(".")[:-1]):
                patch = {part: patch}
            await self._answer(attrs.evolve(request, subresource=None, data=patch))
        key = (request.resource, request.namespace, request.name)
        obj = self._objects.get(key)
        if obj is None or obj.deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound",
                                        message=f'{request.resource.plural} "{request.name}" not found')
        raw, meta = obj.raw, obj.raw.get("metadata", {})
        return aiohttp.web.json_response({
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                         if k in meta},
            "spec": {"replicas": _json_path(raw, paths["specReplicasPath"]) or 0},
            "status": {"replicas": _json_path(raw, paths["statusReplicasPath"]) or 0,
                       "selector": _json_path(raw, paths.get("labelSelectorPath", "")) or ""}})

    def _check_preconditions(self, request: rendering.Request) -> None:
        """DeleteOptions.preconditions, as the API server checks them (apiserver's storage Preconditions.Check): an
        object of that name whose uid or resourceVersion is not the one given is not deleted, 409 Conflict."""
        given = (request.data or {}).get("preconditions") if isinstance(request.data, dict) else None
        key = (request.resource, request.namespace, request.name)
        if not given or key not in self._objects or self._objects[key].deleted:
            return  # nothing to compare with: the delete answers 404 as usual
        meta = self._objects[key].raw.get("metadata", {})
        for field, what in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            if given.get(field) is not None and given[field] != meta.get(field):
                group, plural = request.resource.group, request.resource.plural
                resource = plural + (f".{group}" if group else "")
                where = f"/registry/{group + '/' if group else ''}{plural}/{request.namespace}/{request.name}"
                raise kmock.KubernetesError(
                    status=409, reason="Conflict",
                    message=f'Operation cannot be fulfilled on {resource} "{request.name}": StorageError: invalid '
                            f"object, Code: 4, Key: {where}, ResourceVersion: 0, "
                            f"AdditionalErrorMsg: Precondition failed: {what} in precondition: {given[field]}, "
                            f"{what} in object meta: {meta.get(field)}",
                    details={"name": request.name, "group": request.resource.group or "",
                             "kind": request.resource.plural})

    def _stamp_update(self, request: rendering.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        current = self._objects[key].raw if key in self._objects and not self._objects[key].deleted else None
        version = str(next(self._versions))
        if isinstance(request.data, list):  # JSON patch: honour `test`, then stamp the version
            if current is not None:
                try:
                    jsonpatch.apply_patch(current, [op for op in request.data if op.get("op") == "test"])
                except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as err:
                    raise KubeUnprocessable(message=str(err)) from None
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
        elif isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {}) or {}
            request.data["metadata"] = meta
            meta["resourceVersion"] = version
            if current is not None and "spec" in request.data and request.subresource != "status":
                meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1

    async def _serve_version(self, request: rendering.Request) -> Any:
        """kmock names the core group's version "/v1"; kubectl only maps kinds of a groupVersion spelled "v1"."""
        payload = await super()._serve_version(request)
        payload["groupVersion"] = payload["groupVersion"].lstrip("/")
        return payload

    async def _serve_list(self, request: rendering.Request) -> Any:
        payload = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        items = payload["items"]
        if selector:
            want = dict(part.split("=", 1) for part in selector.split(",") if "=" in part)
            items = [i for i in items if all(i.get("metadata", {}).get("labels", {}).get(k) == v for k, v in want.items())]
        info = RESOURCES.get(_resource_key(request.resource)) if request.resource else None
        kind = f"{info.kind}List" if info and info.kind else "List"
        api_version = _api_version(request.resource)
        if "as=Table" in request.headers.get("Accept", "") and _resource_key(request.resource) in PRINTER_COLUMNS:
            return _table(items, PRINTER_COLUMNS[_resource_key(request.resource)])
        return {"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": str(next(self._versions))},
                "items": items}


def _load_printer_columns() -> dict[str, list[dict[str, Any]]]:
    """additionalPrinterColumns of our CRD, as the API server reads them to answer `kubectl get`."""
    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "rlhfjob.yaml").read_text())
    version = crd["spec"]["versions"][0]
    key = f"{crd['spec']['group']}/{version['name']}/{crd['spec']['names']['plural']}"
    return {key: version["additionalPrinterColumns"]}


PRINTER_COLUMNS = _load_printer_columns()


def _load_scale_paths() -> dict[str, dict[str, str]]:
    """The scale subresource's paths of our CRD, as the API server reads them to answer `kubectl scale`."""
    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "rlhfjob.yaml").read_text())
    version = crd["spec"]["versions"][0]
    key = f"{crd['spec']['group']}/{version['name']}/{crd['spec']['names']['plural']}"
    return {key: version["subresources"]["scale"]}


SCALE_PATHS = _load_scale_paths()


def _json_path(obj: dict[str, Any], path: str) -> Any:
    node: Any = obj
    for part in path.strip(".").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _age(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    then = datetime.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    secs = int((datetime.datetime.now(tz=datetime.timezone.utc) - then).total_seconds())
    return f"{secs}s" if secs < 120 else f"{secs // 60}m"


def _table(items: list[dict[str, Any]], columns: list[dict[str, Any]]) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table, as the API server renders custom resources for kubectl."""
    defs = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
    defs += [{"name": c["name"], "type": "string" if c["type"] == "date" else c["type"], "format": "",
              "description": c.get("description", ""), "priority": c.get("priority", 0)} for c in columns]
    rows = []
    for obj in items:
        cells: list[Any] = [obj["metadata"]["name"]]
        for c in columns:
            value = _json_path(obj, c["jsonPath"])
            cells.append(_age(value) if c["type"] == "date" else value)
        rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                "metadata": obj["metadata"]}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": "1"},
            "columnDefinitions": defs, "rows": rows}


@attrs.frozen
class KubeUnprocessable(kmock.KubernetesError):
    """422, as a real API server answers a JSON patch whose `test` fails (e.g. a stale resourceVersion)."""
    status: int = 422
    reason: str = "Invalid"


def _api_version(resource: Any) -> str:
    if resource is None:
        return "v1"
    return f"{resource.group}/{resource.version}" if resource.group else resource.version


def _now() -> str:
    return datetime.datetime.now(tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class RunningApiServer:
    """The double served on 127.0.0.1 from a background thread, with a kubeconfig for kopf and kubectl."""

    def __init__(self, kubeconfig_path: str) -> None:
        self.kubeconfig_path = kubeconfig_path
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.handler: KubeApiServerDouble | None = None
        self.url = ""
        self._thread = threading.Thread(target=self._run, daemon=True, name="kube-apiserver-double")

    def __enter__(self) -> "RunningApiServer":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the API server double did not start")
        with open(self.kubeconfig_path, "w") as f:
            f.write(KUBECONFIG.format(url=self.url))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.loop and self._stop:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with KubeApiServerDouble() as handler, kmock.Server(handler, host="127.0.0.1") as server:
            self.handler = handler
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def objects(self, resource: str, namespace: str | None = None) -> list[dict]:
        """Live objects of a resource (e.g. 'v1/pods'), read on the server's own loop."""
        assert self.loop and self.handler

        objects: IndexedObjects = self.handler.objects

        async def read() -> list[dict]:
            return [obj.raw for res in objects.resources() if _resource_key(res) == resource
                    for (_, ns, _), obj in objects.of(res)
                    if (namespace is None or ns == namespace) and not obj.deleted]

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)

    def requests(self, method: str, plural: str, namespace: str | None = None) -> list["Seen"]:
        """Requests the double received, e.g. requests("POST", "pods"): what a client really sent."""
        assert self.handler is not None
        return [r for r in list(self.handler.log)
                if r.method == method and r.plural == plural and (namespace is None or r.namespace == namespace)]

    def put_namespace(self, name: str, labels: dict[str, str]) -> None:
        """See KubeApiServerDouble.put_namespace (run on the server's own loop)."""
        assert self.loop and self.handler
        handler = self.handler

        async def put() -> None:
            handler.put_namespace(name, labels)

        asyncio.run_coroutine_threadsafe(put(), self.loop).result(10)

    def put_log(self, namespace: str, name: str, text: str) -> None:
        """See KubeApiServerDouble.put_log."""
        assert self.handler is not None
        self.handler.put_log(namespace, name, text)

    def refuse_creates(self, plural: str, status: int | None, message: str = "") -> None:
        """See KubeApiServerDouble.refuse_creates."""
        assert self.handler is not None
        self.handler.refuse_creates(plural, status, message)

    def watches(self, plural: str) -> int:
        """How many watch requests on this resource clients have opened so far."""
        assert self.handler is not None
        return sum(1 for r in list(self.handler.log) if r.action == enums.action.WATCH and r.plural == plural)

    def watching(self, plural: str) -> bool:
        """Whether a client (kopf) has opened a watch on this resource: objects created later reach it."""
        return self.watches(plural) > 0


def _namespace_get(request: rendering.Request) -> str | None:
    """The name, when the request is GET /api/v1/namespaces/{name} (kmock sees no resource in it)."""
    raw = request._raw_request
    if (request.resource is not None and request.resource.plural) or raw is None or raw.method != "GET" \
            or "watch=true" in raw.query_string:
        return None
    parts = raw.path.strip("/").split("/")
    return parts[3] if len(parts) == 4 and parts[:3] == ["api", "v1", "namespaces"] and parts[3] else None


def _resource_key(res: Any) -> str:
    return f"{res.group}/{res.version}/{res.plural}" if res.group else f"{res.version}/{res.plural}"


KUBECONFIG = """apiVersion: v1
kind: Config
clusters:
- name: double
  cluster: {{server: "{url}"}}
users:
- name: tester
  user: {{token: "test-double"}}
contexts:
- name: double
  context: {{cluster: double, user: tester, namespace: default}}
current-context: double
"""
