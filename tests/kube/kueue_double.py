"""A test double of Kueue's controller (kueue-controller-manager cannot run here): what it writes into a Workload's
status when it admits one and when it evicts one, written through the status subresource as Kueue writes it
(pkg/workload: SetQuotaReservation, SyncAdmittedCondition; pkg/workload's eviction: SetEvictedCondition). The
operator under test reads only these writes."""
from __future__ import annotations

import datetime as dt
from typing import Any

from kubernetes import client

GROUP, VERSION, WORKLOADS, FLAVORS = "kueue.x-k8s.io", "v1beta1", "workloads", "resourceflavors"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _set(conds: list[dict[str, Any]], ctype: str, status: str, reason: str, message: str, gen: int) -> None:
    old = next((c for c in conds if c["type"] == ctype), None)
    entry = {"type": ctype, "status": status, "reason": reason, "message": message, "observedGeneration": gen,
             "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == status else _now()}
    if old:
        conds[conds.index(old)] = entry
    else:
        conds.append(entry)


class KueueDouble:
    """Kueue's writes, by the tests' own client."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace

    def workload(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, WORKLOADS, name)
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise

    def flavor(self, name: str, node_labels: dict[str, str], tolerations: list[dict[str, Any]] = ()) -> None:
        """A ResourceFlavor, as a cluster admin creates it."""
        self.custom.create_cluster_custom_object(GROUP, VERSION, FLAVORS, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor", "metadata": {"name": name},
            "spec": {"nodeLabels": node_labels, "tolerations": list(tolerations)}})

    def _write(self, wl: dict[str, Any], status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, self.namespace, WORKLOADS,
                                                          wl["metadata"]["name"], {"status": status})

    def admit(self, name: str, cluster_queue: str, flavors: dict[str, str],
              counts: dict[str, int] | None = None) -> None:
        """Quota reserved and admitted (no admission checks): every podSet assigned `flavors[podSet]` for cpu and
        memory, `counts[podSet]` pods (default: its count)."""
        wl = self.workload(name)
        assert wl is not None, f"no Workload {name}"
        gen = wl["metadata"].get("generation", 1)
        conds = list((wl.get("status") or {}).get("conditions") or [])
        assignments = [{"name": ps["name"], "flavors": {"cpu": flavors[ps["name"]], "memory": flavors[ps["name"]]},
                        "count": (counts or {}).get(ps["name"], ps["count"]), "resourceUsage": {}}
                       for ps in wl["spec"]["podSets"]]
        _set(conds, "QuotaReserved", "True", "QuotaReserved", f"Quota reserved in ClusterQueue {cluster_queue}", gen)
        for reset in ("Evicted", "Preempted"):
            if any(c["type"] == reset and c["status"] == "True" for c in conds):
                _set(conds, reset, "False", "QuotaReserved", "Previously: evicted", gen)
        _set(conds, "Admitted", "True", "Admitted", "The workload is admitted", gen)
        self._write(wl, {"conditions": conds,
                         "admission": {"clusterQueue": cluster_queue, "podSetAssignments": assignments}})

    def pend(self, name: str, message: str) -> None:
        """Not admitted: Kueue's scheduler saying why (QuotaReserved False, Pending)."""
        wl = self.workload(name)
        assert wl is not None
        conds = list((wl.get("status") or {}).get("conditions") or [])
        _set(conds, "QuotaReserved", "False", "Pending", message, wl["metadata"].get("generation", 1))
        self._write(wl, {"conditions": conds})

    def evict(self, name: str, reason: str = "Preempted", message: str = "Preempted to accommodate a workload "
              "(UID: 1) due to prioritization in the ClusterQueue") -> None:
        """Evicted (Kueue keeps Admitted and the admission until the job's controller gives the quota back)."""
        wl = self.workload(name)
        assert wl is not None
        gen = wl["metadata"].get("generation", 1)
        conds = list((wl.get("status") or {}).get("conditions") or [])
        _set(conds, "Evicted", "True", reason, message, gen)
        if reason == "Preempted":
            _set(conds, "Preempted", "True", "InClusterQueue", message, gen)
        self._write(wl, {"conditions": conds})


def condition(wl: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    return next((c for c in ((wl or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})
