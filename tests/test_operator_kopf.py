"""The operator for real: `kopf run` over HTTP against the kube-apiserver double, pods driven by a kubelet double."""
import copy
import time
from pathlib import Path

import pytest
import yaml
from kube.apiserver_double import RunningApiServer
from kube.harness import Kube, Operator, wait_for

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())


def job_doc(name: str, **run_policy) -> dict:
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name, "namespace": "default"}
    doc["spec"]["runPolicy"] = {"backoffLimit": 2, **run_policy}
    return doc


@pytest.fixture
def cluster(tmp_path):
    kubeconfig = str(tmp_path / "kubeconfig")
    with RunningApiServer(kubeconfig) as api:
        op = Operator(kubeconfig, tmp_path / "operator.log").start()
        try:
            wait_for(lambda: api.watching("rlhfjobs"), 60, "kopf's watch on rlhfjobs")
            yield api, Kube(kubeconfig), op
        finally:
            op.stop()


def _phase(kube, name):
    return kube.status(name).get("phase")


def test_create_makes_children_and_runs(cluster):
    api, kube, op = cluster
    kube.create_job(job_doc("j1"))
    pods = wait_for(lambda: len(kube.pods("j1")) == 2 and kube.pods("j1"), 30, "head + 1 worker pod")
    names = sorted(p.metadata.name for p in pods)
    assert names == ["j1-default-0-g0", "j1-head-g0"], names
    assert wait_for(lambda: api.objects("v1/services", "default"), 10, "head service")[0]["spec"]["clusterIP"] == "None"
    cms = api.objects("v1/configmaps", "default")
    assert cms and "job.yaml" in cms[0]["data"]
    for p in pods:
        assert p.metadata.owner_references[0].kind == "RLHFJob"
        kube.set_pod_phase(p.metadata.name, "Running")
    wait_for(lambda: _phase(kube, "j1") == "Running", 30, "phase Running")
    st = kube.status("j1")
    assert any(c["type"] == "Running" and c["status"] == "True" for c in st["conditions"])
    head = next(p for p in pods if "head" in p.metadata.name)
    kube.set_pod_phase(head.metadata.name, "Succeeded", exit_code=0)
    wait_for(lambda: _phase(kube, "j1") == "Succeeded", 30, "phase Succeeded")
    wait_for(lambda: [p.metadata.name for p in kube.pods("j1")] == [head.metadata.name], 30, "workers cleaned up")


def _pod_names(kube, job):
    return sorted(p.metadata.name for p in kube.pods(job))


def _run_all(kube, job):
    for p in kube.pods(job):
        if not p.metadata.deletion_timestamp:
            kube.set_pod_phase(p.metadata.name, "Running")


def _start_running(kube, name, **run_policy):
    """Create a job, let the kubelet double report its pods Running, wait for phase Running."""
    kube.create_job(job_doc(name, **run_policy))
    wait_for(lambda: len(kube.pods(name)) == 2, 30, "pods")
    _run_all(kube, name)
    wait_for(lambda: _phase(kube, name) == "Running", 30, "Running")


def test_failed_worker_restarts_the_gang_then_backoff_fails_the_job(cluster):
    _, kube, op = cluster
    _start_running(kube, "j2", backoffLimit=1)
    kube.set_pod_phase("j2-default-0-g0", "Failed", exit_code=137)
    wait_for(lambda: kube.status("j2").get("restarts") == 1, 30, "restart counted")
    wait_for(lambda: _pod_names(kube, "j2") == ["j2-default-0-g1", "j2-head-g1"], 30, "generation-1 gang")
    st = kube.status("j2")
    assert st["phase"] in ("Pending", "Initializing")
    reasons = [e.reason for e in kube.events()]
    assert "GangRestart" in reasons and "GangRestarted" in reasons
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
    _start_running(kube, "j3")
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
    assert wait_for(lambda: api.objects("scheduling.volcano.sh/v1beta1/podgroups"), 10, "podgroup")
    kube.delete_job("j4")
    wait_for(lambda: kube.job("j4") is None, 30, "job gone")
    assert kube.pods("j4") == []
    assert not [s for s in api.objects("v1/services") if s["metadata"]["name"].startswith("j4-")]
    assert not [c for c in api.objects("v1/configmaps") if c["metadata"]["name"].startswith("j4-")]
    assert not api.objects("scheduling.volcano.sh/v1beta1/podgroups")


def test_operator_restart_mid_job_creates_no_duplicates(cluster):
    api, kube, op = cluster
    _start_running(kube, "j5")
    before = _pod_names(kube, "j5")
    watches = api.watches("rlhfjobs")
    op.stop(kill=True)
    op.start()
    wait_for(lambda: api.watches("rlhfjobs") > watches, 60, "the new operator's watch")

    time.sleep(3)  # several reconcile intervals
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
    kube.create_job(job_doc("j7", activeDeadlineSeconds=2))
    wait_for(lambda: _phase(kube, "j7") == "Failed", 30, "deadline Failed")
    assert kube.status("j7")["reason"] == "DeadlineExceeded"
    _start_running(kube, "j8", ttlSecondsAfterFinished=1)  # a kubelet reports Running before Succeeded
    kube.set_pod_phase("j8-head-g0", "Succeeded", exit_code=0)
    wait_for(lambda: _phase(kube, "j8") == "Succeeded", 30, "Succeeded")
    t0 = time.monotonic()
    # The TTL deletion is issued from inside a reconcile: kopf used to hold the finalizer for 60 s after it.
    wait_for(lambda: kube.job("j8") is None, 30, "finished job deleted after its TTL")
    assert time.monotonic() - t0 < 1 + 10, "the TTL deletion was held up"
    assert kube.pods("j8") == []


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
    api, kube, _ = cluster
    names = [f"many{i}" for i in range(8)]
    for n in names:
        kube.create_job(job_doc(n))
    for n in names:
        wait_for(lambda: len(kube.pods(n)) == 2 and _phase(kube, n) == "Pending", 60, f"{n} started")
    time.sleep(2)  # several more reconcile intervals
    created = [e.involved_object.name for e in kube.events() if e.reason == "Created"]
    assert sorted(created) == sorted(names), created
    pod_posts = api.requests("POST", "pods", "default")
    assert len([r for r in pod_posts if (r.data or {}).get("metadata", {}).get("name", "").startswith("many")]) \
        == 2 * len(names)


