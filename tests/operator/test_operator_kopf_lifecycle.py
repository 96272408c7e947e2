"""The operator for real (`kopf run` over HTTP against the kube-apiserver double, pods driven by a kubelet
double): a job's life, from its children made to its deletion, through failures, restarts, suspends, deadlines,
spec edits, a restarted operator and an elastic rollout pool's scaling. The clusters: kube/operator_cluster.py."""
import base64
import copy
import hashlib
import json
import os
import subprocess
import time
import urllib.request

import yaml

from kube.harness import wait_for
from kube.operator_cluster import (
    ROOT, TINY, job_doc, _wait_ticks, _phase, _reasons, _pod_names, _run_all, _start_running,
)


def test_create_makes_children_and_runs(cluster):
    api, kube, op = cluster
    kube.create_job(job_doc("j1"))
    pods = wait_for(lambda: len(kube.pods("j1")) == 2 and kube.pods("j1"), 30, "head + 1 worker pod")
    names = sorted(p.metadata.name for p in pods)
    assert names == ["j1-default-0-g0", "j1-head-g0"], names
    ns = kube.namespace
    assert wait_for(lambda: api.objects("v1/services", ns), 10, "head service")[0]["spec"]["clusterIP"] == "None"
    cms = api.objects("v1/configmaps", ns)
    assert cms and "job.json" in cms[0]["data"]
    # Ray's token: made by the operator for this job, owned by it, the one every pod reads
    secret = next(s for s in api.objects("v1/secrets", ns) if s["metadata"]["name"] == "j1-ray-token")
    assert len(base64.b64decode(secret["data"]["token"])) == 64
    assert secret["metadata"]["ownerReferences"][0]["name"] == "j1"
    for p in pods:
        env = {e.name: e for e in p.spec.containers[0].env}
        assert env["RAY_AUTH_MODE"].value == "token"
        assert env["RAY_AUTH_TOKEN"].value_from.secret_key_ref.name == "j1-ray-token"
    netpol = api.objects("networking.k8s.io/v1/networkpolicies", ns)
    assert [n["metadata"]["name"] for n in netpol] == ["j1-ingress"]
    for p in pods:
        assert p.metadata.owner_references[0].kind == "RLHFJob"
        kube.set_pod_phase(p.metadata.name, "Running")
    wait_for(lambda: _phase(kube, "j1") == "Running", 30, "phase Running")
    st = kube.status("j1")
    assert any(c["type"] == "Running" and c["status"] == "True" for c in st["conditions"])
    # status.pools: the one pool, the job's roles on it (JobSpec.roles), its pod counted Ready once its kubelet says so
    kube.core.patch_namespaced_pod_status("j1-default-0-g0", ns, {"status": {"conditions": [
        {"type": "Ready", "status": "True"}]}})
    assert wait_for(lambda: (p := kube.status("j1").get("pools")) and p[0]["ready"] and p, 30, "a Ready pool pod") == [
        {"name": "default", "roles": ["actor", "rollout", "reference"], "pods": 1, "ready": 1}]
    head = next(p for p in pods if "head" in p.metadata.name)
    kube.set_pod_phase(head.metadata.name, "Succeeded", exit_code=0)
    wait_for(lambda: _phase(kube, "j1") == "Succeeded", 30, "phase Succeeded")
    wait_for(lambda: [p.metadata.name for p in kube.pods("j1")] == [head.metadata.name], 30, "workers cleaned up")


