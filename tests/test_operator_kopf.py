"""The operator for real: `kopf run` over HTTP against the kube-apiserver double, pods driven by a kubelet double.

One API server and one operator serve the whole module (starting them cost more than most tests): each test has a
namespace of its own, so it sees only its own jobs, children and events, and at its end its jobs are deleted and
the operator is checked (alive, live, releasing jobs), or replaced, so that a test that fails leaves nothing to the
next one. The tests that restart the operator or count every request it made have a cluster of their own."""
import base64
import contextlib
import copy
import datetime as dt
import hashlib
import itertools
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from kube.apiserver_double import RunningApiServer
from hybridflow_operator.policy import FOR_JOBS_LABEL, NAMESPACE_LABEL
from kube.harness import Kube, Operator, wait_for
from kubernetes.client.rest import ApiException

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
SEVERAL = 3  # reconcile ticks that "nothing more happens" waits for
_NAMESPACES = itertools.count()


def job_doc(name: str, **run_policy) -> dict:
    """The tiny example under another name; no namespace: it goes where the test's client creates it."""
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name}
    doc["spec"]["runPolicy"] = {"backoffLimit": 2, **run_policy}
    return doc


@contextlib.contextmanager
def _started_cluster(tmp_path):
    """The API server double and the operator: (api, kubeconfig, operator), both stopped at the end. The operator
    watches every namespace (the harness names none to watch), as the tests' own namespaces need. Most of a test is
    waiting for the next reconcile tick to act on what the test did, so ticks come every 0.25 s (the harness's
    default is 0.5 s, a cluster's 5 s); "nothing more happens" waits count ticks (`_wait_ticks`), not seconds."""
    kubeconfig = str(tmp_path / "kubeconfig")
    with RunningApiServer(kubeconfig) as api:
        op = Operator(kubeconfig, tmp_path / "operator.log", interval=0.25).start()
        try:
            wait_for(lambda: api.watching("rlhfjobs"), 60, "kopf's watch on rlhfjobs")
            yield api, kubeconfig, op
        finally:
            op.stop()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    with _started_cluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture
def cluster(request, shared_cluster):
    """(api, kube, op) on the module's cluster; `kube` works in a namespace of this test's own (named after it).
    Afterwards the test's jobs are deleted and the operator checked; what was wrong fails this test's teardown,
    unless the test itself failed already (one failure, one report), and is repaired for the next test."""
    api, kubeconfig, op = shared_cluster
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.removeprefix("test_").lower()).strip("-")
    kube = Kube(kubeconfig, namespace=f"{slug[:50].rstrip('-')}-{next(_NAMESPACES)}")
    failed = request.session.testsfailed
    try:
        yield api, kube, op
    finally:
        problem = _leave_clean(api, kube, op)
        if problem and request.session.testsfailed == failed:  # a failed test already says what went wrong
            pytest.fail(f"after the test: {problem}", pytrace=False)


@pytest.fixture(scope="module")
def labelled_cluster(tmp_path_factory):
    """(api, kubeconfig, op) for a cluster-wide install as the chart's clusterWide mode configures it
    (HYBRIDFLOW_NAMESPACE_LABEL set). A cluster of its own: the shared operator acts in every namespace, so a job
    that must be left alone cannot be on its cluster."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HYBRIDFLOW_NAMESPACE_LABEL", NAMESPACE_LABEL)
        with _started_cluster(tmp_path_factory.mktemp("labelled")) as started:
            env.undo()  # the operator has its environment; nothing else started later should
            yield started


@pytest.fixture
def own_cluster(tmp_path):
    """(api, kube, op) on a cluster of this test's own, in namespace default."""
    with _started_cluster(tmp_path) as (api, kubeconfig, op):
        yield api, Kube(kubeconfig), op


def _live(op) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{op.liveness_port}/healthz", timeout=5).status == 200
    except OSError:
        return False


def _leave_clean(api, kube, op) -> str:
    """Delete the test's jobs (the operator removes their children and finalizers) and admit creates again; if the
    operator is not well (exited, not live, not releasing jobs), start a new one. Returns what was wrong, if any."""
    api.handler.refusals.clear()
    for name in kube.jobs():
        try:
            kube.delete_job(name)
        except ApiException as err:
            if err.status != 404:
                raise
    problems = []
    if op.proc is None or op.proc.poll() is not None:
        problems.append(f"the operator exited ({op.proc and op.proc.returncode})")
    else:
        try:
            wait_for(lambda: not kube.jobs(), 30, f"the operator to release the jobs of {kube.namespace}")
        except AssertionError as err:
            problems.append(str(err))
        if not _live(op):
            problems.append("the operator's liveness probe failed")
    if problems:
        problems.append("operator log, last lines:\n" + "\n".join(line[:300] for line in op.log().splitlines()[-30:]))
        op.stop(kill=True)
        for name in kube.jobs():  # nobody will remove the finalizers now
            kube.patch_job(name, {"metadata": {"finalizers": []}})
        wait_for(lambda: not kube.jobs(), 30, f"the jobs of {kube.namespace} gone")
        watches = api.watches("rlhfjobs")
        op.start()
        wait_for(lambda: api.watches("rlhfjobs") > watches, 60, "the new operator's watch")
    return "\n".join(problems)


def _wait_ticks(op, kube, *names, n=SEVERAL, since=None) -> None:
    """Until the operator has finished n reconcile ticks of each job (kopf logs each) after the log offset `since`
    (default: now): what "nothing more happens" waits for, however slow the machine. A resting job (suspended,
    finished, waiting for an input with a backoff) still ticks, and kopf logs each: such a tick returns at once,
    which is exactly "nothing more happens"."""
    offset = len(op.log()) if since is None else since
    done = [f"[{kube.namespace}/{m}] Timer 'reconcile' succeeded." for m in names]
    wait_for(lambda: (log := op.log()[offset:]) and all(log.count(d) >= n for d in done), 30,
             f"{n} more reconcile ticks of {', '.join(names)}")


def _phase(kube, name):
    return kube.status(name).get("phase")


def _message(kube, name):
    return kube.status(name).get("message", "")


