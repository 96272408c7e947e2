"""The kube-apiserver double itself: it finds an object by its key, as the API server does, not by reading every
object it holds (kmock 0.8 does: creating bench/operator_scale.py's 5,000 jobs took 296 s, and none was Suspended
by then), and its answers are the ones kmock's own lookup gives."""
import random

import kmock
from kmock._internal import filtering, k8s, references
from kube.apiserver_double import KubeApiServerDouble, RunningApiServer
from kube.harness import Kube
from kubernetes import client

JOBS = references.resource("hybridflow.io/v1alpha1/rlhfjobs")
PODS = references.resource("v1/pods")
EVENTS = references.resource("v1/events")


def test_lookups_answer_what_kmocks_own_scan_answers():
    """Fetches (strict, by name) and lists (any namespace, or one), among objects put, replaced, soft-deleted and
    removed: the same objects in the same order as kmock's scan of every object, and the same resources known."""
    double, rng = KubeApiServerDouble(), random.Random(24)
    for i in range(3000):
        key = (rng.choice([JOBS, PODS, EVENTS]), rng.choice(["default", "b", None]), f"o{rng.randrange(300)}")
        roll = rng.random()
        if roll < 0.8:
            double.objects[key] = {"metadata": {"name": key[2], "i": i}}
        elif key in double.objects:
            (double.objects.__delitem__(key) if roll < 0.9 else double.objects[key].delete())
    scan = k8s.KubernetesEmulator._KubernetesEmulator__get_objs  # kmock's own, on the same store
    checked = 0
    for resource in (JOBS, PODS, EVENTS, references.resource("v1/secrets"), None):
        for namespace in ("default", "b", None):
            for name in [None, *(f"o{j}" for j in range(0, 300, 7))]:
                for strict in (True, False):
                    request = kmock.Request(resource=resource, namespace=namespace, name=name)
                    got = double._KubernetesEmulator__get_objs(request, strict)
                    assert [id(o) for o in got] == [id(o) for o in scan(double, request, strict)], request
                    checked += bool(got)
    assert checked > 100, "the lookups found objects"
    assert set(double._get_resources()) == set(k8s.KubernetesEmulator._get_resources(double))


def test_a_request_costs_the_same_among_many_objects_and_after_many_requests(tmp_path, monkeypatch):
    """With 20,000 events stored and 60 requests made, a create, fetch, patch and list of a job compare resources a
    few times each (kmock's scan compares one per object stored: 20,000 a request) and check kmock's filters only
    against themselves (kmock checks every request it logged: thousands of checks for these 5); the answers are
    right."""
    with RunningApiServer(str(tmp_path / "kubeconfig")) as api:
        for i in range(20_000):
            api.handler.objects[EVENTS, "default", f"e{i}"] = {"metadata": {"name": f"e{i}", "namespace": "default"}}
        kube = Kube(api.kubeconfig_path)
        for _ in range(60):  # requests before: kmock looks for each request among those it received
            assert kube.core.list_namespaced_pod("default").items == []
        compared, checked = [0], [0]
        equal, check = references.resource.__eq__, filtering.Criteria._check

        def counting(self, other):
            compared[0] += 1
            return equal(self, other)

        def counting_checks(self, *args, **kwargs):
            checked[0] += 1
            return check(self, *args, **kwargs)

        monkeypatch.setattr(references.resource, "__eq__", counting)
        monkeypatch.setattr(filtering.Criteria, "_check", counting_checks)
        kube.create_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "j"},
                         "spec": {}})
        assert kube.job("j")["metadata"]["name"] == "j"
        kube.patch_job("j", {"spec": {"x": 1}})
        assert [j["metadata"]["name"] for j in kube.custom.list_namespaced_custom_object(
            "hybridflow.io", "v1alpha1", "default", "rlhfjobs")["items"]] == ["j"]
        assert kube.job("j")["spec"] == {"x": 1}
        assert compared[0] < 2_000, f"{compared[0]} resource comparisons for 5 requests among 20,000 objects"
        assert checked[0] < 1_000, f"{checked[0]} filter checks for 5 requests after 60"
        try:
            kube.core.read_namespaced_pod("nope", "default")
        except client.ApiException as err:
            assert err.status == 404
        else:
            raise AssertionError("a pod that was never created was found")


def test_kubectl_scale_writes_the_rollout_pool_size_through_the_scale_subresource(tmp_path):
    """`kubectl scale rlhfjob/j --replicas=N` (and an HPA) go through the CRD's scale subresource: N lands at its
    specReplicasPath (spec.rolloutPool.replicas, the rest of the spec untouched, the generation bumped as for any
    spec change), and the Scale read back carries the status paths (status.rolloutReplicas, rolloutSelector)."""
    import json
    import os
    import subprocess

    with RunningApiServer(str(tmp_path / "kubeconfig")) as api:
        kube = Kube(api.kubeconfig_path)
        kube.create_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "j"},
                         "spec": {"rolloutPool": {"replicas": 1, "maxReplicas": 3}, "trainer": {"steps": 5}}})
        kube.custom.patch_namespaced_custom_object_status(
            "hybridflow.io", "v1alpha1", "default", "rlhfjobs", "j",
            {"status": {"rolloutReplicas": 1, "rolloutSelector": "hybridflow.io/job=j,hybridflow.io/pool=rollout"}})
        env = {**os.environ, "KUBECONFIG": api.kubeconfig_path}
        out = subprocess.run(["kubectl", "scale", "rlhfjob/j", "--replicas=2"], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and "scaled" in out.stdout, out.stderr
        job = kube.job("j")
        assert job["spec"] == {"rolloutPool": {"replicas": 2, "maxReplicas": 3}, "trainer": {"steps": 5}}
        assert job["metadata"]["generation"] == 2
        got = subprocess.run(["kubectl", "get", "--raw", "/apis/hybridflow.io/v1alpha1/namespaces/default/"
                              "rlhfjobs/j/scale"], env=env, capture_output=True, text=True, timeout=60)
        scale = json.loads(got.stdout)
        assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 2}
        assert scale["status"] == {"replicas": 1, "selector": "hybridflow.io/job=j,hybridflow.io/pool=rollout"}