def test_a_failed_pool_pod_is_replaced_alone_and_the_head_keeps_running(cluster):
    """restartPolicy failedPod (the default): the failed pool pod is deleted and made again under its name; the
    head is never deleted (its uid stays), no gang generation is used, the event says which pod and what was kept."""
    _, kube, _ = cluster
    _start_running(kube, "jr", replacementLimit=1)
    uids = {p.metadata.name: p.metadata.uid for p in kube.pods("jr")}
    kube.set_pod_phase("jr-default-0-g0", "Failed", exit_code=137)
    wait_for(lambda: kube.status("jr").get("podReplacements") == 1, 30, "the replacement counted")
    wait_for(lambda: (new := {p.metadata.name: p.metadata.uid for p in kube.pods("jr")}).keys() == uids.keys()
             and new["jr-default-0-g0"] != uids["jr-default-0-g0"], 30, "a new pod under the failed pod's name")
    assert {p.metadata.name: p.metadata.uid for p in kube.pods("jr")}["jr-head-g0"] == uids["jr-head-g0"]
    st = kube.status("jr")
    assert st["restarts"] == 0 and st["phase"] == "Running", st
    wait_for(lambda: "PodReplaced" in _reasons(kube, "jr"), 30, lambda: f"events: {_reasons(kube, 'jr')}")
    assert "GangRestart" not in _reasons(kube, "jr")
    _run_all(kube, "jr")
    wait_for(lambda: "replacing" not in kube.status("jr"), 30, "the new pod seen")
    kube.set_pod_phase("jr-default-0-g0", "Failed", exit_code=137)  # replacementLimit 1 used: the gang restarts
    wait_for(lambda: kube.status("jr").get("restarts") == 1, 30, "a gang restart past the replacement limit")


def test_failed_worker_restarts_the_gang_then_backoff_fails_the_job(cluster):
    _, kube, op = cluster
    _start_running(kube, "j2", backoffLimit=1, restartPolicy="gang")
    kube.set_pod_phase("j2-default-0-g0", "Failed", exit_code=137)
    wait_for(lambda: kube.status("j2").get("restarts") == 1, 30, "restart counted")
    wait_for(lambda: _pod_names(kube, "j2") == ["j2-default-0-g1", "j2-head-g1"], 30, "generation-1 gang")
    st = kube.status("j2")
    assert st["phase"] in ("Pending", "Initializing")
    # kopf posts events after the status write that the waits above saw, from a background task
    wait_for(lambda: {"GangRestart", "GangRestarted"} <= set(_reasons(kube, "j2")), 30,
             lambda: f"GangRestart and GangRestarted events; events: {_reasons(kube, 'j2')}")
    _run_all(kube, "j2")
    wait_for(lambda: _phase(kube, "j2") == "Running", 30, "Running again")
    kube.set_pod_phase("j2-head-g1", "Failed", exit_code=1)
    wait_for(lambda: _phase(kube, "j2") == "Failed", 30, "Failed")
    st = kube.status("j2")
    assert st["reason"] == "BackoffLimitExceeded" and "backoffLimit=1" in st["message"]
    assert "j2-head-g1" in st["message"] and "exited with code 1" in st["message"]
    assert any(c["type"] == "Failed" and c["status"] == "True" and c["reason"] == "BackoffLimitExceeded"
               for c in st["conditions"])


def test_suspend_keeps_status_and_resume_recreates_the_gang(cluster):
    """Status that a fresh job could not have (a restart, a GangRestart condition) survives suspend and resume."""
    _, kube, _ = cluster
    _start_running(kube, "j3", restartPolicy="gang")
    kube.set_pod_phase("j3-default-0-g0", "Failed", exit_code=137)
    wait_for(lambda: _pod_names(kube, "j3") == ["j3-default-0-g1", "j3-head-g1"], 30, "generation-1 gang")
    _run_all(kube, "j3")
    wait_for(lambda: _phase(kube, "j3") == "Running", 30, "Running again")
    kube.patch_job("j3", {"spec": {"runPolicy": {"suspend": True}}})
    wait_for(lambda: _phase(kube, "j3") == "Suspended", 30, "Suspended")
    assert kube.pods("j3") == []
    st = kube.status("j3")
    assert st["restarts"] == 1 and st["startTime"]
    kube.patch_job("j3", {"spec": {"runPolicy": {"suspend": False}}})
    wait_for(lambda: _pod_names(kube, "j3") == ["j3-default-0-g1", "j3-head-g1"], 30, "the same generation again")
    st = kube.status("j3")
    assert st["restarts"] == 1
    assert any(c["type"] == "Suspended" and c["status"] == "False" and c["reason"] == "Resumed"
               for c in st["conditions"])