def test_spec_changes_other_than_run_policy_are_ignored_with_a_warning(cluster):
    api, kube, _ = cluster
    kube.create_job(job_doc("j9"))
    wait_for(lambda: len(kube.pods("j9")) == 2, 30, "pods")
    kube.patch_job("j9", {"spec": {"trainer": {"steps": 999}}})
    st = wait_for(lambda: any(c["type"] == "SpecChangeIgnored" for c in kube.status("j9").get("conditions", []))
                  and kube.status("j9"), 30, "SpecChangeIgnored")
    assert st["totalSteps"] == 40
    cm = next(c for c in api.objects("v1/configmaps") if c["metadata"]["name"] == "j9-spec")
    assert "steps: 40" in cm["data"]["job.yaml"]
    assert "SpecChangeIgnored" in [e.reason for e in kube.events()]


def test_operator_metrics_and_liveness(cluster):
    import urllib.request

    _, kube, op = cluster
    kube.create_job(job_doc("j10"))
    wait_for(lambda: _phase(kube, "j10") == "Pending", 30, "Pending")

    def scrape():
        return urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()

    body = wait_for(lambda: 'hybridflow_operator_jobs{namespace="default",phase="Pending"} 1.0' in scrape()
                    and scrape(), 30, "jobs by phase")
    assert "hybridflow_operator_reconcile_duration_seconds_count" in body
    live = urllib.request.urlopen(f"http://127.0.0.1:{op.liveness_port}/healthz", timeout=5)
    assert live.status == 200


def test_kubectl_apply_and_printer_columns(cluster, tmp_path):
    import os
    import subprocess

    _, kube, _ = cluster
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig")}
    for example in ("tiny-grpo.yaml", "gpu-grpo-7b.yaml"):
        out = subprocess.run(["kubectl", "apply", "--validate=false", "-f", str(ROOT / "examples" / example)],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    wait_for(lambda: _phase(kube, "tiny-grpo") == "Pending", 30, "tiny-grpo Pending")
    out = subprocess.run(["kubectl", "get", "rlhfjobs"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "STEP", "TOKENS/S", "RESTARTS", "AGE"], out.stdout
    row = next(line.split() for line in out.stdout.splitlines() if line.startswith("tiny-grpo"))
    assert row[1] == "Pending" and row[-1].endswith(("s", "m"))
    assert "qwen2-7b-grpo" in out.stdout


def test_missing_reward_configmap_and_pvc_hold_the_job_pending_until_created(cluster):
    """The operator checks what the pods would mount before creating them: the job waits with the reason (one
    event), and starts by itself once the PVC and the ConfigMap with the reward file's key exist."""
    from kubernetes import client

    _, kube, op = cluster
    doc = job_doc("inputs")
    doc["spec"]["models"] = {"actor": {"source": "smollm2"}, "reward": {
        "type": "function", "function": {"path": "my_reward.py"}}}
    doc["spec"]["data"] = {"source": "files", "train": ["train.jsonl"], "promptKey": "question"}
    doc["spec"]["kubernetes"] = {"dataPvc": "prompts", "rewardConfigMap": "my-reward"}
    kube.create_job(doc)
    st = wait_for(lambda: (s := kube.status("inputs")).get("reason") == "InputsMissing" and s, 30, "InputsMissing")
    assert st["phase"] == "Pending" and "PersistentVolumeClaim 'prompts' not found" in st["message"]
    assert "ConfigMap 'my-reward' not found" in st["message"]
    time.sleep(2)  # several ticks
    assert kube.pods("inputs") == []
    warned = [e for e in kube.events() if e.reason == "InputsMissing"]
    assert len(warned) == 1, [e.message for e in warned]
    kube.core.create_namespaced_persistent_volume_claim("default", {
        "metadata": {"name": "prompts"}, "spec": {"accessModes": ["ReadOnlyMany"],
                                                  "resources": {"requests": {"storage": "1Gi"}}}})
    kube.core.create_namespaced_config_map("default", client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="my-reward"), data={"other.py": "x = 1\n"}))
    wait_for(lambda: "has no key 'my_reward.py' (its keys: other.py)" in kube.status("inputs").get("message", ""),
             30, "the missing key named")
    assert kube.pods("inputs") == []
    kube.core.patch_namespaced_config_map("my-reward", "default", {"data": {"my_reward.py": "def compute_score(*a): return 1\n"}})
    wait_for(lambda: len(kube.pods("inputs")) == 2, 30, "pods once the inputs exist")
    ready = next(c for c in kube.status("inputs")["conditions"] if c["type"] == "InputsReady")
    assert ready["status"] == "True"