def _reasons(kube, name):
    return [e.reason for e in kube.events() if e.involved_object.name == name]


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
    wait_for(lambda: "InputsMissing" in _reasons(kube, "inputs"), 30, "the InputsMissing event")
    _wait_ticks(op, kube, "inputs")  # several more ticks: still no pods, and no second event
    assert kube.pods("inputs") == []
    warned = [e for e in kube.events() if e.reason == "InputsMissing"]
    assert len(warned) == 1, [e.message for e in warned]
    ns = kube.namespace
    kube.core.create_namespaced_persistent_volume_claim(ns, {
        "metadata": {"name": "prompts"}, "spec": {"accessModes": ["ReadOnlyMany"],
                                                  "resources": {"requests": {"storage": "1Gi"}}}})
    kube.core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="my-reward"), data={"other.py": "x = 1\n"}))
    # They exist but their owners never marked them for jobs: naming them in a job must not be enough to mount them,
    # nor to learn what the ConfigMap holds (its keys are not listed before it is marked). (One wait for both: a
    # tick may read the claim just before it was created and the ConfigMap just after.)
    wait_for(lambda: "ConfigMap 'my-reward' is not marked for jobs" in (m := _message(kube, "inputs"))
             and "PersistentVolumeClaim 'prompts' is not marked for jobs" in m, 30,
             lambda: f"the unmarked ConfigMap and claim named; {_message(kube, 'inputs')}")
    assert "other.py" not in _message(kube, "inputs")
    assert kube.pods("inputs") == []
    kube.core.patch_namespaced_persistent_volume_claim("prompts", ns,
                                                       {"metadata": {"labels": {FOR_JOBS_LABEL: "true"}}})
    kube.core.patch_namespaced_config_map("my-reward", ns, {"metadata": {"labels": {FOR_JOBS_LABEL: "true"}}})
    wait_for(lambda: _message(kube, "inputs") == "spec.models.reward.function.path: ConfigMap 'my-reward' has no key "
             "'my_reward.py' (its keys: other.py)", 30,
             lambda: f"the missing key named, once marked; {_message(kube, 'inputs')}")
    assert kube.pods("inputs") == []
    kube.core.patch_namespaced_config_map("my-reward", ns,
                                          {"data": {"my_reward.py": "def compute_score(*a): return 1\n"}})
    wait_for(lambda: len(kube.pods("inputs")) == 3, 30, "pods once the inputs exist")  # + its sandbox pod
    ready = next(c for c in kube.status("inputs")["conditions"] if c["type"] == "InputsReady")
    assert ready["status"] == "True"


def test_refused_pod_creates_are_reported_not_retried_silently(cluster):
    """An admission controller refusing the pods (403: Pod Security, a quota) shows in status and as one event,
    and the job starts once they are admitted; a 422 (invalid) fails the job with the API server's words."""
    api, kube, op = cluster
    api.refuse_creates("pods", 403, 'pods "x" is forbidden: violates PodSecurity "restricted:latest"')
    kube.create_job(job_doc("j403"))
    cond = wait_for(lambda: next((c for c in kube.status("j403").get("conditions", [])
                                  if c["type"] == "CreateRefused" and c["status"] == "True"), None), 30,
                    "a CreateRefused condition")
    assert "violates PodSecurity" in cond["message"] and "(403)" in cond["message"]
    assert kube.status("j403")["phase"] == "Pending"
    wait_for(lambda: "CreateRefused" in _reasons(kube, "j403"), 30, "the CreateRefused event")
    _wait_ticks(op, kube, "j403")  # several refused ticks: still one event
    assert len([e for e in kube.events() if e.reason == "CreateRefused" and e.involved_object.name == "j403"]) == 1
    api.refuse_creates("pods", None)
    wait_for(lambda: len(kube.pods("j403")) == 2, 30, "pods once admitted")
    wait_for(lambda: any(c["type"] == "CreateRefused" and c["status"] == "False"
                         for c in kube.status("j403").get("conditions", [])), 30, "CreateRefused cleared")

    api.refuse_creates("pods", 422, 'Pod "x" is invalid: spec.containers[0].image: Required value')
    kube.create_job(job_doc("j422"))
    st = wait_for(lambda: (s := kube.status("j422")).get("phase") == "Failed" and s, 30, "Failed")
    assert st["reason"] == "CreateRefused" and "spec.containers[0].image: Required value" in st["message"], st
    api.refuse_creates("pods", None)


def test_a_job_breaking_the_clusters_job_policy_fails_before_any_pod(cluster):
    _, kube, _ = cluster
    doc = job_doc("jpolicy")
    doc["spec"]["kubernetes"] = {"image": "docker.io/attacker/miner:latest", "serviceAccountName": "cluster-admin"}
    kube.create_job(doc)
    st = wait_for(lambda: (s := kube.status("jpolicy")).get("phase") == "Failed" and s, 30, "Failed")
    assert "spec.kubernetes.image 'docker.io/attacker/miner:latest' is not under an allowed prefix" in st["message"]
    assert "spec.kubernetes.serviceAccountName 'cluster-admin' is not allowed" in st["message"]
    assert kube.pods("jpolicy") == []


def test_a_run_policy_patched_past_the_job_policy_is_refused_at_the_next_gang_start(cluster):
    """runPolicy may change on a live job, so the policy is judged whenever pods are about to be made: a priority
    class patched in, then a suspend and resume, fails the job instead of granting it."""
    _, kube, _ = cluster
    kube.create_job(job_doc("jlater"))
    wait_for(lambda: len(kube.pods("jlater")) == 2, 30, "the gang")
    kube.patch_job("jlater", {"spec": {"runPolicy": {"priorityClassName": "system-cluster-critical", "suspend": True}}})
    wait_for(lambda: kube.status("jlater").get("phase") == "Suspended", 30, "Suspended")
    kube.patch_job("jlater", {"spec": {"runPolicy": {"suspend": False}}})
    st = wait_for(lambda: (s := kube.status("jlater")).get("phase") == "Failed" and s, 30, "Failed")
    assert "spec.runPolicy.priorityClassName 'system-cluster-critical' is not allowed" in st["message"], st
    assert kube.pods("jlater") == []


def test_a_ray_token_secret_planted_before_the_job_fails_it(cluster):
    """The operator never reads Secrets, so a `<job>-ray-token` someone made first would hand them the token."""
    from kubernetes import client

    _, kube, _ = cluster
    kube.core.create_namespaced_secret(kube.namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name="jplant-ray-token"), string_data={"token": "known-to-the-planter"}))
    kube.create_job(job_doc("jplant"))
    st = wait_for(lambda: (s := kube.status("jplant")).get("phase") == "Failed" and s, 30, "Failed")
    assert f"Secret {kube.namespace}/jplant-ray-token existed before this job started" in st["message"], st
    assert kube.pods("jplant") == []
    kube.delete_job("jplant")  # the operator deletes only the token Secret it made (by the uid its create returned)
    wait_for(lambda: kube.job("jplant") is None, 30, "the job gone")
    assert [s.metadata.name for s in kube.core.list_namespaced_secret(kube.namespace).items] == ["jplant-ray-token"]


def _granted() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the chart's ClusterRole (a clusterWide install) grants the operator: the
    namespaced Roles' rules plus the cluster-scoped reads a cluster-wide kopf needs (CRDs, namespaces)."""
    from test_helm import render_chart

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


VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}
GROUPS = {"rlhfjobs": "hybridflow.io", "networkpolicies": "networking.k8s.io", "podgroups": "scheduling.volcano.sh",
          "customresourcedefinitions": "apiextensions.k8s.io"}


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