def test_delete_removes_every_child(cluster):
    api, kube, _ = cluster
    kube.create_job(job_doc("j4", gangScheduling=True))
    wait_for(lambda: len(kube.pods("j4")) == 2, 30, "pods")
    ns = kube.namespace
    assert wait_for(lambda: api.objects("scheduling.volcano.sh/v1beta1/podgroups", ns), 10, "podgroup")
    kube.delete_job("j4")
    wait_for(lambda: kube.job("j4") is None, 30, "job gone")
    assert kube.pods("j4") == []
    assert not [s for s in api.objects("v1/services", ns) if s["metadata"]["name"].startswith("j4-")]
    assert not [c for c in api.objects("v1/configmaps", ns) if c["metadata"]["name"].startswith("j4-")]
    assert not api.objects("scheduling.volcano.sh/v1beta1/podgroups", ns)


def test_operator_restart_mid_job_creates_no_duplicates(own_cluster):
    """Its own cluster: it kills the operator."""
    api, kube, op = own_cluster
    _start_running(kube, "j5")
    before = _pod_names(kube, "j5")
    watches = api.watches("rlhfjobs")
    op.stop(kill=True)
    since = len(op.log())
    op.start()
    wait_for(lambda: api.watches("rlhfjobs") > watches, 60, "the new operator's watch")

    _wait_ticks(op, kube, "j5", since=since)  # several reconciles by the new operator
    assert _pod_names(kube, "j5") == before
    assert _phase(kube, "j5") == "Running" and kube.status("j5")["restarts"] == 0
    assert len([c for c in api.objects("v1/configmaps") if c["metadata"]["name"] == "j5-spec"]) == 1


BAD_SPECS = [
    ({"rollout": {"responsesPerPrompt": 0}}, "spec.rollout.responsesPerPrompt"),
    ({"rollout": {"responsesPerPrompt": "four"}}, "spec.rollout.responsesPerPrompt"),
    ({"rollout": {"temperature": -1}}, "spec.rollout.temperature"),
    ({"rollout": {"topP": 2}}, "spec.rollout.topP"),
    ({"rollout": {"engine": "sglang"}}, "spec.rollout.engine"),
    ({"trainer": {"steps": 0}}, "spec.trainer.steps"),
    ({"trainer": {"promptsPerStep": 33}}, "spec.trainer.promptsPerStep"),
    ({"trainer": {"resume": "sometimes"}}, "spec.trainer.resume"),
    ({"trainer": {"unknownField": 1}}, "spec.trainer.unknownField"),
    ({"training": {"microBatchSize": -2}}, "spec.training.microBatchSize"),
    ({"training": {"engine": "deepspeed"}}, "spec.training.engine"),
    ({"training": {"tensorParallel": 2}}, "spec.training.tensorParallel"),
    ({"training": {"actorLr": 0}}, "spec.training.actorLr"),
    ({"algorithm": {"name": "dpo"}}, "spec.algorithm.name"),
    ({"algorithm": {"klEstimator": "k4"}}, "spec.algorithm.klEstimator"),
    ({"algorithm": {"gamma": 1.5}}, "spec.algorithm.gamma"),
    ({"models": {"actor": {"source": "path"}}}, "spec.models.actor"),
    ({"models": {"reward": {"rule": "nope"}}}, "spec.models.reward.rule"),
    ({"models": {"reward": {"type": "model"}}}, "spec.models.reward"),
    ({"placement": {"critic": "nowhere"}}, "spec.placement.critic"),
    ({"resourcePools": [{"name": "UPPER"}]}, "spec.resourcePools[0].name"),
    ({"resourcePools": []}, "spec.resourcePools"),
    ({"runPolicy": {"backoffLimit": -1}}, "spec.runPolicy.backoffLimit"),
    ({"kubernetes": {"imagePullPolicy": "Sometimes"}}, "spec.kubernetes.imagePullPolicy"),
    # issue 24 N3, N6: what the job's pods may not have, refused at acceptance (manifests.resolved_job)
    ({"trainer": {"checkpointDir": "s3://bucket/runs"}}, "spec.kubernetes.checkpointSecret"),
    ({"trainer": {"resumeFrom": "/var/lib/hybridflow/checkpoints/other-team/their-job"},
      "kubernetes": {"checkpointPvc": "ck"}}, "spec.trainer.resumeFrom"),
]


