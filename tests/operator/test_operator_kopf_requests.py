"""The operator for real: what it asks of the API server: exactly the rights the chart grants, no request
from a resting job, watches filtered by the server, and only labelled namespaces when cluster-wide."""
import datetime as dt
import re
import time
import urllib.request

from hybridflow_operator.policy import FOR_JOBS_LABEL, NAMESPACE_LABEL
from kube.harness import Kube, wait_for
from kube.operator_cluster import (
    job_doc, _wait_ticks, _phase, _start_running, VERBS, GROUPS, client_networking, _operator_requests, _child,
    _owned_by,
)


def _granted() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the chart's ClusterRole (a clusterWide install) grants the operator: the
    namespaced Roles' rules plus the cluster-scoped reads a cluster-wide kopf needs (CRDs, namespaces)."""
    from support.helm import render_chart

    role = next(d for d in render_chart("cluster-wide") if d["kind"] == "ClusterRole")
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def _rights_used(api) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every request the operator (kopf and our handlers) made."""
    return {(GROUPS.get(r.plural, ""), r.plural, VERBS.get(r.action.name, "patch" if r.method == "PATCH" else "update"))
            for r in list(api.handler.log) if r.agent.startswith(("kopf", "hybridflow-operator")) and r.plural}


# Used only by an install that names the label (clusterWide): test_a_cluster_wide_operator_acts_only_in_labelled_
# namespaces shows it used, and granted.
NAMESPACE_GET = ("", "namespaces", "get")


def test_the_chart_grants_exactly_the_verbs_a_jobs_whole_life_uses(own_cluster):
    """A job that uses every kind of input (checkpoint PVC, reward ConfigMap, Ray Secret, gang scheduling), has a
    gang restart, succeeds and is deleted by its TTL, and one that makes its own token and is deleted: every request the operator (kopf and our handlers) makes is
    allowed by the chart's ClusterRole, and every verb the role grants was needed. Its own cluster: it judges every
    request the operator made since it started, which on the shared one would include other tests' jobs'."""
    from kubernetes import client

    api, kube, _ = own_cluster
    labels = {FOR_JOBS_LABEL: "true"}
    kube.core.create_namespaced_persistent_volume_claim("default", {
        "metadata": {"name": "ck", "labels": labels},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    kube.core.create_namespaced_config_map("default", client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="rw", labels=labels), data={"my_reward.py": "def compute_score(*a): return 1\n"}))
    kube.core.create_namespaced_secret("default", client.V1Secret(
        metadata=client.V1ObjectMeta(name="tok", labels=labels), string_data={"token": "t" * 64}))
    doc = job_doc("rbac", gangScheduling=True, ttlSecondsAfterFinished=0)
    doc["spec"]["models"] = {"actor": {"source": "smollm2"}, "reward": {"type": "function",
                                                                        "function": {"path": "my_reward.py"}}}
    doc["spec"]["kubernetes"] = {"checkpointPvc": "ck", "rewardConfigMap": "rw", "rayAuthSecret": "tok"}
    kube.create_job(doc)
    # the gang and the sandbox pod that runs the reward function (it outlives the gang's restart)
    wait_for(lambda: len(kube.pods("rbac")) == 3, 30, "the gang")
    kube.set_pod_phase("rbac-default-0-g0", "Failed", exit_code=1)
    gen1 = wait_for(lambda: sorted(p.metadata.name for p in kube.pods("rbac"))
                    == ["rbac-default-0-g1", "rbac-env-0", "rbac-head-g1"] and kube.pods("rbac"), 30, "generation 1")
    for p in gen1:
        kube.set_pod_phase(p.metadata.name, "Running")
    wait_for(lambda: _phase(kube, "rbac") == "Running", 30, "Running")
    kube.set_pod_phase("rbac-head-g1", "Succeeded", exit_code=0)
    wait_for(lambda: kube.job("rbac") is None, 30, "the TTL deletion")
    wait_for(lambda: not api.objects("networking.k8s.io/v1/networkpolicies"), 30, "cleanup")
    kube.create_job(job_doc("rbac-own-token"))  # no Secret named: the operator makes the job's token
    wait_for(lambda: len(kube.pods("rbac-own-token")) == 2, 30, "its gang")
    kube.delete_job("rbac-own-token")
    wait_for(lambda: kube.job("rbac-own-token") is None, 30, "deletion")
    assert [s["metadata"]["name"] for s in api.objects("v1/secrets")] == ["tok"], "the job's own token went with it"

    used = _rights_used(api)
    # a status write is a PATCH of rlhfjobs/status; the double records the plural only
    granted = _granted() | {(g, r.split("/")[0], v) for g, r, v in _granted() if r.endswith("/status")}
    assert used - granted == set(), "requests the chart's role would refuse"
    unused = {(g, r, v) for g, r, v in _granted() if "/" not in r} - used - {NAMESPACE_GET}
    assert unused == set(), "verbs granted but never used: trim them"


def _resting_ticks(op) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()
    return float(re.search(r"^hybridflow_operator_resting_ticks_total (\S+)$", body, re.M).group(1))


def test_a_job_waiting_for_a_missing_pvc_looks_again_rarely_and_never_posts_its_children_twice(cluster):
    """Issue 24 N8: a job waiting for a PVC used to re-POST its ConfigMap, Service, NetworkPolicy and Secret (each
    answered 409, then read back) and re-read the claim at every tick: 8 requests a tick. Now its children are
    created once and it looks for the claim with a backoff (the reconcile interval doubling, up to a minute)."""
    api, kube, op = cluster
    doc = job_doc("jwait")
    doc["spec"]["kubernetes"] = {"checkpointPvc": "missing-claim"}
    kube.create_job(doc)
    wait_for(lambda: kube.status("jwait").get("reason") == "InputsMissing", 30, "InputsMissing")
    rested = _resting_ticks(op)
    _wait_ticks(op, kube, "jwait", n=8)  # 2 s of ticks at 0.25 s: its backoff is past a second now
    since, t0 = len(api.handler.log), time.monotonic()
    _wait_ticks(op, kube, "jwait", n=16)  # a 4 s window: 16 ticks used to be 128 requests
    window = _operator_requests(api, kube.namespace, since)
    assert len(window) <= 3, [(r.method, r.plural, r.status) for r in window]
    assert all(r.method == "GET" and r.plural == "persistentvolumeclaims" for r in window), window
    assert 60 * len(window) / (time.monotonic() - t0) < 60, "more than one look a second"
    everything = _operator_requests(api, kube.namespace)
    posts = sorted(r.plural for r in everything if r.method == "POST" and r.plural != "events")
    assert posts == ["configmaps", "networkpolicies", "secrets", "services"], posts  # each once, no pod
    assert [r for r in everything if r.status == 409] == []
    assert _resting_ticks(op) >= rested + 16  # kopf still ticks it: each tick returns before any API call
    # A followed child deleted while it waits ends its rest: made again at once, not when its backoff is up (the
    # look that follows this one is 8 s away by now).
    looked = len(api.requests("GET", "persistentvolumeclaims", kube.namespace))
    wait_for(lambda: len(api.requests("GET", "persistentvolumeclaims", kube.namespace)) > looked, 30, "its next look")
    t0, uid = time.monotonic(), kube.job("jwait")["metadata"]["uid"]
    client_networking(kube).delete_namespaced_network_policy("jwait-ingress", kube.namespace)
    wait_for(lambda: _owned_by(_child(api, kube, "NetworkPolicy", "jwait-ingress"), uid), 30, "its NetworkPolicy back")
    assert time.monotonic() - t0 < 3, "made again only when its backoff was up"


def test_a_suspended_job_makes_no_requests_and_resumes_at_the_next_tick(cluster):
    """Issue 24 N8: 5,000 suspended jobs used to be ~1,000 GETs a second; a suspended job now rests until it is
    changed, and unsuspending it (any change to the object ends a rest) starts its pods at the next tick."""
    api, kube, op = cluster
    kube.create_job(job_doc("jsusp", suspend=True))
    wait_for(lambda: _phase(kube, "jsusp") == "Suspended", 30, "Suspended")
    _wait_ticks(op, kube, "jsusp", n=2)  # the write that made it Suspended has come back by the watch
    # Children deleted while it is suspended (no pod to fence) do not end its rest; its resume makes them again.
    kept = (("ConfigMap", "jsusp-spec"), ("NetworkPolicy", "jsusp-ingress"))
    kube.core.delete_namespaced_config_map("jsusp-spec", kube.namespace)
    client_networking(kube).delete_namespaced_network_policy("jsusp-ingress", kube.namespace)
    since, rested = len(api.handler.log), _resting_ticks(op)
    _wait_ticks(op, kube, "jsusp", n=12)  # 3 s of ticks
    window = _operator_requests(api, kube.namespace, since)
    assert window == [], [(r.method, r.plural, r.status) for r in window]
    assert _resting_ticks(op) >= rested + 11  # returned at once: not even parsed and decided
    t0 = time.monotonic()
    kube.patch_job("jsusp", {"spec": {"runPolicy": {"suspend": False}}})
    wait_for(lambda: len(kube.pods("jsusp")) == 2, 30, "pods once unsuspended")
    assert time.monotonic() - t0 < 3, "the resume waited past the next ticks"
    uid = kube.job("jsusp")["metadata"]["uid"]
    assert all(_owned_by(_child(api, kube, kind, name), uid) for kind, name in kept), "not made again at the resume"


def test_a_finished_job_rests_until_its_ttl_and_is_deleted_on_time(cluster):
    """Issue 24 N8: a terminal job rests without requests, and its rest ends at its TTL
    (runPolicy.ttlSecondsAfterFinished), not a tick later than the next one."""
    api, kube, op = cluster
    ttl = 8  # room for a resting window well before it, on a busy machine too
    _start_running(kube, "jttl", ttlSecondsAfterFinished=ttl)
    kube.set_pod_phase("jttl-head-g0", "Succeeded", exit_code=0)
    wait_for(lambda: _phase(kube, "jttl") == "Succeeded", 30, "Succeeded")
    completed = dt.datetime.fromisoformat(kube.job("jttl")["status"]["completionTime"].replace("Z", "+00:00"))
    due = completed.timestamp() + ttl  # what the operator counts from (completionTime: whole seconds, rounded down)
    _wait_ticks(op, kube, "jttl", n=2)
    since, rested = len(api.handler.log), _resting_ticks(op)
    wait_for(lambda: time.time() > due - 2.5, ttl, "most of its TTL")
    resting = [r for r in _operator_requests(api, kube.namespace, since) if r.plural != "events"]
    assert resting == [], [(r.method, r.plural, r.status) for r in resting]
    assert _resting_ticks(op) > rested
    wait_for(lambda: kube.job("jttl") is None, 30, "deleted after its TTL")
    gone = time.time()
    assert gone >= due - 0.5, f"deleted {due - gone:.1f} s before its TTL"
    assert gone < due + 1 + 3, f"deleted {gone - due:.1f} s after its TTL"


def test_the_followed_childrens_watches_are_filtered_by_the_api_server():
    """The pod, Service and NetworkPolicy watches ask the API server (labelSelector) for the jobs' objects only, not
    for every pod, Service and NetworkPolicy of the namespaces served; nothing else is watched by this selector."""
    import kopf
    from hybridflow_operator.watch import watch_children_only

    settings = kopf.OperatorSettings()
    watch_children_only(settings)
    selected = {r: settings.watching.label_selectors.collect(kopf.Resource(*r)) for r in
                (("", "v1", "pods"), ("", "v1", "services"), ("networking.k8s.io", "v1", "networkpolicies"),
                 ("", "v1", "configmaps"), ("serving.knative.dev", "v1", "services"))}
    assert selected == {("", "v1", "pods"): ["hybridflow.io/job"], ("", "v1", "services"): ["hybridflow.io/job"],
                        ("networking.k8s.io", "v1", "networkpolicies"): ["hybridflow.io/job"],
                        ("", "v1", "configmaps"): [], ("serving.knative.dev", "v1", "services"): []}


def test_a_cluster_wide_operator_acts_only_in_labelled_namespaces(labelled_cluster):
    """Issue 24, a platform reviewer's objection 2: a cluster-wide operator acts only in namespaces labelled
    hybridflow.io/jobs=enabled. A job in a namespace without the label, or in one it cannot find, gets no finalizer,
    no status, no children and no request at all in that namespace; one in a labelled namespace runs. The label is
    read with `get namespaces` (granted by the clusterWide ClusterRole only), once per namespace while cached."""
    api, kubeconfig, op = labelled_cluster
    key, value = NAMESPACE_LABEL.split("=")
    api.put_namespace("team-on", {key: value, "team": "a"})
    api.put_namespace("team-off", {"team": "b", key: "disabled"})
    on, off, nowhere = Kube(kubeconfig, "team-on"), Kube(kubeconfig, "team-off"), Kube(kubeconfig, "team-nowhere")
    t0 = time.monotonic()
    for k in (off, nowhere):
        k.create_job(job_doc("left-alone"))
    on.create_job(job_doc("served"))
    pods = wait_for(lambda: len(on.pods("served")) == 2 and on.pods("served"), 30, "the gang in the labelled namespace")
    for p in pods:
        on.set_pod_phase(p.metadata.name, "Running")
    wait_for(lambda: _phase(on, "served") == "Running", 30, "Running")
    _wait_ticks(op, on, "served")  # the jobs left alone had as many chances
    for k in (off, nowhere):
        job = k.job("left-alone")
        assert not job["metadata"].get("finalizers") and not job.get("status"), (k.namespace, job)
        assert k.pods("left-alone") == []
        for resource in ("v1/configmaps", "v1/services", "v1/secrets", "networking.k8s.io/v1/networkpolicies",
                         "v1/events"):
            assert api.objects(resource, k.namespace) == [], (k.namespace, resource)
    ours = [r for r in list(api.handler.log) if r.agent.startswith(("kopf", "hybridflow-operator"))]
    assert not [r for r in ours if r.namespace in ("team-off", "team-nowhere")]
    log = op.log()
    assert log.count(f"namespace team-off does not carry {NAMESPACE_LABEL}") == 1, "said once, with what to do"
    assert f"kubectl label namespace team-off {NAMESPACE_LABEL}" in log
    asked = [r for r in ours if r.plural == "namespaces"]
    assert {(r.method, r.status) for r in asked} <= {("GET", 200), ("GET", 404)}
    from hybridflow_operator.state import NAMESPACE_TTL

    assert len(asked) <= 3 * (1 + int((time.monotonic() - t0) // NAMESPACE_TTL)), "cached: not one GET per tick"
    granted = _granted()
    assert NAMESPACE_GET in _rights_used(api) and NAMESPACE_GET in granted
    assert _rights_used(api) - granted - {(g, r.split("/")[0], v) for g, r, v in granted} == set()
    on.delete_job("served")
    for k, name in ((on, "served"), (off, "left-alone"), (nowhere, "left-alone")):
        if k is not on:
            k.delete_job(name)
        wait_for(lambda: k.job(name) is None, 30, f"{k.namespace}/{name} gone")