def _used(pod) -> set[tuple[str, str]]:
    """(kind, name) of the Secrets, ConfigMaps and PVCs a pod (as the API holds it) uses: volumes and env."""
    spec = pod["spec"]
    out = set()
    for v in spec.get("volumes") or []:
        if "configMap" in v:
            out.add(("ConfigMap", v["configMap"]["name"]))
        if "secret" in v:
            out.add(("Secret", v["secret"]["secretName"]))
        if "persistentVolumeClaim" in v:
            out.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
    for c in spec.get("initContainers", []) + spec["containers"]:
        for e in c.get("env") or []:
            if "secretKeyRef" in (e.get("valueFrom") or {}):
                out.add(("Secret", e["valueFrom"]["secretKeyRef"]["name"]))
        for src in c.get("envFrom") or []:
            out |= {("Secret", src["secretRef"]["name"])} if "secretRef" in src else set()
    return out


REWARD = {"actor": {"source": "smollm2"}, "reward": {"type": "function", "function": {"path": "my_reward.py"}}}


def _reward_function_job(kube, name: str, configmap: str, **run_policy) -> None:
    """A job scoring with a reward function from its own marked code ConfigMap: it gets a sandbox pod."""
    from kubernetes import client

    kube.core.create_namespaced_config_map(kube.namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=configmap, labels={FOR_JOBS_LABEL: "true"}),
        data={"my_reward.py": "def compute_score(*a):\n    return 1.0\n"}))
    doc = job_doc(name, **run_policy)
    doc["spec"]["models"] = REWARD
    doc["spec"]["kubernetes"] = {"rewardConfigMap": configmap}
    kube.create_job(doc)


def test_a_sandbox_pod_that_refuses_the_partial_sandbox_fails_the_job_at_once(cluster):
    """A reward function's job on nodes whose pods cannot make namespaces (HYBRIDFLOW_SANDBOX=require, the
    default): its sandbox pod exits EXIT_SANDBOX_UNAVAILABLE, and the job fails saying so instead of remaking the
    pod forever; the gang goes with it."""
    from hybridflow.api import EXIT_SANDBOX_UNAVAILABLE

    _, kube, _ = cluster
    _reward_function_job(kube, "jsb", "rw-sb")
    wait_for(lambda: "jsb-env-0" in _pod_names(kube, "jsb"), 30, "the sandbox pod")
    kube.set_pod_phase("jsb-env-0", "Failed", exit_code=EXIT_SANDBOX_UNAVAILABLE)
    st = wait_for(lambda: (s := kube.status("jsb")).get("phase") == "Failed" and s, 30, "Failed")
    assert st["reason"] == "SandboxUnavailable" and "jsb-env-0 refused" in st["message"], st
    wait_for(lambda: _pod_names(kube, "jsb") == ["jsb-head-g0"], 30, "only the head left, for its logs")
    kube.delete_job("jsb")
    wait_for(lambda: kube.job("jsb") is None, 30, "the job gone")


def test_a_sandbox_pod_remade_mid_run_never_mounts_a_planted_code_configmap(cluster):
    """The job's copy of its code deleted and planted again under its name by someone else (who may write
    ConfigMaps), then a sandbox pod lost: the replacement is not made, and the job fails naming the ConfigMap,
    instead of a new sandbox pod running the planted code on the job's data."""
    from kubernetes import client

    api, kube, _ = cluster
    ns = kube.namespace
    _reward_function_job(kube, "jpl", "rw-pl")
    wait_for(lambda: _pod_names(kube, "jpl") == ["jpl-default-0-g0", "jpl-env-0", "jpl-head-g0"], 30, "the pods")
    for pod in _pod_names(kube, "jpl"):
        kube.set_pod_phase(pod, "Running")
    wait_for(lambda: _phase(kube, "jpl") == "Running", 30, "Running")
    kube.core.delete_namespaced_config_map("jpl-reward", ns)
    kube.core.create_namespaced_config_map(ns, client.V1ConfigMap(  # no owner: the children policy's reach ends
        metadata=client.V1ObjectMeta(name="jpl-reward"),
        data={"my_reward.py": "def compute_score(*a):\n    return 9.0  # planted\n"}))
    kube.set_pod_phase("jpl-env-0", "Failed", exit_code=137)
    st = wait_for(lambda: (s := kube.status("jpl")).get("phase") == "Failed" and s, 30, "Failed")
    assert "jpl-reward" in st["message"], st
    made = [p for p in api.objects("v1/pods", ns) if p["metadata"]["name"] == "jpl-env-0"
            and p["metadata"]["uid"] != ""]
    assert all((p.get("status") or {}).get("phase") == "Failed" for p in made), "a sandbox pod was made again"
    kube.delete_job("jpl")
    wait_for(lambda: kube.job("jpl") is None, 30, "the job gone")
    kube.core.delete_namespaced_config_map("jpl-reward", ns)


def test_a_sandbox_token_made_anew_at_a_gang_start_replaces_the_sandbox_pods_that_hold_the_old_one(cluster):
    """Issue 51 N3: the sandbox pods outlive a gang restart, and read the job's sandbox token from its Secret when
    they start. Deleted, the Secret is made again at the next gang start with a new random token, which the new gang
    reads: the sandbox pods still running would answer it 401 (the job stops on PoolError). They are made again
    with the gang instead; while the Secret stays, a gang restart leaves them alone."""
    api, kube, _ = cluster
    ns = kube.namespace
    name, pool_pod = "jtk", "jtk-env-0"

    def secret():
        return next((s for s in api.objects("v1/secrets", ns) if s["metadata"]["name"] == "jtk-sandbox-token"), None)

    def uid_of(pod):
        return next((p.metadata.uid for p in kube.pods(name) if p.metadata.name == pod), None)

    def restart(generation):
        kube.set_pod_phase(f"jtk-default-0-g{generation - 1}", "Failed", exit_code=1)
        wait_for(lambda: _pod_names(kube, name) == sorted([f"jtk-default-0-g{generation}", pool_pod,
                                                           f"jtk-head-g{generation}"]) and uid_of(pool_pod), 30,
                 lambda: f"generation {generation} and the sandbox pod; {_pod_names(kube, name)}")
        _run_all(kube, name)
        wait_for(lambda: _phase(kube, name) == "Running", 30, "Running")

    _reward_function_job(kube, name, "rw-tk", restartPolicy="gang", backoffLimit=3)
    wait_for(lambda: _pod_names(kube, name) == ["jtk-default-0-g0", pool_pod, "jtk-head-g0"], 30, "the pods")
    _run_all(kube, name)
    wait_for(lambda: _phase(kube, name) == "Running", 30, "Running")
    first, pod_uid = secret(), uid_of(pool_pod)
    assert kube.status(name)["sandboxTokenSecretUid"] == first["metadata"]["uid"]

    restart(1)  # the Secret kept: the sandbox pod keeps running through the gang restart, with the same token
    assert uid_of(pool_pod) == pod_uid and secret()["metadata"]["uid"] == first["metadata"]["uid"]

    kube.core.delete_namespaced_secret("jtk-sandbox-token", ns)
    restart(2)
    again = wait_for(secret, 30, "the Secret made again")
    assert again["data"]["token"] != first["data"]["token"]
    assert kube.status(name)["sandboxTokenSecretUid"] == again["metadata"]["uid"] != first["metadata"]["uid"]
    # the sandbox pod started with the old token is gone, and made again under its name (reading the new one)
    wait_for(lambda: (u := uid_of(pool_pod)) and u != pod_uid, 30, "the sandbox pod made again")
    wait_for(lambda: "SandboxPodsReplaced" in _reasons(kube, name), 30, lambda: f"events: {_reasons(kube, name)}")
    kube.delete_job(name)
    wait_for(lambda: kube.job(name) is None, 30, "the job gone")