def test_malformed_jobs_fail_with_the_field_named_and_the_operator_survives(cluster):
    _, kube, op = cluster
    for i, (patch, field) in enumerate(BAD_SPECS):
        doc = job_doc(f"bad{i}")
        for section, value in patch.items():
            if isinstance(value, dict) and isinstance(doc["spec"].get(section), dict):
                doc["spec"][section].update(value)
            else:
                doc["spec"][section] = value
        kube.create_job(doc)
    for i, (_, field) in enumerate(BAD_SPECS):
        st = wait_for(lambda: kube.status(f"bad{i}").get("phase") == "Failed" and kube.status(f"bad{i}"), 30,
                      f"bad{i} Failed")
        assert st["reason"] == "ValidationFailed", st
        assert field in st["message"], (field, st["message"])
        assert kube.pods(f"bad{i}") == []
    assert op.proc.poll() is None, "the operator must survive malformed jobs"
    kube.create_job(job_doc("good-after-bad"))
    wait_for(lambda: len(kube.pods("good-after-bad")) == 2, 30, "a valid job still works")


def test_progress_comes_from_the_drivers_metrics(cluster):
    """The head pod's IP is loopback here and a real driver exporter (JobMetrics) serves on the job's port."""
    from hybridflow.metrics import JobMetrics
    from kube.harness import free_port

    _, kube, _ = cluster
    port = free_port()
    exporter = JobMetrics("j6")
    exporter.serve(port, "127.0.0.1")
    exporter.total_steps.labels("j6").set(40)
    exporter.record_step({"step": 7, "tokens": 100.0, "throughput_tokens_per_s": 1234.5, "throughput_per_device": 1.0,
                          "generation_tokens_per_s": 1.0, "iteration_seconds": 1.0, "eta_seconds": 33.0}, {})
    exporter.checkpoint_step.labels("j6").set(5)
    doc = job_doc("j6")
    doc["spec"]["metrics"]["port"] = port
    kube.create_job(doc)
    wait_for(lambda: len(kube.pods("j6")) == 2, 30, "pods")
    for p in kube.pods("j6"):
        kube.set_pod_phase(p.metadata.name, "Running", pod_ip="127.0.0.1")
    st = wait_for(lambda: kube.status("j6").get("step") == 7 and kube.status("j6"), 30, "step in status")
    assert st["tokensPerSecond"] == 1234.5 and st["totalSteps"] == 40 and st["etaSeconds"] == 33
    assert st["lastCheckpoint"].endswith("/step_00000005") and st["lastCheckpointTime"]


def test_deadline_and_ttl(cluster):
    _, kube, _ = cluster
    kube.create_job(job_doc("j7", activeDeadlineSeconds=2))  # its deadline runs out while j8 runs
    _start_running(kube, "j8", ttlSecondsAfterFinished=1)  # a kubelet reports Running before Succeeded
    kube.set_pod_phase("j8-head-g0", "Succeeded", exit_code=0)
    wait_for(lambda: _phase(kube, "j8") == "Succeeded", 30, "Succeeded")
    t0 = time.monotonic()
    # The TTL deletion is issued from inside a reconcile: kopf used to hold the finalizer for 60 s after it.
    wait_for(lambda: kube.job("j8") is None, 30, "finished job deleted after its TTL")
    assert time.monotonic() - t0 < 1 + 10, "the TTL deletion was held up"
    assert kube.pods("j8") == []
    wait_for(lambda: _phase(kube, "j7") == "Failed", 30, "deadline Failed")
    assert kube.status("j7")["reason"] == "DeadlineExceeded"


class SlowMetrics:
    """A driver metrics endpoint that answers after `delay` seconds, so the operator's reconcile (which polls it
    while the job runs) is busy most of the time; `polled` is set while a poll is in flight."""

    def __init__(self, delay: float) -> None:
        import http.server
        import threading

        from kube.harness import free_port

        self.port, self.polled = free_port(), threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.polled.set()
                time.sleep(delay)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"")
                outer.polled.clear()

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "SlowMetrics":
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_deleting_a_job_mid_reconcile_releases_it_within_10s(cluster):
    _, kube, _ = cluster
    with SlowMetrics(delay=1.5) as metrics:
        doc = job_doc("j-busy")
        doc["spec"]["metrics"]["port"] = metrics.port
        kube.create_job(doc)
        wait_for(lambda: len(kube.pods("j-busy")) == 2, 30, "pods")
        for p in kube.pods("j-busy"):
            kube.set_pod_phase(p.metadata.name, "Running", pod_ip="127.0.0.1")
        assert metrics.polled.wait(30), "the operator never polled the driver's metrics"
        t0 = time.monotonic()
        kube.delete_job("j-busy")  # while that reconcile is still waiting for the answer
        wait_for(lambda: kube.job("j-busy") is None, 30, "job released")
        assert time.monotonic() - t0 < 10
    assert kube.pods("j-busy") == []


def test_many_jobs_at_once_each_start_exactly_once(cluster):
    """The first reconcile of a job and the next one must not both start it: one Created event and one create
    request per child, with no status write in between to tell the second tick."""
    api, kube, op = cluster
    names = [f"many{i}" for i in range(8)]
    for n in names:
        kube.create_job(job_doc(n))
    for n in names:
        wait_for(lambda: len(kube.pods(n)) == 2 and _phase(kube, n) == "Pending", 60, f"{n} started")
    _wait_ticks(op, kube, *names)  # several more reconciles of each

    def created():
        return [e.involved_object.name for e in kube.events() if e.reason == "Created"]

    wait_for(lambda: set(created()) == set(names), 30, lambda: f"a Created event of each job; {created()}")
    assert sorted(created()) == sorted(names), created()
    pod_posts = api.requests("POST", "pods", kube.namespace)
    assert len([r for r in pod_posts if (r.data or {}).get("metadata", {}).get("name", "").startswith("many")]) \
        == 2 * len(names)


def test_spec_changes_other_than_run_policy_are_ignored_with_a_warning(cluster):
    api, kube, _ = cluster
    kube.create_job(job_doc("j9"))
    wait_for(lambda: len(kube.pods("j9")) == 2, 30, "pods")
    # object storage without kubernetes.checkpointSecret too: refused at acceptance, only ignored once accepted
    kube.patch_job("j9", {"spec": {"trainer": {"steps": 999, "checkpointDir": "s3://bucket/runs"}}})
    st = wait_for(lambda: any(c["type"] == "SpecChangeIgnored" for c in kube.status("j9").get("conditions", []))
                  and kube.status("j9"), 30, "SpecChangeIgnored")
    assert st["totalSteps"] == 40
    cm = next(c for c in api.objects("v1/configmaps", kube.namespace) if c["metadata"]["name"] == "j9-spec")
    assert json.loads(cm["data"]["job.json"])["spec"]["trainer"]["steps"] == 40
    wait_for(lambda: "SpecChangeIgnored" in _reasons(kube, "j9"), 30,  # posted after the status write
             lambda: f"a SpecChangeIgnored event; events: {_reasons(kube, 'j9')}")
    digest = "sha256:" + hashlib.sha256(cm["data"]["job.json"].encode()).hexdigest()
    assert kube.status("j9")["acceptedSpecDigest"] == digest  # what the pods run


def test_a_spec_configmap_the_job_does_not_own_is_never_used(cluster):
    """Someone made `<job>-spec` before the job existed: the operator's create is refused (409, already there), and
    pods mounting it would run the stranger's spec. The job fails instead, naming the ConfigMap."""
    from kubernetes import client

    _, kube, _ = cluster
    planted = copy.deepcopy(TINY)
    planted["spec"]["kubernetes"] = {"image": "docker.io/attacker/miner:1"}
    kube.core.create_namespaced_config_map(kube.namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="j10-spec"), data={"job.json": json.dumps(planted)}))
    kube.create_job(job_doc("j10"))
    st = wait_for(lambda: (s := kube.status("j10")).get("phase") == "Failed" and s, 30, "Failed")
    assert f"ConfigMap {kube.namespace}/j10-spec exists but was not made for this job" in st["message"], st
    assert kube.pods("j10") == []