def test_objects_added_to_a_suspended_job_never_reach_its_pods(cluster):
    """Issue 24 N1: a job created suspended with no spec.kubernetes, then patched (no API server CEL here, as with a
    CRD rule that cannot see a field added) to name a ServiceAccount-token Secret, object-storage credentials and a
    reward ConfigMap its author may not read, then resumed. The operator accepted the spec when it first saw the job,
    suspended or not: the edit is SpecChangeIgnored, and the pods get none of those objects."""
    from kubernetes import client

    api, kube, _ = cluster
    ns = kube.namespace
    kube.create_job(job_doc("jsneak", suspend=True))
    wait_for(lambda: _phase(kube, "jsneak") == "Suspended", 30, "Suspended")
    cm = next(c for c in api.objects("v1/configmaps", ns) if c["metadata"]["name"] == "jsneak-spec")
    assert kube.status("jsneak")["acceptedSpecDigest"] == \
        "sha256:" + hashlib.sha256(cm["data"]["job.json"].encode()).hexdigest()  # accepted while suspended
    kube.core.create_namespaced_secret(ns, client.V1Secret(
        metadata=client.V1ObjectMeta(name="builder-token", annotations={"kubernetes.io/service-account.name": "b"}),
        type="kubernetes.io/service-account-token", string_data={"token": "eyJhbGciOi.builder"}))
    kube.core.create_namespaced_secret(ns, client.V1Secret(metadata=client.V1ObjectMeta(name="s3-admin"),
                                                           string_data={"AWS_SECRET_ACCESS_KEY": "k"}))
    kube.core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="exfil", labels={FOR_JOBS_LABEL: "true"}),
        data={"my_reward.py": "import os\ndef compute_score(*a): return len(os.environ)\n"}))
    kube.patch_job("jsneak", {"spec": {"models": REWARD, "kubernetes": {
        "rayAuthSecret": "builder-token", "checkpointSecret": "s3-admin", "rewardConfigMap": "exfil"}}})
    wait_for(lambda: any(c["type"] == "SpecChangeIgnored" and c["status"] == "True"
                         for c in kube.status("jsneak").get("conditions", [])), 30, "SpecChangeIgnored")
    kube.patch_job("jsneak", {"spec": {"runPolicy": {"suspend": False}}})
    wait_for(lambda: len(kube.pods("jsneak")) == 2, 30, "the gang")
    for pod in (p for p in api.objects("v1/pods", ns) if p["metadata"]["name"].startswith("jsneak-")):
        assert _used(pod) == {("Secret", "jsneak-ray-token"), ("ConfigMap", "jsneak-spec")}, pod["metadata"]["name"]
    spec = json.loads(next(c for c in api.objects("v1/configmaps", ns)
                           if c["metadata"]["name"] == "jsneak-spec")["data"]["job.json"])["spec"]
    assert "rayAuthSecret" not in json.dumps(spec) and spec["models"]["actor"]["source"] == "tiny"


PLANTED = {
    "Service": ("v1/services", "jsvc", "jsvc-head",
                lambda kube, name: kube.core.create_namespaced_service(kube.namespace, {
                    "metadata": {"name": name}, "spec": {"selector": {"app": "mine"}, "ports": [{"port": 6379}]}})),
    # a job named default-deny would take the namespace's own policy for its `<job>-ingress`
    "NetworkPolicy": ("networking.k8s.io/v1/networkpolicies", "default-deny", "default-deny-ingress",
                      lambda kube, name: client_networking(kube).create_namespaced_network_policy(kube.namespace, {
                          "metadata": {"name": name}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}})),
}


def client_networking(kube):
    from kubernetes import client

    return client.NetworkingV1Api(kube.api)


@pytest.mark.parametrize("kind", list(PLANTED))
def test_a_child_name_held_by_someone_elses_object_fails_the_job_which_leaves_it_alone(cluster, kind):
    """Issue 24 N2: an object under a child's name that the job does not control (a `<job>-head` Service planted to
    be the Ray head's address, the namespace's `default-deny-ingress` under a job called `default-deny`) is neither
    adopted (the job fails, naming it) nor deleted with the job."""
    api, kube, _ = cluster
    resource, job, name, plant = PLANTED[kind]
    plant(kube, name)
    before = next(o for o in api.objects(resource, kube.namespace) if o["metadata"]["name"] == name)
    kube.create_job(job_doc(job))
    st = wait_for(lambda: (s := kube.status(job)).get("phase") == "Failed" and s, 30, "Failed")
    assert f"{kind} {kube.namespace}/{name} exists but was not made for this job" in st["message"], st
    assert kube.pods(job) == []
    kube.delete_job(job)
    wait_for(lambda: kube.job(job) is None, 30, "the job gone")
    after = [o for o in api.objects(resource, kube.namespace) if o["metadata"]["name"] == name]
    assert [o["metadata"]["uid"] for o in after] == [before["metadata"]["uid"]], "the job's deletion took it"
    assert not api.objects("v1/configmaps", kube.namespace), "the job's own children went with it"


def test_a_pod_name_held_by_someone_elses_pod_is_a_condition_naming_it_not_a_silent_wait(cluster):
    """Issue 51 L4: a pod under the name of one of the job's pods (another owner, no job label) is never counted as
    the job's; its create's 409 is condition CreateRefused (PodNameTaken) naming it, and an event, while the job
    waits in Pending; once that pod is gone the job's own is made."""
    api, kube, _ = cluster
    kube.core.create_namespaced_pod(kube.namespace, {
        "metadata": {"name": "jsquat-head-g0", "labels": {"app": "mine"}},
        "spec": {"containers": [{"name": "c", "image": "busybox:1"}]}})
    kube.create_job(job_doc("jsquat"))
    cond = wait_for(lambda: next((c for c in kube.status("jsquat").get("conditions", [])
                                  if c["type"] == "CreateRefused" and c["status"] == "True"), None), 30,
                    "a CreateRefused condition")
    assert cond["reason"] == "PodNameTaken", cond
    assert cond["message"].startswith(f"pod {kube.namespace}/jsquat-head-g0 exists but was not made for this job"), cond
    assert kube.status("jsquat")["phase"] == "Pending"
    wait_for(lambda: "PodNameTaken" in _reasons(kube, "jsquat"), 30, "the PodNameTaken event")
    assert [p.metadata.name for p in kube.pods("jsquat")] == ["jsquat-default-0-g0"], "the others are made"
    squatter = next(o for o in api.objects("v1/pods", kube.namespace) if o["metadata"]["name"] == "jsquat-head-g0")
    assert "ownerReferences" not in squatter["metadata"], "never adopted"
    kube.core.delete_namespaced_pod("jsquat-head-g0", kube.namespace)
    wait_for(lambda: len(kube.pods("jsquat")) == 2, 30, "the job's own head pod once the name is free")
    wait_for(lambda: any(c["type"] == "CreateRefused" and c["status"] == "False"
                         for c in kube.status("jsquat").get("conditions", [])), 30, "CreateRefused cleared")


def test_the_code_files_are_copied_at_acceptance_and_later_edits_change_nothing(cluster):
    """Issue 24 N5, issue 51 M5: every code file of the job (the reward function, the agent's tools and environment
    files: keys of kubernetes.rewardConfigMap) is copied, when the operator first finds them all, into the job's own
    immutable ConfigMap, their digests in status; the head and the sandbox pod mount that copy. A key missing from
    the user's ConfigMap holds the job Pending, naming it. An edit of the user's ConfigMap afterwards reaches
    neither the running pods, nor the next gang, nor a sandbox pod made again."""
    from kubernetes import client

    api, kube, _ = cluster
    ns = kube.namespace
    files = {"my_reward.py": "def compute_score(*a):\n    return 1.0\n",
             "tools.py": "def add(a: int, b: int) -> int:\n    \"\"\"Adds.\"\"\"\n    return a + b\n",
             "game.py": "class Environment:\n    def reset(self, sample):\n        return ''\n"}
    kube.core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="rw", labels={FOR_JOBS_LABEL: "true"}),
        data={k: v for k, v in files.items() if k != "game.py"}))
    doc = job_doc("jrw")
    doc["spec"]["models"] = REWARD
    doc["spec"]["data"] = {"task": "arithmetic"}
    doc["spec"]["rollout"]["agent"] = {"toolsFile": "tools.py", "environmentFile": "game.py"}
    doc["spec"]["kubernetes"] = {"rewardConfigMap": "rw"}
    kube.create_job(doc)
    wait_for(lambda: _message(kube, "jrw") == "spec.rollout.agent.environmentFile: ConfigMap 'rw' has no key "
             "'game.py' (its keys: my_reward.py, tools.py)", 30, lambda: f"the missing key; {_message(kube, 'jrw')}")
    assert kube.pods("jrw") == [] and "codeDigests" not in kube.status("jrw")
    kube.core.patch_namespaced_config_map("rw", ns, {"data": {"game.py": files["game.py"]}})
    wait_for(lambda: len(kube.pods("jrw")) == 3, 30, "the gang and its sandbox pod")
    digests = {k: "sha256:" + hashlib.sha256(v.encode()).hexdigest() for k, v in files.items()}

    def mounted(*pods):
        copy_ = next(c for c in api.objects("v1/configmaps", ns) if c["metadata"]["name"] == "jrw-reward")
        assert copy_["data"] == files and copy_["immutable"] is True
        assert copy_["metadata"]["ownerReferences"][0]["uid"] == kube.job("jrw")["metadata"]["uid"]
        st = kube.status("jrw")
        assert st["codeDigests"] == digests and st["rewardDigest"] == digests["my_reward.py"]
        for name in pods:
            pod = next(p for p in api.objects("v1/pods", ns) if p["metadata"]["name"] == name)
            assert ("ConfigMap", "jrw-reward") in _used(pod) and ("ConfigMap", "rw") not in _used(pod), name
        return next(p for p in api.objects("v1/pods", ns) if p["metadata"]["name"] == "jrw-env-0")

    sandbox = mounted("jrw-head-g0", "jrw-env-0")
    # the user's code runs in the sandbox pod: the copy, its own token, none of the job's credentials, no claim
    assert _used(sandbox) == {("ConfigMap", "jrw-reward"), ("ConfigMap", "jrw-spec"),
                              ("Secret", "jrw-sandbox-token")}, _used(sandbox)
    spec = json.loads(next(c for c in api.objects("v1/configmaps", ns)
                           if c["metadata"]["name"] == "jrw-spec")["data"]["job.json"])["spec"]
    assert spec["rollout"]["agent"]["toolsFile"] == "/var/lib/hybridflow/reward/tools.py"
    assert spec["rollout"]["agent"]["environmentFile"] == "/var/lib/hybridflow/reward/game.py"
    kube.core.patch_namespaced_config_map("rw", ns, {"data": {k: "import os  # the edit\n" for k in files}})
    kube.set_pod_phase("jrw-default-0-g0", "Failed", exit_code=1)
    kube.set_pod_phase("jrw-env-0", "Failed", exit_code=1)
    wait_for(lambda: _pod_names(kube, "jrw") == ["jrw-default-0-g1", "jrw-env-0", "jrw-head-g1"] and
             next(p for p in kube.pods("jrw") if p.metadata.name == "jrw-env-0").metadata.uid
             != sandbox["metadata"]["uid"], 30, "generation 1 and a new sandbox pod")
    mounted("jrw-head-g1", "jrw-env-0")
    kube.delete_job("jrw")
    wait_for(lambda: kube.job("jrw") is None, 30, "the job gone")
    assert [c["metadata"]["name"] for c in api.objects("v1/configmaps", ns)] == ["rw"]
    assert not [x["metadata"]["name"] for x in api.objects("v1/secrets", ns) if x["metadata"]["name"].startswith("jrw-")]


def test_the_api_double_deletes_with_a_uid_precondition_as_the_api_server_does(cluster):
    """What cleanup relies on: a delete whose precondition names another uid is refused, 409 Conflict."""
    from kubernetes import client

    _, kube, _ = cluster
    made = kube.core.create_namespaced_config_map(kube.namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="x"), data={"a": "b"}))
    with pytest.raises(ApiException) as refused:
        kube.core.delete_namespaced_config_map("x", kube.namespace, body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid="another-uid")))
    assert refused.value.status == 409 and json.loads(refused.value.body)["reason"] == "Conflict"
    assert "Precondition failed: UID in precondition: another-uid" in json.loads(refused.value.body)["message"]
    assert kube.core.read_namespaced_config_map("x", kube.namespace).metadata.uid == made.metadata.uid
    kube.core.delete_namespaced_config_map("x", kube.namespace, body=client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=made.metadata.uid)))
    assert [c.metadata.name for c in kube.core.list_namespaced_config_map(kube.namespace).items] == []