def test_operator_metrics_and_liveness(cluster):
    """On the shared operator: the jobs gauge is by namespace, and this namespace holds this test's job only."""
    _, kube, op = cluster
    kube.create_job(job_doc("j10"))
    wait_for(lambda: _phase(kube, "j10") == "Pending", 30, "Pending")

    def scrape():
        return urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()

    pending = f'hybridflow_operator_jobs{{namespace="{kube.namespace}",phase="Pending"}} 1.0'
    body = wait_for(lambda: pending in (b := scrape()) and b, 30, "jobs by phase")
    assert "hybridflow_operator_reconcile_duration_seconds_count" in body
    live = urllib.request.urlopen(f"http://127.0.0.1:{op.liveness_port}/healthz", timeout=5)
    assert live.status == 200


def test_kubectl_apply_and_printer_columns(cluster):
    import os
    import subprocess

    api, kube, _ = cluster
    env = {**os.environ, "KUBECONFIG": api.kubeconfig_path}
    for example in ("tiny-grpo.yaml", "gpu-grpo-7b.yaml"):
        out = subprocess.run(["kubectl", "apply", "-n", kube.namespace, "--validate=false", "-f",
                              str(ROOT / "examples" / example)], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    wait_for(lambda: _phase(kube, "tiny-grpo") == "Pending", 30, "tiny-grpo Pending")
    out = subprocess.run(["kubectl", "get", "-n", kube.namespace, "rlhfjobs"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "STEP", "TOKENS/S", "RESTARTS", "AGE"], out.stdout
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith("tiny-grpo"))
    assert row[1] == "Pending" and row[-1].endswith(("s", "m"))
    assert "qwen2-7b-grpo" in out.stdout


def test_an_elastic_rollout_pool_is_scaled_on_a_live_job_without_a_restart(cluster, shared_cluster):
    """`kubectl scale` on a running async job with spec.rolloutPool: the operator adds the rollout pod past the old
    size, then deletes the one past the new size, keeping the head and every other pod (same UIDs): no restart, no
    replacement, no SpecChangeIgnored; status.rolloutReplicas follows and a RolloutScaled event says each change."""
    _, kube, _ = cluster
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async-k8s.yaml").read_text())
    doc["metadata"] = {"name": "je"}
    doc["spec"]["rolloutPool"] = {"replicas": 1, "maxReplicas": 2}
    del doc["spec"]["kubernetes"]["checkpointPvc"]
    kube.create_job(doc)
    wait_for(lambda: len(kube.pods("je")) == 3, 30, "pods")
    _run_all(kube, "je")
    wait_for(lambda: _phase(kube, "je") == "Running", 30, "Running")
    uids = {p.metadata.name: p.metadata.uid for p in kube.pods("je")}

    def scale(n: int) -> None:
        out = subprocess.run(["kubectl", "scale", "rlhfjob/je", f"--replicas={n}", "-n", kube.namespace],
                             env={**os.environ, "KUBECONFIG": shared_cluster[1]}, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr

    scale(2)
    wait_for(lambda: "je-rollout-1-g0" in _pod_names(kube, "je"), 30,
             lambda: f"the pod added; {_pod_names(kube, 'je')}")
    _run_all(kube, "je")
    wait_for(lambda: kube.status("je").get("rolloutReplicas") == 2, 30, lambda: f"status: {kube.status('je')}")
    scale(1)
    wait_for(lambda: "je-rollout-1-g0" not in _pod_names(kube, "je"), 30,
             lambda: f"the pod past the size deleted; {_pod_names(kube, 'je')}")
    st = wait_for(lambda: (s := kube.status("je")).get("rolloutReplicas") == 1 and s, 30, "rolloutReplicas 1")
    assert {p.metadata.name: p.metadata.uid for p in kube.pods("je")} == uids, "a pod of the job was replaced"
    assert st["phase"] == "Running" and st["restarts"] == 0 and not st.get("podReplacements"), st
    assert not any(c["type"] == "SpecChangeIgnored" for c in st.get("conditions", [])), st
    assert st["lastRolloutScale"]["from"] == 2 and st["lastRolloutScale"]["to"] == 1, st
    wait_for(lambda: _reasons(kube, "je").count("RolloutScaled") == 2, 30, lambda: f"events {_reasons(kube, 'je')}")