OPERATOR_AGENTS = ("kopf", "hybridflow-operator")  # the User-Agents of the operator's requests (kopf's and ours)


def _operator_requests(api, namespace, since=0):
    """The operator's requests in one namespace since the request-log offset `since`, each with its answer."""
    return [r for r in list(api.handler.log)[since:]
            if r.namespace == namespace and r.agent.startswith(OPERATOR_AGENTS)]


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


CHILD_RESOURCES = {"Service": "v1/services", "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
                   "ConfigMap": "v1/configmaps"}


def _child(api, kube, kind, name):
    """The object of that kind and name in the test's namespace, as the API server holds it; None if there is none."""
    return next((o for o in api.objects(CHILD_RESOURCES[kind], kube.namespace) if o["metadata"]["name"] == name), None)


def _owned_by(obj, job_uid) -> bool:
    """Whether the object exists and its only controller is the job of that uid."""
    return obj is not None and [r["uid"] for r in obj["metadata"].get("ownerReferences") or []
                                if r.get("controller")] == [job_uid]


def test_a_running_jobs_deleted_network_policy_and_head_service_come_back_at_its_next_tick(cluster):
    """Issue 24 N8 follow-up: children are created once per gang start, so a NetworkPolicy or head Service deleted
    while the job runs stayed gone (its pods unfenced, the head's name unresolvable) until the next one. Both are
    followed by a watch: they come back at the next tick, owned by the job and as they were, with a ChildRecreated
    warning, at one POST each; following them costs a Running job no request while nothing changes."""
    api, kube, op = cluster
    _start_running(kube, "jkeep")
    uid = kube.job("jkeep")["metadata"]["uid"]
    before = {kind: _child(api, kube, kind, name) for kind, name in
              (("Service", "jkeep-head"), ("NetworkPolicy", "jkeep-ingress"))}
    _wait_ticks(op, kube, "jkeep", n=2)  # the write that made it Running has come back by the watch
    since = len(api.handler.log)
    _wait_ticks(op, kube, "jkeep", n=8)  # 2 s of ticks
    steady = _operator_requests(api, kube.namespace, since)
    assert steady == [], [(r.method, r.plural, r.status) for r in steady]

    since, t0 = len(api.handler.log), time.monotonic()
    kube.core.delete_namespaced_service("jkeep-head", kube.namespace)
    client_networking(kube).delete_namespaced_network_policy("jkeep-ingress", kube.namespace)
    back = wait_for(lambda: (now := {k: _child(api, kube, k, o["metadata"]["name"]) for k, o in before.items()})
                    and all(now.values()) and now, 30, "the Service and the NetworkPolicy made again")
    took = time.monotonic() - t0
    for kind, obj in back.items():
        assert obj["metadata"]["uid"] != before[kind]["metadata"]["uid"], kind
        assert _owned_by(obj, uid), obj["metadata"]
        assert obj["spec"] == before[kind]["spec"], kind  # the same fence, the same head selector
    assert took < 3, f"made again {took:.1f} s after the deletion; ticks are 0.25 s apart"
    wait_for(lambda: _reasons(kube, "jkeep").count("ChildRecreated") == 2, 30, "a ChildRecreated event for each")
    _wait_ticks(op, kube, "jkeep", n=8)  # and nothing more once they are back
    made = [(r.method, r.plural) for r in _operator_requests(api, kube.namespace, since) if r.plural != "events"]
    assert sorted(made) == [("POST", "networkpolicies"), ("POST", "services")], made
    assert _phase(kube, "jkeep") == "Running"


def test_the_followed_childrens_watches_are_filtered_by_the_api_server():
    """The pod, Service and NetworkPolicy watches ask the API server (labelSelector) for the jobs' objects only, not
    for every pod, Service and NetworkPolicy of the namespaces served; nothing else is watched by this selector."""
    import kopf
    from hybridflow_operator.handlers import watch_children_only

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
    from hybridflow_operator.handlers import NAMESPACE_TTL

    assert len(asked) <= 3 * (1 + int((time.monotonic() - t0) // NAMESPACE_TTL)), "cached: not one GET per tick"
    granted = _granted()
    assert NAMESPACE_GET in _rights_used(api) and NAMESPACE_GET in granted
    assert _rights_used(api) - granted - {(g, r.split("/")[0], v) for g, r, v in granted} == set()
    on.delete_job("served")
    for k, name in ((on, "served"), (off, "left-alone"), (nowhere, "left-alone")):
        if k is not on:
            k.delete_job(name)
        wait_for(lambda: k.job(name) is None, 30, f"{k.namespace}/{name} gone")


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


def _granted_with(combo: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) every Role and ClusterRole of the chart rendered with `combo` grants."""
    from test_helm import render_chart

    return {(g, r, v) for d in render_chart(combo) if d["kind"] in ("Role", "ClusterRole") for rule in d["rules"]
            for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


KUEUE_GROUPS = {"workloads": "kueue.x-k8s.io", "resourceflavors": "kueue.x-k8s.io",
                "priorityclasses": "scheduling.k8s.io"}


def test_a_job_queued_through_kueue_waits_for_admission_is_evicted_and_resumes(tmp_path):
    """Issue 30 item 1, the real operator over HTTP with Kueue on (the chart's kueue.enabled), Kueue's controller
    played by the test (kube/kueue_double.py, writing what Kueue writes): a job labelled with a LocalQueue gets a
    Workload and no pod while it is not admitted; admitted, its pods carry the assigned flavors' node labels and
    tolerations; evicted (preempted), its pods go, the quota is given back, and it waits again; re-admitted, it
    resumes (same gang generation); finished, the Workload says Finished. Every request the operator made for it is
    one the chart (kueue.enabled) grants, and each Kueue right granted was used."""
    from kube.kueue_double import KueueDouble, condition

    with pytest.MonkeyPatch.context() as env:
        env.setenv("HYBRIDFLOW_KUEUE", "true")
        env.setenv("HYBRIDFLOW_ALLOWED_PRIORITY_CLASSES", "research")
        with _started_cluster(tmp_path) as (api, kubeconfig, op):
            env.undo()
            kube = Kube(kubeconfig)
            kueue = KueueDouble(kube.api, "default")
            kueue.flavor("general", {"pool": "general"})
            kueue.flavor("spot", {"pool": "spot"}, [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}])
            kube.custom.create_cluster_custom_object("scheduling.k8s.io", "v1", "priorityclasses", {
                "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "research"},
                "value": 1000})
            refused = job_doc("jqbad", priorityClassName="forbidden")
            refused["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
            kube.create_job(refused)  # judged before it queues: no Workload holds quota for a job never to run
            st = wait_for(lambda: (s := kube.status("jqbad")).get("phase") == "Failed" and s, 30, "Failed")
            assert "priorityClassName 'forbidden' is not allowed" in st["message"]
            assert kueue.workload("jqbad-workload") is None
            doc = job_doc("jq", priorityClassName="research")
            doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
            kube.create_job(doc)
            wl = wait_for(lambda: kueue.workload("jq-workload"), 30, "the job's Workload")
            assert wl["spec"]["queueName"] == "team-a" and wl["metadata"]["ownerReferences"][0]["name"] == "jq"
            assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("head", 1), ("default", 1)]
            assert (wl["spec"]["priorityClassName"], wl["spec"]["priority"]) == ("research", 1000)
            wait_for(lambda: _phase(kube, "jq") == "Queued", 30, "Queued")
            kueue.pend("jq-workload", "couldn't assign flavors to pod set default: insufficient quota for cpu")
            wait_for(lambda: "insufficient quota" in _message(kube, "jq"), 30, "Kueue's reason in the job's status")
            _wait_ticks(op, kube, "jq")
            assert kube.pods("jq") == [] and not api.requests("POST", "pods"), "no pod before admission"

            kueue.admit("jq-workload", "cq", {"head": "general", "default": "spot"})
            pods = wait_for(lambda: len(kube.pods("jq")) == 2 and kube.pods("jq"), 30,
                            lambda: f"the admitted gang; the job's status: {kube.status('jq')}")
            placed = {p.metadata.name: p.spec for p in pods}
            assert placed["jq-head-g0"].node_selector == {"pool": "general"}
            assert placed["jq-default-0-g0"].node_selector == {"pool": "spot"}
            assert [t.key for t in placed["jq-default-0-g0"].tolerations] == ["spot"]
            assert {p.metadata.labels["kueue.x-k8s.io/podset"] for p in pods} == {"head", "default"}
            _run_all(kube, "jq")
            wait_for(lambda: _phase(kube, "jq") == "Running", 30, "Running")
            wait_for(lambda: condition(kueue.workload("jq-workload"), "PodsReady").get("status") == "True", 30,
                     "PodsReady in the Workload")

            kueue.evict("jq-workload")
            wait_for(lambda: _phase(kube, "jq") == "Queued" and not kube.pods("jq"), 30, "evicted: pods gone, Queued")
            wl = wait_for(lambda: (w := kueue.workload("jq-workload")) and not (w.get("status") or {}).get(
                "admission") and w, 30, "the quota given back")
            assert condition(wl, "QuotaReserved")["status"] == "False"
            assert condition(wl, "Requeued")["status"] == "True" and condition(wl, "Admitted")["status"] == "False"
            st = kube.status("jq")
            assert st["reason"] == "Evicted" and "Preempted" in st["message"] and st["restarts"] == 0
            assert "Evicted" in _reasons(kube, "jq")

            kueue.admit("jq-workload", "cq", {"head": "general", "default": "general"})
            wait_for(lambda: _pod_names(kube, "jq") == ["jq-default-0-g0", "jq-head-g0"], 30, "resumed")
            assert kube.pods("jq")[0].spec.node_selector == {"pool": "general"}
            assert "resuming from the last checkpoint" in _message(kube, "jq")
            _run_all(kube, "jq")
            wait_for(lambda: _phase(kube, "jq") == "Running", 30, "Running again")
            # runPolicy.suspend is the Workload's spec.active (Kueue then evicts it, Deactivated, and its quota goes)
            kube.patch_job("jq", {"spec": {"runPolicy": {"suspend": True}}})
            wait_for(lambda: kueue.workload("jq-workload")["spec"]["active"] is False, 30, "spec.active false")
            kueue.evict("jq-workload", "Deactivated", "The workload is deactivated")
            wait_for(lambda: _phase(kube, "jq") == "Suspended" and not (kueue.workload("jq-workload").get(
                "status") or {}).get("admission"), 30, "Suspended, the quota given back")
            kube.patch_job("jq", {"spec": {"runPolicy": {"suspend": False}}})
            wait_for(lambda: kueue.workload("jq-workload")["spec"]["active"] is True, 30, "spec.active true")
            kueue.admit("jq-workload", "cq", {"head": "general", "default": "general"})
            wait_for(lambda: len(kube.pods("jq")) == 2, 30, "admitted again")
            _run_all(kube, "jq")
            wait_for(lambda: _phase(kube, "jq") == "Running", 30, "Running once more")
            kube.set_pod_phase("jq-head-g0", "Succeeded", exit_code=0)
            wait_for(lambda: condition(kueue.workload("jq-workload"), "Finished").get("reason") == "Succeeded", 30,
                     "Finished in the Workload")
            kube.delete_job("jq")
            wait_for(lambda: kube.job("jq") is None and kueue.workload("jq-workload") is None, 30,
                     "the job and its Workload gone")

            # issue 52: a placement: auto job plans first, outside the queue; its Workload asks for the planned pools
            auto = _auto_doc("jqa")
            auto["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
            kube.create_job(auto)
            wait_for(lambda: _pod_names(kube, "jqa") == ["jqa-plan"], 30, "the plan pod, before any Workload")
            _wait_ticks(op, kube, "jqa")
            assert kueue.workload("jqa-workload") is None and _phase(kube, "jqa") == "Queued"
            _plan_pod_ended(kube, "jqa-plan", 0, json.dumps(_plan_record()))
            wl = wait_for(lambda: kueue.workload("jqa-workload"), 30, lambda: f"its Workload; {kube.status('jqa')}")
            assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("head", 1), ("learner", 1),
                                                                                ("gen", 1)]
            wait_for(lambda: _pod_names(kube, "jqa") == [], 30, "the plan pod gone; no pod before admission")
            kueue.admit("jqa-workload", "cq", {"head": "general", "learner": "general", "gen": "general"})
            wait_for(lambda: _pod_names(kube, "jqa") == ["jqa-gen-0-g0", "jqa-head-g0", "jqa-learner-0-g0"], 30,
                     "the admitted planned gang")
            kube.delete_job("jqa")
            wait_for(lambda: kube.job("jqa") is None, 30, "jqa gone")

            used = {(KUEUE_GROUPS.get(r.plural, GROUPS.get(r.plural, "")), r.plural,
                     VERBS.get(r.action.name, "patch" if r.method == "PATCH" else "update"))
                    for r in list(api.handler.log) if r.agent.startswith(("kopf", "hybridflow-operator")) and r.plural}
            granted = _granted_with("cluster-wide-kueue")
            granted |= {(g, r.split("/")[0], v) for g, r, v in granted if r.endswith("/status")}
            assert used - granted == set(), "requests the chart's role would refuse"
            kueue_rights = {(g, r, v) for g, r, v in granted if r in KUEUE_GROUPS}
            assert kueue_rights - used == set(), "Kueue rights granted but never used: trim them"


def test_a_job_labelled_for_kueue_is_refused_where_the_operator_has_no_kueue(cluster):
    _, kube, _ = cluster
    doc = job_doc("jnq")
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    kube.create_job(doc)
    st = wait_for(lambda: (s := kube.status("jnq")).get("phase") == "Failed" and s, 30, "Failed")
    assert "metadata.labels[kueue.x-k8s.io/queue-name]" in st["message"] and "kueue.enabled" in st["message"]
    assert kube.pods("jnq") == []


def _auto_doc(name: str, **run_policy) -> dict:
    """The async example with `placement: auto` (issue 52), without its checkpoint claim."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async-k8s.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["placement"] = "auto"
    doc["spec"]["kubernetes"].pop("checkpointPvc")
    doc["spec"]["runPolicy"] = {"backoffLimit": 2, **run_policy}
    return doc


def _plan_record() -> dict:
    """A record as `hybridflow plan --auto` writes it (hybridflow.api.plan), with pools of the planner's own."""
    from hybridflow.api import parse_job
    from hybridflow.api.plan import plan_fields

    doc = _auto_doc("x")
    doc["spec"]["resourcePools"] = [{"name": "learner", "nodes": 1, "devicesPerNode": 1},
                                    {"name": "gen", "nodes": 1, "devicesPerNode": 1}]
    doc["spec"]["placement"] = {"actor": "learner", "reference": "learner", "rollout": "gen"}
    summary = {"placement": "hybrid (actor+reference:1, rollout:1)", "pools": {"learner": 1, "gen": 1},
               "mode": "async", "layout": "fsdp t_g=1 mb=64", "devices": 2, "accelerator": "cpu"}
    return {"summary": summary, "fields": plan_fields(parse_job(doc))}


def _plan_pod_ended(kube, name: str, exit_code: int, message: str) -> None:
    """What the kubelet reports of a plan pod that ended: its termination message (the plan, or its log's tail)."""
    kube.core.patch_namespaced_pod_status(name, kube.namespace, {"status": {
        "phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [{
            "name": "plan", "ready": False, "restartCount": 0, "image": "x", "imageID": "", "state": {"terminated": {
                "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "message": message}}}]}})


def test_a_placement_auto_job_plans_in_a_pod_first_then_runs_the_planned_pools(cluster):
    """Issue 52: a `placement: auto` job first gets its plan pod and nothing of its gang; the plan it prints goes to
    status.plan, the pod goes, and the gang is the plan's pools, each container given the plan (PLAN_ENV); the spec
    ConfigMap keeps the accepted auto spec, and a gang restart keeps the plan and plans nothing again."""
    from hybridflow.api.plan import PLAN_ENV

    api, kube, op = cluster
    kube.create_job(_auto_doc("auto", restartPolicy="gang"))
    (pod,) = wait_for(lambda: kube.pods("auto"), 30, "the plan pod")
    assert pod.metadata.name == "auto-plan" and pod.metadata.labels["hybridflow.io/role"] == "plan"
    assert pod.spec.containers[0].command[:3] == ["hybridflow", "plan", "/etc/hybridflow/job.json"]
    assert pod.spec.automount_service_account_token is False
    _wait_ticks(op, kube, "auto")
    assert _pod_names(kube, "auto") == ["auto-plan"], "nothing of the gang before its plan"
    st = kube.status("auto")
    assert (st["phase"], st["reason"]) == ("Pending", "Planning") and "plan" not in st, st
    record = _plan_record()
    _plan_pod_ended(kube, "auto-plan", 0, json.dumps(record))
    wait_for(lambda: kube.status("auto").get("plan") == record, 30, lambda: f"status.plan; {kube.status('auto')}")
    pods = wait_for(lambda: _pod_names(kube, "auto") == ["auto-gen-0-g0", "auto-head-g0", "auto-learner-0-g0"]
                    and kube.pods("auto"), 30, lambda: f"the planned gang, no plan pod; {_pod_names(kube, 'auto')}")
    for p in pods:
        env = {e.name: e.value for c in p.spec.containers for e in c.env or []}
        assert json.loads(env[PLAN_ENV]) == record, p.metadata.name
    assert {p.metadata.labels.get("hybridflow.io/pool") for p in pods} == {None, "learner", "gen"}
    wait_for(lambda: "Planned" in _reasons(kube, "auto"), 30, lambda: f"the Planned event; {_reasons(kube, 'auto')}")
    (cm,) = [c for c in api.objects("v1/configmaps", kube.namespace) if c["metadata"]["name"] == "auto-spec"]
    assert json.loads(cm["data"]["job.json"])["spec"]["placement"] == "auto"
    _run_all(kube, "auto")
    wait_for(lambda: _phase(kube, "auto") == "Running", 30, "Running")
    assert [p["name"] for p in kube.status("auto")["pools"]] == ["learner", "gen"]
    kube.set_pod_phase("auto-learner-0-g0", "Failed", exit_code=1)  # a gang restart: the plan stays, none is made
    wait_for(lambda: _pod_names(kube, "auto") == ["auto-gen-0-g1", "auto-head-g1", "auto-learner-0-g1"], 30,
             lambda: f"generation 1, the planned pools again; {_pod_names(kube, 'auto')}")
    assert kube.status("auto")["plan"] == record


def test_a_plan_pod_that_fails_fails_the_job_with_its_message(cluster):
    _, kube, _ = cluster
    kube.create_job(_auto_doc("noplan"))
    wait_for(lambda: _pod_names(kube, "noplan") == ["noplan-plan"], 30, "the plan pod")
    _plan_pod_ended(kube, "noplan-plan", 2, "loading\nerror: /etc/hybridflow/job.json: spec.placement: auto: no "
                    "placement of this job's models fits its 2 x cpu (spec.resourcePools; 18 candidates)")
    st = wait_for(lambda: (s := kube.status("noplan")).get("phase") == "Failed" and s, 30, "Failed")
    assert st["reason"] == "PlanFailed" and "plan" not in st
    assert st["restarts"] == 0 and "GangRestart" not in _reasons(kube, "noplan"), "the plan pod is not the gang's"
    assert ("the plan pod noplan-plan failed: container plan exited with code 2 (Error): /etc/hybridflow/job.json: "
            "spec.placement: auto: no placement of this job's models fits its 2 x cpu (spec.resourcePools") \
        in st["message"], st["message"]
    assert _pod_names(kube, "noplan") == ["noplan-plan"], "no gang; the failed plan pod stays for its logs"
