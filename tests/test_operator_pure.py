"""The operator's pure functions: manifests (validated with the official schemas) and the phase machine."""
import base64
import datetime as dt
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from hybridflow.api import ROLES, SpecError, parse_job, pool_resource
from hybridflow.api.status import pool_status
from hybridflow_operator import manifests as mf
from hybridflow_operator.phases import STUCK_TERMINATING_SECONDS, PodView, decide, iso, set_condition
from hybridflow_operator.progress import merge_progress, parse_progress

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSIONS = [f"1.{m}" for m in range(29, 38)]
NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.timezone.utc)


def _raw(example: str, **spec_changes) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    doc["metadata"] = {"name": doc["metadata"]["name"], "namespace": "ml", "uid": "1234-abcd"}
    for k, v in spec_changes.items():
        doc["spec"][k] = v
    return doc


def _all_manifests(raw: dict) -> list[dict]:
    job = parse_job(raw)
    uid = raw["metadata"]["uid"]
    return mf.static_children(job, uid, TOKEN, ["monitoring", "hybridflow-system"]) + mf.gang_pods(job, uid, 0)


TOKEN = "ab" * 32


@pytest.mark.parametrize("example", ["tiny-grpo.yaml", "gpu-grpo-7b.yaml", "tiny-ppo.yaml"])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_strictly(example, version):
    for obj in _all_manifests(_raw(example)):
        if obj["kind"] == "PodGroup":  # a Volcano CRD: not in the official schemas; checked below
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_unknown_fields():
    pod = next(o for o in _all_manifests(_raw("tiny-grpo.yaml")) if o["kind"] == "Pod")
    pod["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSIONS[-1], strict=True)


def test_gang_and_pod_details():
    raw = _raw("gpu-grpo-7b.yaml")
    job = parse_job(raw)
    objs = _all_manifests(raw)
    pods = [o for o in objs if o["kind"] == "Pod"]
    assert len(pods) == 3  # head + 2 GPU nodes
    pg = next(o for o in objs if o["kind"] == "PodGroup")
    assert pg["spec"]["minMember"] == 3
    worker = next(p for p in pods if p["metadata"]["labels"][mf.LABEL_ROLE] == "worker")
    spec = worker["spec"]
    assert spec["schedulerName"] == "volcano" and spec["priorityClassName"] == "high-priority"
    assert worker["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "qwen2-7b-grpo-gang"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    main = spec["containers"][0]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pool_resource("gpus") in main["command"][-1] and "--num-gpus=8" in main["command"][-1]
    assert spec["initContainers"][0]["name"] == "wait-for-head"
    assert "qwen2-7b-grpo-head.ml.svc" in spec["initContainers"][0]["command"][-1]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == "rlhf-checkpoints"
    assert vols["models"]["persistentVolumeClaim"]["readOnly"] is True
    for o in objs:
        ref = o["metadata"]["ownerReferences"][0]
        assert ref["uid"] == "1234-abcd" and ref["controller"] is True
        assert o["metadata"]["labels"][mf.LABEL_JOB] == "qwen2-7b-grpo"
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    resolved = json.loads(cm["data"][mf.SPEC_KEY])
    assert resolved["spec"]["trainer"]["checkpointDir"] == f"{mf.CHECKPOINT_MOUNT}/ml/qwen2-7b-grpo"  # the job's own
    assert resolved["spec"]["metrics"]["address"] == "0.0.0.0"
    assert parse_job(resolved).spec == mf.resolved_job(job).spec
    head = next(p for p in pods if p["metadata"]["labels"][mf.LABEL_ROLE] == "head")
    script = head["spec"]["containers"][0]["command"][-1]
    assert "exec hybridflow driver /etc/hybridflow/job.json " in script  # JSON only: no YAML spec to fall back to
    assert "job.yaml" not in script
    assert not any("nvidia.com/gpu" in str(c.get("resources")) for c in head["spec"]["containers"])


def test_ray_auth_is_always_on_with_the_jobs_own_token_or_the_users_secret():
    raw = _raw("tiny-grpo.yaml")
    objs = _all_manifests(raw)
    secret = next(o for o in objs if o["kind"] == "Secret")
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN
    assert secret["metadata"]["name"] == "tiny-grpo-ray-token" and secret["metadata"]["ownerReferences"][0]["controller"]
    for pod in (o for o in objs if o["kind"] == "Pod"):
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            env = {e["name"]: e for e in c["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "tiny-grpo-ray-token", "key": "token"}
    raw["spec"]["kubernetes"] = {"rayAuthSecret": "team-ray-token"}
    objs = _all_manifests(raw)
    assert not [o for o in objs if o["kind"] == "Secret"], "a user's Secret is used, not a second one made"
    env = {e["name"]: e for e in objs[-1]["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "team-ray-token", "key": "token"}


def test_network_policy_admits_the_jobs_pods_and_the_scrapers_metrics_port_only():
    raw = _raw("tiny-grpo.yaml")
    np = next(o for o in _all_manifests(raw) if o["kind"] == "NetworkPolicy")
    spec = np["spec"]
    assert spec["podSelector"] == {"matchLabels": {mf.LABEL_JOB: "tiny-grpo"}}
    assert spec["policyTypes"] == ["Ingress", "Egress"]  # egress: test_job_egress_... below
    own, scrapers = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {mf.LABEL_JOB: "tiny-grpo"}}}]}  # every port, own pods
    assert scrapers["ports"] == [{"protocol": "TCP", "port": 8000}]
    sel = scrapers["from"][0]["namespaceSelector"]["matchExpressions"][0]
    assert sel["key"] == "kubernetes.io/metadata.name" and sel["values"] == ["hybridflow-system", "monitoring"]
    raw["spec"]["metrics"] = {"port": 0}
    np = next(o for o in _all_manifests(raw) if o["kind"] == "NetworkPolicy")
    assert len(np["spec"]["ingress"]) == 1, "no metrics port, no door for scrapers"


def _restricted_problems(pod: dict) -> list[str]:
    """The Pod Security Standard `restricted` (v1.30+ rules), checked field by field as the API server's Pod
    Security admission does, plus what this project asks beyond it (read-only root, bounded scratch)."""
    spec, out = pod["spec"], []
    psc = spec.get("securityContext") or {}
    for v in spec.get("volumes", []):
        allowed = {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected", "downwardAPI",
                   "csi", "ephemeral"}
        if not set(v) - {"name"} <= allowed:
            out.append(f"volume {v['name']} kind not allowed")
        if "emptyDir" in v and not v["emptyDir"].get("sizeLimit"):
            out.append(f"emptyDir {v['name']} has no sizeLimit")
    if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
        out.append("host namespaces")
    if spec.get("automountServiceAccountToken") is not False:
        out.append("service account token mounted")
    if (psc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        out.append("pod seccompProfile")
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            out.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        if "ALL" not in (sc.get("capabilities") or {}).get("drop", []):
            out.append(f"{name}: capabilities not dropped")
        if set((sc.get("capabilities") or {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities added")
        if sc.get("seccompProfile", {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile")
        if not sc.get("readOnlyRootFilesystem"):
            out.append(f"{name}: writable root filesystem")
        if not (c.get("resources") or {}).get("limits", {}).get("ephemeral-storage"):
            out.append(f"{name}: no ephemeral-storage limit")
        if not (c.get("resources") or {}).get("requests", {}).get("ephemeral-storage"):
            out.append(f"{name}: no ephemeral-storage request (the limit would become the request)")
        if c.get("workingDir") != "/tmp":
            out.append(f"{name}: works in a read-only directory")
        for p in c.get("ports", []):
            if p.get("hostPort"):
                out.append(f"{name}: hostPort")
    return out


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_pod_of_every_example_meets_the_restricted_pod_security_standard(example):
    pods = [o for o in _all_manifests(_raw(example)) if o["kind"] == "Pod"]
    assert pods
    for pod in pods:
        assert _restricted_problems(pod) == [], pod["metadata"]["name"]
        mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert {"/tmp", "/dev/shm", mf.MODEL_CACHE} <= mounts  # where Ray, vLLM and torch write


def test_the_restricted_check_catches_a_pod_that_breaks_it():
    pod = next(o for o in _all_manifests(_raw("tiny-grpo.yaml")) if o["kind"] == "Pod")
    pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    pod["spec"]["volumes"].append({"name": "x", "emptyDir": {}})
    pod["spec"].pop("automountServiceAccountToken")
    assert len(_restricted_problems(pod)) == 3


def test_generations_never_collide():
    raw = _raw("tiny-grpo.yaml")
    job = parse_job(raw)
    g0 = {p["metadata"]["name"] for p in mf.gang_pods(job, raw["metadata"]["uid"], 0)}
    g1 = {p["metadata"]["name"] for p in mf.gang_pods(job, raw["metadata"]["uid"], 1)}
    assert not g0 & g1


# --- the phase machine -------------------------------------------------------------------------------------------

JOB = parse_job(_raw("tiny-grpo.yaml", runPolicy={"backoffLimit": 1, "restartPolicy": "gang"}))
# The default restart policy: a failed pool pod is replaced alone (restartPolicy failedPod). Two pool pods.
REPLACING = parse_job(_raw("tiny-grpo-k8s.yaml", runPolicy={"backoffLimit": 1, "replacementLimit": 2}))


def pods(gen=0, head="Running", worker="Running", deleting=False):
    return [PodView(f"h-g{gen}", "head", gen, head, deleting), PodView(f"w-g{gen}", "worker", gen, worker, deleting)]


def test_new_job_creates_everything():
    plan = decide(JOB, None, {}, [], NOW)
    assert plan.status["phase"] == "Pending" and plan.create_static and plan.create_gang == 0
    assert plan.status["startTime"] == iso(NOW) and plan.status["restarts"] == 0


def test_pending_to_initializing_to_running():
    st = {"phase": "Pending", "restarts": 0}
    assert decide(JOB, None, st, pods(head="Pending", worker="Pending"), NOW).status["phase"] == "Pending"
    assert decide(JOB, None, st, pods(head="Running", worker="Pending"), NOW).status["phase"] == "Initializing"
    plan = decide(JOB, None, {"phase": "Initializing", "restarts": 0}, pods(), NOW)
    assert plan.status["phase"] == "Running" and ("Normal", "AllPodsRunning") == plan.events[0][:2]


def test_missing_pods_are_created_while_pending_but_restart_the_gang_while_running():
    plan = decide(JOB, None, {"phase": "Pending", "restarts": 0}, pods()[:1], NOW)
    assert plan.create_gang == 0 and plan.status["phase"] == "Pending"
    plan = decide(JOB, None, {"phase": "Running", "restarts": 0}, pods()[:1], NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1


def test_failure_restarts_then_backoff_fails():
    plan = decide(JOB, None, {"phase": "Running", "restarts": 0}, pods(worker="Failed"), NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1
    assert sorted(plan.delete_pods) == ["h-g0", "w-g0"]
    # old generation still terminating: wait
    plan = decide(JOB, None, plan.status, pods(gen=0, deleting=True), NOW)
    assert plan.status["phase"] == "Restarting" and plan.create_gang is None
    plan = decide(JOB, None, plan.status, [], NOW)
    assert plan.status["phase"] == "Pending" and plan.create_gang == 1
    plan = decide(JOB, None, {**plan.status, "phase": "Running"}, pods(gen=1, head="Failed"), NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "BackoffLimitExceeded"
    assert plan.delete_pods == ["w-g1"]  # the head stays for its logs


def test_a_disrupted_pod_restarts_the_gang_without_using_the_backoff_limit():
    """JOB allows one restart. An eviction (DisruptionTarget) restarts the gang for free; then a real failure
    uses the one restart; the next failure fails the job."""
    evicted = [PodView("h-g0", "head", 0, "Running"),
               PodView("w-g0", "worker", 0, "Running", True, disruption="EvictionByEvictionAPI")]
    plan = decide(JOB, None, {"phase": "Running", "restarts": 0}, evicted, NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1
    assert plan.status["disruptions"] == 1 and "not counted against runPolicy.backoffLimit" in plan.status["message"]
    assert "EvictionByEvictionAPI" in plan.status["message"]
    st = {**plan.status, "phase": "Running"}
    plan = decide(JOB, None, st, pods(gen=1, worker="Failed"), NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 2 and "(1/1)" in plan.status["message"]
    plan = decide(JOB, None, {**plan.status, "phase": "Running"}, pods(gen=2, worker="Failed"), NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "BackoffLimitExceeded"
    assert "1 restart(s) used of runPolicy.backoffLimit=1" in plan.status["message"]


def test_an_evicted_pod_already_gone_still_does_not_use_the_backoff_limit():
    """The pod watch saw its DisruptionTarget, but the pod was deleted before the tick: only the head is left."""
    gone = [PodView("h-g0", "head", 0, "Running")]
    st = {"phase": "Running", "restarts": 0}
    plan = decide(JOB, None, st, gone, NOW, disrupted={"w-g0": "PreemptionByScheduler"})
    assert plan.status["disruptions"] == 1 and "PreemptionByScheduler" in plan.status["message"]
    assert decide(JOB, None, st, gone, NOW).status.get("disruptions") is None  # unseen: counted, as before


def test_a_pod_stuck_terminating_holds_a_gang_restart_back_only_for_a_while():
    st = {"phase": "Restarting", "restarts": 1}
    grace_end = NOW - dt.timedelta(seconds=30)  # 30 s past the grace period: wait
    stuck = [PodView("w-g0", "worker", 0, "Running", True, deletion_deadline=grace_end)]
    plan = decide(JOB, None, st, stuck, NOW)
    assert plan.create_gang is None  # within a minute of its grace period: wait
    plan = decide(JOB, None, st, stuck, NOW + dt.timedelta(seconds=STUCK_TERMINATING_SECONDS))
    assert plan.create_gang == 1 and plan.status["phase"] == "Pending"
    assert any(e[1] == "PodStuckTerminating" and "w-g0" in e[2] for e in plan.events)


@pytest.mark.parametrize("pod_status, reason", [
    ({"containerStatuses": [{"name": "ray-worker", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "hybridflow/worker-cpu:0.9"'}}}]},
     "ImagePullBackOff"),
    ({"containerStatuses": [{"name": "controller", "state": {"waiting": {
        "reason": "CreateContainerConfigError", "message": 'secret "tok" not found'}}}]}, "CreateContainerConfigError"),
    ({"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}, "Unschedulable"),
])
def test_pods_that_cannot_start_show_as_a_condition_and_one_event(pod_status, reason):
    from hybridflow_operator.handlers import _pod_view

    raw = {"metadata": {"name": "w-g0", "labels": {mf.LABEL_ROLE: "worker", mf.LABEL_GENERATION: "0"},
                        "creationTimestamp": iso(NOW)}, "status": {"phase": "Pending", **pod_status}}
    current = [PodView("h-g0", "head", 0, "Running"), _pod_view(raw)]
    plan = decide(JOB, None, {"phase": "Initializing", "restarts": 0}, current, NOW)
    cond = next(c for c in plan.status["conditions"] if c["type"] == "PodsStarting")
    assert cond["status"] == "False" and cond["reason"] == reason and "w-g0" in cond["message"], cond
    assert [e[1] for e in plan.events] == [reason]
    again = decide(JOB, None, plan.status, current, NOW)
    assert again.events == [], "one event per reason, not one per tick"
    started = decide(JOB, None, again.status, pods(), NOW)
    assert next(c for c in started.status["conditions"] if c["type"] == "PodsStarting")["status"] == "True"


def test_a_pod_pending_too_long_is_reported():
    young = PodView("w-g0", "worker", 0, "Pending", pending_since=NOW - dt.timedelta(seconds=60))
    plan = decide(JOB, None, {"phase": "Pending", "restarts": 0}, [PodView("h-g0", "head", 0, "Pending"), young], NOW)
    assert not [c for c in plan.status.get("conditions", []) if c["type"] == "PodsStarting"]
    old = PodView("w-g0", "worker", 0, "Pending", pending_since=NOW - dt.timedelta(seconds=900))
    plan = decide(JOB, None, {"phase": "Pending", "restarts": 0}, [PodView("h-g0", "head", 0, "Pending"), old], NOW)
    assert next(c for c in plan.status["conditions"] if c["type"] == "PodsStarting")["reason"] == "PendingTooLong"


def test_success_cleans_up_workers_and_ttl_deletes_the_job():
    job = parse_job(_raw("tiny-grpo.yaml", runPolicy={"ttlSecondsAfterFinished": 60}))
    plan = decide(job, None, {"phase": "Running", "restarts": 0, "step": 37, "totalSteps": 40}, pods(head="Succeeded"),
                  NOW)
    assert plan.status["phase"] == "Succeeded" and plan.delete_pods == ["w-g0"]
    assert plan.status["step"] == 40  # the last polls can miss the final steps; a driver exits 0 only after them
    assert not decide(job, None, plan.status, pods(head="Succeeded")[:1], NOW).delete_job
    later = NOW + dt.timedelta(seconds=61)
    assert decide(job, None, plan.status, pods(head="Succeeded")[:1], later).delete_job


def test_suspend_and_resume():
    job = parse_job(_raw("tiny-grpo.yaml", runPolicy={"suspend": True}))
    st = {"phase": "Running", "restarts": 2, "step": 17}
    plan = decide(job, None, st, pods(gen=2), NOW)
    assert plan.status["phase"] == "Suspending" and sorted(plan.delete_pods) == ["h-g2", "w-g2"]
    plan = decide(job, None, plan.status, [], NOW)
    assert plan.status["phase"] == "Suspended" and plan.status["step"] == 17 and plan.status["restarts"] == 2
    assert decide(job, None, plan.status, [], NOW).status["phase"] == "Suspended"
    plan = decide(JOB, None, plan.status, [], NOW)
    assert plan.status["phase"] == "Pending" and plan.create_gang == 2


def test_deadline():
    job = parse_job(_raw("tiny-grpo.yaml", runPolicy={"activeDeadlineSeconds": 10}))
    st = {"phase": "Running", "restarts": 0, "startTime": iso(NOW - dt.timedelta(seconds=11))}
    plan = decide(job, None, st, pods(), NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "DeadlineExceeded"


def test_invalid_spec_fails_once():
    plan = decide(None, "spec.rollout.responsesPerPrompt: bad", {}, [], NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "ValidationFailed"
    again = decide(None, "spec.rollout.responsesPerPrompt: bad", plan.status, [], NOW)
    assert again.events == [] and again.status == plan.status


def test_stale_generation_pods_are_removed():
    plan = decide(JOB, None, {"phase": "Running", "restarts": 1}, pods(gen=1) + pods(gen=0)[:1], NOW)
    assert plan.delete_pods == ["h-g0"] and plan.status["phase"] == "Running"


def test_condition_transition_time_moves_only_on_flip():
    st: dict = {}
    set_condition(st, "Running", True, "A", "m", NOW)
    set_condition(st, "Running", True, "B", "m2", NOW + dt.timedelta(seconds=5))
    assert st["conditions"][0]["lastTransitionTime"] == iso(NOW) and st["conditions"][0]["reason"] == "B"
    set_condition(st, "Running", False, "C", "m3", NOW + dt.timedelta(seconds=9))
    assert st["conditions"][0]["lastTransitionTime"] == iso(NOW + dt.timedelta(seconds=9))


def test_progress_parsing_ignores_other_jobs():
    text = ('hybridflow_step{rlhfjob="a"} 5.0\nhybridflow_step{rlhfjob="b"} 9.0\n'
            'hybridflow_throughput_tokens_per_second{rlhfjob="a"} 12.345\nhybridflow_last_checkpoint_step{rlhfjob="a"} 4\n')
    prog = parse_progress(text, "a")
    assert prog == {"step": 5, "tokensPerSecond": 12.3, "lastCheckpointStep": 4}
    st: dict = {}
    merge_progress(st, dict(prog), "/ckpt", "T1")
    merge_progress(st, dict(prog), "/ckpt", "T2")
    assert st["lastCheckpoint"] == "/ckpt/step_00000004" and st["lastCheckpointTime"] == "T1"


def test_operator_does_not_import_torch_or_ray():
    import subprocess
    import sys

    code = "import sys, hybridflow_operator.handlers; print('torch' in sys.modules or 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("key,kind", [("containerStatuses", "container"), ("initContainerStatuses", "init container")])
def test_pod_view_names_the_container_and_exit_code(key, kind):
    from hybridflow_operator.handlers import _pod_view

    pod = {"metadata": {"name": "j-default-0-g1", "labels": {mf.LABEL_GENERATION: "1"}},
           "status": {"phase": "Failed", key: [{"name": "c1", "state": {"terminated": {"exitCode": 137,
                                                                                     "reason": "Error"}}}]}}
    view = _pod_view(pod)
    assert view.generation == 1 and view.phase == "Failed"
    assert view.message == f"{kind} c1 exited with code 137 (Error)"


# --- the user's inputs on Kubernetes: data PVC, reward ConfigMap --------------------------------------------------

def _files_job(**k8s):
    raw = _raw("word-problems.yaml", kubernetes={"image": "hybridflow/worker-cpu:0.1.0", **k8s})
    raw["spec"]["data"]["train"] = ["word_problems/train.jsonl", "more/*.jsonl"]
    raw["spec"]["models"]["reward"]["function"]["path"] = "word_problem_reward.py"
    return raw


def test_data_pvc_and_reward_configmap_reach_the_head_only_read_only():
    raw = _files_job(dataPvc="prompts", rewardConfigMap="my-reward")
    objs = _all_manifests(raw)
    head, *workers = [o for o in objs if o["kind"] == "Pod"]
    vols = {v["name"]: v for v in head["spec"]["volumes"]}
    assert vols["data"]["persistentVolumeClaim"] == {"claimName": "prompts", "readOnly": True}
    assert vols["reward"]["configMap"] == {"name": "word-problems-reward"}  # the job's copy, not my-reward itself
    mounts = {m["name"]: m for m in head["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["data"] == {"name": "data", "mountPath": "/data", "readOnly": True}
    assert mounts["reward"]["mountPath"] == "/var/lib/hybridflow/reward" and mounts["reward"]["readOnly"]
    for w in workers:  # rewards and prompts are the driver's: pool pods do not see them
        assert not {"data", "reward"} & {v["name"] for v in w["spec"]["volumes"]}
    for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
        for obj in objs:
            if obj["kind"] != "PodGroup":
                kubernetes_validate.validate(obj, version, strict=True)
    # the spec the driver reads points inside the mounts, and resolving it again changes nothing
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    ran = parse_job(json.loads(cm["data"][mf.SPEC_KEY]))
    assert ran.spec.data.train == ["/data/word_problems/train.jsonl", "/data/more/*.jsonl"]
    assert ran.spec.models.reward.function.path == "/var/lib/hybridflow/reward/word_problem_reward.py"
    assert mf.resolved_job(ran) == ran


@pytest.mark.parametrize("change,message", [
    ({"data": {"source": "files", "train": ["/etc/passwd"], "promptKey": "q"}},
     r"spec.data.train\[0\]: with kubernetes.dataPvc, give a path inside the volume"),
    ({"data": {"source": "files", "train": ["../x.jsonl"]}}, r"spec.data.train\[0\]: .*no '..'"),
])
def test_data_paths_must_stay_inside_the_volume(change, message):
    from hybridflow.api import SpecError

    raw = _files_job(dataPvc="prompts")
    raw["spec"]["data"].update(change["data"])
    with pytest.raises(SpecError, match=message):
        parse_job(raw)


def test_reward_configmap_needs_a_function_named_by_its_key():
    from hybridflow.api import SpecError

    raw = _files_job(rewardConfigMap="my-reward")
    raw["spec"]["models"]["reward"]["function"]["path"] = "rewards/word_problem_reward.py"
    with pytest.raises(SpecError, match=r"function.path: with kubernetes.rewardConfigMap it is the ConfigMap's key"):
        parse_job(raw)
    raw["spec"]["models"]["reward"] = {"type": "scorer", "scorers": [{"name": "math"}]}
    with pytest.raises(SpecError, match=r"rewardConfigMap: holds the job's code files, and this job names none"):
        parse_job(raw)


def test_missing_inputs_hold_the_pods_back_with_a_reason_until_they_appear():
    job = parse_job(_files_job(rewardConfigMap="my-reward"))
    why = "spec.kubernetes.rewardConfigMap: ConfigMap 'my-reward' not found in namespace ml; create it"
    plan = decide(job, None, {}, [], NOW, missing_inputs=why)
    assert plan.create_gang is None and plan.status["phase"] == "Pending" and plan.status["reason"] == "InputsMissing"
    assert plan.events == [("Warning", "InputsMissing", why)]
    cond = next(c for c in plan.status["conditions"] if c["type"] == "InputsReady")
    assert cond["status"] == "False" and cond["message"] == why
    again = decide(job, None, plan.status, [], NOW, missing_inputs=why)
    assert again.create_gang is None and again.events == []  # one event, not one per tick
    paused = job.model_copy(deep=True)
    paused.spec.run_policy.suspend = True
    suspended = decide(paused, None, again.status, [], NOW)
    assert next(c for c in suspended.status["conditions"] if c["type"] == "InputsReady")["status"] == "False", \
        "nothing was checked: the condition must not flip"
    found = decide(job, None, again.status, [], NOW, missing_inputs="")
    assert found.create_gang == 0 and found.status["reason"] == "InputsFound"
    assert "creating the pods" in found.status["message"]
    assert next(c for c in found.status["conditions"] if c["type"] == "InputsReady")["status"] == "True"


def test_a_driver_that_rejects_its_input_fails_the_job_without_restarts():
    msg = "container controller exited with code 2 (Error): spec.data.train: cannot read '/data/x.parquet' as parquet"
    views = [PodView("h-g0", "head", 0, "Failed", message=msg, exit_code=2), PodView("w-g0", "worker", 0, "Running")]
    plan = decide(JOB, None, {"phase": "Running", "restarts": 0}, views, NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "InvalidInput" and plan.status["restarts"] == 0
    assert "cannot read '/data/x.parquet'" in plan.status["message"] and plan.delete_pods == ["w-g0"]
    views[0] = PodView("h-g0", "head", 0, "Failed", message="container controller exited with code 1", exit_code=1)
    assert decide(JOB, None, {"phase": "Running", "restarts": 0}, views, NOW).status["phase"] == "Restarting"


def test_the_drivers_error_is_read_from_its_log_tail():
    from hybridflow.api.errors import last_error
    from hybridflow_operator.handlers import _pod_view

    tail = ("2026-11-30 ray started\nsome progress\nerror: /etc/hybridflow/job.yaml: cannot run here\n"
            "  spec.data.train: 'x.jsonl' does not exist\n")
    assert last_error(tail) == "/etc/hybridflow/job.yaml: cannot run here spec.data.train: 'x.jsonl' does not exist"
    assert last_error("just a line\nKilled\n") == "Killed"
    pod = {"metadata": {"name": "j-head-g0", "labels": {mf.LABEL_ROLE: "head"}},
           "status": {"phase": "Failed", "containerStatuses": [{"name": "controller", "state": {"terminated": {
               "exitCode": 2, "reason": "Error", "message": tail}}}]}}
    view = _pod_view(pod)
    assert view.exit_code == 2 and view.message.endswith("spec.data.train: 'x.jsonl' does not exist")


def _pods(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] == "Pod"]


def test_checkpoint_secret_reaches_the_head_and_every_pool_pod_by_reference():
    raw = _raw("tiny-grpo.yaml", kubernetes={"checkpointSecret": "team-s3"},
               resourcePools=[{"name": "default", "devicesPerNode": 2, "nodes": 2}])
    objs = _all_manifests(raw)
    head, *workers = _pods(objs)
    assert head["metadata"]["labels"][mf.LABEL_ROLE] == "head" and len(workers) == 2
    for pod in (head, *workers):
        for c in pod["spec"]["containers"]:
            assert "envFrom" not in c  # only the credential variables: the Secret's other keys reach nothing
            env = {e["name"]: e for e in c["env"]}
            assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {"secretKeyRef": {
                "name": "team-s3", "key": "AWS_SECRET_ACCESS_KEY", "optional": True}}, pod["metadata"]["name"]
            assert {"AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_REGION"} <= set(env)
            assert "PYTHONPATH" not in env and "LD_PRELOAD" not in env
            assert len(c["env"]) == len(env), "no variable is set twice"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tiny-grpo-ray-token"
        for c in pod["spec"].get("initContainers", []):
            assert not _aws_credentials(c)  # waiting for the head needs none
        assert not [v for v in pod["spec"]["volumes"] if "secret" in v]  # by reference, never mounted or copied
        assert _restricted_problems(pod) == []
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "Secret"] == ["tiny-grpo-ray-token"]
    assert "team-s3" not in json.dumps([o for o in objs if o["kind"] not in ("Pod", "ConfigMap")])  # the spec, pods
    for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
        for pod in (head, *workers):
            kubernetes_validate.validate(pod, version, strict=True)


def _aws_credentials(container: dict) -> list[dict]:
    return [e for e in container["env"] if e["name"].startswith("AWS_") and e["name"] != "AWS_EC2_METADATA_DISABLED"]


def test_no_credentials_without_a_checkpoint_secret():
    for example in ("tiny-grpo.yaml", "gpu-grpo-7b.yaml"):
        for pod in _pods(_all_manifests(_raw(example))):
            for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
                assert "envFrom" not in c, (example, pod["metadata"]["name"], c["name"])
                assert not _aws_credentials(c), (example, c["name"])


@pytest.mark.parametrize("example, k8s", [("tiny-grpo.yaml", {}), ("gpu-grpo-7b.yaml", {}),
                                          ("tiny-grpo.yaml", {"checkpointSecret": "team-s3"})])
def test_no_job_container_asks_the_instance_metadata_service_for_credentials(example, k8s):
    """Issue 24 N3: only kubernetes.checkpointSecret's credentials reach a job; the AWS SDKs in its pods must not
    fall back to the node's instance role (its NetworkPolicy also denies egress to 169.254.0.0/16)."""
    raw = _raw(example, kubernetes={**_raw(example)["spec"].get("kubernetes", {}), **k8s})
    containers = [c for pod in _pods(_all_manifests(raw))
                  for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])]
    assert len(containers) >= 3
    for c in containers:
        assert {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"} in c["env"], c["name"]
        assert [e["name"] for e in c["env"]].count("AWS_EC2_METADATA_DISABLED") == 1, c["name"]


@pytest.mark.parametrize("checkpoint_dir, expected", [
    ("s3://bucket/runs", "s3://bucket/runs/ml/tiny-grpo"),
    ("s3://bucket/runs/", "s3://bucket/runs/ml/tiny-grpo"),
    ("s3://bucket", "s3://bucket/ml/tiny-grpo"),
    ("gs://bucket/a/b", "gs://bucket/a/b/ml/tiny-grpo"),
    ("s3://bucket/runs/ml/tiny-grpo", "s3://bucket/runs/ml/tiny-grpo"),  # already the job's own: kept
])
def test_object_storage_checkpoint_dir_stays_a_url_with_the_jobs_own_prefix_and_needs_no_pvc(checkpoint_dir,
                                                                                              expected):
    from hybridflow_operator.handlers import _missing_inputs
    from hybridflow_operator.policy import Policy

    trainer = {**_raw("tiny-grpo.yaml")["spec"]["trainer"], "checkpointDir": checkpoint_dir}
    raw = _raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointSecret": "team-s3"})
    job = parse_job(raw)
    objs = _all_manifests(raw)
    ran = parse_job(json.loads(next(o for o in objs if o["kind"] == "ConfigMap")["data"][mf.SPEC_KEY]))
    assert ran.spec.trainer.checkpoint_dir == expected  # not the PVC mount, and `s3://` not collapsed to `s3:/`
    assert mf.resolved_job(ran) == ran  # resolving again changes nothing
    for pod in _pods(objs):
        assert "checkpoints" not in {v["name"] for v in pod["spec"]["volumes"]}
        assert mf.CHECKPOINT_MOUNT not in {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    # nothing to look up: no PVC is needed (and the Secret is never read)
    assert _missing_inputs(_Cluster(), Policy.from_env(), job, "ml", {}) == ("", None)
    status: dict = {}
    merge_progress(status, {"step": 2, "lastCheckpointStep": 2}, ran.spec.trainer.checkpoint_dir, iso(NOW))
    assert status["lastCheckpoint"] == f"{expected}/step_00000002"
    # a checkpointPvc as well: the URL still names where checkpoints go
    raw["spec"]["kubernetes"]["checkpointPvc"] = "ck"
    assert mf.resolved_job(parse_job(raw)).spec.trainer.checkpoint_dir == expected


@pytest.mark.parametrize("live_dir, counts_as_a_change", [
    ("s3://bucket/runs", False),  # as accepted
    ("s3://other-bucket/runs", True),  # the job would go on writing to the old bucket: say so
    ("./runs/elsewhere", True),  # from object storage to the claim
])
def test_editing_an_object_storage_checkpoint_dir_on_a_live_job_is_a_spec_change(live_dir, counts_as_a_change):
    """The operator compares the live spec with the accepted one (all but runPolicy) to report SpecChangeIgnored.
    A checkpoint directory on the claim is the operator's own choice and never compared; an s3:// URL is the
    author's."""
    from hybridflow_operator.handlers import _spec_fields

    def job(checkpoint_dir: str, **k8s):
        trainer = {**_raw("tiny-grpo.yaml")["spec"]["trainer"], "checkpointDir": checkpoint_dir}
        return parse_job(_raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointPvc": "ck",
                                                                            "checkpointSecret": "team-s3", **k8s}))

    accepted = mf.resolved_job(job("s3://bucket/runs"))
    live = mf.resolved_job(job(live_dir))
    assert (_spec_fields(live) != _spec_fields(accepted)) is counts_as_a_change
    # on the claim, whatever the spec says is replaced by the job's own directory: not a change
    assert _spec_fields(mf.resolved_job(job("./a"))) == _spec_fields(mf.resolved_job(job("./b")))


def test_checkpoint_url_refuses_names_that_would_leave_the_prefix():
    assert mf.job_checkpoint_url("s3://b/p", None, "j") == "s3://b/p/j"
    for ns, name in (("..", "j"), ("ml", "a/b"), ("ml", "")):
        with pytest.raises(ValueError):
            mf.job_checkpoint_url("s3://b/p", ns, name)
    assert not mf.is_url("./runs/x") and not mf.is_url("/var/x") and not mf.is_url("s3:/b/x")
    assert mf.is_url("s3://b") and mf.is_url("gs://b/x")


CK, RM = mf.CHECKPOINT_MOUNT, mf.RESUME_MOUNT


def _ran(objs: list[dict]):
    """The spec the pods run: the ConfigMap's."""
    return parse_job(json.loads(next(o for o in objs if o["kind"] == "ConfigMap")["data"][mf.SPEC_KEY]))


def _claim_mounts(objs: list[dict], volume: str) -> list[list[dict]]:
    """Per pod (container and init containers), the mounts of `volume`, each pod validated strictly."""
    out = []
    for pod in _pods(objs):
        for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
            kubernetes_validate.validate(pod, version, strict=True)
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            out.append([m for m in c.get("volumeMounts", []) if m["name"] == volume])
    return out


def _with_trainer(example: str = "tiny-grpo.yaml", kubernetes: dict | None = None, **trainer) -> dict:
    return _raw(example, trainer={**_raw(example)["spec"]["trainer"], **trainer},
                kubernetes={**_raw(example)["spec"].get("kubernetes", {}), **(kubernetes or {})})


@pytest.mark.parametrize("resume_from, source", [
    ("tiny-grpo-2pods", "ml/tiny-grpo-2pods"),  # the old job's newest intact checkpoint
    ("tiny-grpo-2pods/step_00000006", "ml/tiny-grpo-2pods/step_00000006"),
    (f"{CK}/ml/tiny-grpo-2pods", "ml/tiny-grpo-2pods"),  # as the whole claim was once mounted: the same checkpoint
    (f"{RM}/ml/tiny-grpo-2pods/", "ml/tiny-grpo-2pods"),  # already resolved: kept
])
def test_resume_from_names_a_checkpoint_of_this_namespace_on_the_claim(resume_from, source):
    """How a job is resized: a new job (another pool size or tensorParallel) resumes from the old one's checkpoint
    in this namespace's directory on the shared claim. Issue 24 N6: the claim is never mounted whole; the job's own
    directory read-write, the source job's read-only by its own subPath, each where the spec the pods run names it.
    Issue 51 L2: that subPath is `<namespace>/<job>` only, also when resumeFrom names one of its checkpoints (the
    kubelet would follow a step_N planted as a link; the runtime opens step_N inside, never through a link)."""
    objs = _all_manifests(_with_trainer(resumeFrom=resume_from, kubernetes={"checkpointPvc": "ck"}))
    ran = _ran(objs)
    assert ran.spec.trainer.resume_from == f"{RM}/{source}"
    assert ran.spec.trainer.checkpoint_dir == f"{CK}/ml/tiny-grpo"
    assert mf.resolved_job(ran) == ran
    mounts = _claim_mounts(objs, "checkpoints")
    assert len(mounts) >= 3  # the head's controller, the worker, the worker's init container
    for per_container in mounts:
        if not per_container:
            continue  # an init container that only waits for the head
        assert per_container == [
            {"name": "checkpoints", "mountPath": f"{CK}/ml/tiny-grpo", "subPath": "ml/tiny-grpo"},
            {"name": "checkpoints", "mountPath": f"{RM}/ml/tiny-grpo-2pods", "subPath": "ml/tiny-grpo-2pods",
             "readOnly": True}]
    assert sum(1 for m in mounts if m) >= 2


def test_the_checkpoint_claim_is_mounted_by_the_jobs_own_subpath_only():
    """Issue 24 N6: job A cannot reach job B's step_N on a shared claim; without resumeFrom only the job's own
    `<namespace>/<job>` directory of it is in the pods, read-write; the claim volume itself is unchanged."""
    objs = _all_manifests(_with_trainer(kubernetes={"checkpointPvc": "ck"}))
    mounts = [m for per in _claim_mounts(objs, "checkpoints") for m in per]
    assert mounts and all(m == {"name": "checkpoints", "mountPath": f"{CK}/ml/tiny-grpo", "subPath": "ml/tiny-grpo"}
                          for m in mounts)
    for pod in _pods(objs):
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ck"}} in pod["spec"]["volumes"]


@pytest.mark.parametrize("resume_from", [
    f"{CK}/other-team/their-job",  # another namespace's, as the whole claim was once mounted
    f"{RM}/other-team/their-job",
    "other-team/their-job",  # <job>/<something> that is not one of its checkpoints
    "tiny-grpo-2pods/step_6",
    "tiny-grpo-2pods/step_00000006/actor",
    "/etc/hybridflow",  # elsewhere in the pod
    "Not-A-Job",
])
def test_resume_from_outside_this_namespace_on_the_claim_is_refused(resume_from):
    """Issue 24 N3/N6: before, another namespace's path was nested under this one's (a checkpoint that is not
    there); now the job is refused, naming the field and what to give instead."""
    raw = _with_trainer(resumeFrom=resume_from, kubernetes={"checkpointPvc": "ck"})
    with pytest.raises(SpecError, match=r"spec\.trainer\.resumeFrom: .* is not a checkpoint of namespace ml on "
                                        r"kubernetes\.checkpointPvc 'ck'; name a job of this namespace"):
        _all_manifests(raw)


@pytest.mark.parametrize("resume_from, expected", [
    ("old-job", "s3://bucket/runs/ml/old-job"),
    ("old-job/step_00000002", "s3://bucket/runs/ml/old-job/step_00000002"),
    ("s3://bucket/runs/ml/old-job", "s3://bucket/runs/ml/old-job"),
    ("s3://bucket/runs/ml/old-job/step_00000002/", "s3://bucket/runs/ml/old-job/step_00000002"),
])
def test_resume_from_on_object_storage_resolves_under_the_base_prefix_and_namespace(resume_from, expected):
    objs = _all_manifests(_with_trainer(checkpointDir="s3://bucket/runs", resumeFrom=resume_from,
                                        kubernetes={"checkpointSecret": "team-s3"}))
    ran = _ran(objs)
    assert (ran.spec.trainer.checkpoint_dir, ran.spec.trainer.resume_from) == ("s3://bucket/runs/ml/tiny-grpo",
                                                                                 expected)
    assert mf.resolved_job(ran) == ran
    assert not [m for per in _claim_mounts(objs, "checkpoints") for m in per]  # no claim: nothing mounted


@pytest.mark.parametrize("resume_from", [
    "s3://bucket/runs/team-b/job",  # another namespace's, the attack of issue 24 N3
    "s3://bucket/runs/team-b/job/step_00000002",
    "s3://other-bucket/runs/ml/old-job",  # another bucket
    "s3://bucket/elsewhere/ml/old-job",  # another prefix
    "s3://bucket/runs/ml/old-job/../../team-b/job",
    "gs://bucket/runs/ml/old-job",
    "s3://bucket/runs/ml",
])
def test_resume_from_another_namespace_on_object_storage_is_refused(resume_from):
    raw = _with_trainer(checkpointDir="s3://bucket/runs", resumeFrom=resume_from,
                        kubernetes={"checkpointSecret": "team-s3"})
    with pytest.raises(SpecError, match=r"spec\.trainer\.resumeFrom: .* is not a checkpoint of namespace ml under "
                                        r"s3://bucket/runs/ml/; .* or a URL under s3://bucket/runs/ml/"):
        mf.resolved_job(parse_job(raw))


def test_resume_from_on_object_storage_needs_a_checkpoint_dir_there():
    raw = _with_trainer(resumeFrom="s3://bucket/runs/ml/old-job",
                        kubernetes={"checkpointPvc": "ck", "checkpointSecret": "team-s3"})
    with pytest.raises(SpecError, match=r"spec\.trainer\.resumeFrom: .* is on object storage, but "
                                        r"spec\.trainer\.checkpointDir is not"):
        mf.resolved_job(parse_job(raw))


@pytest.mark.parametrize("trainer", [{"checkpointDir": "s3://bucket/runs"},
                                     {"checkpointDir": "az://container/runs", "resumeFrom": "old-job"},
                                     {"resumeFrom": "s3://bucket/runs/ml/old-job"}])
def test_object_storage_without_a_checkpoint_secret_is_refused(trainer):
    """Issue 24 N3: without the job's own credentials the SDKs would use the node's cloud identity."""
    raw = _with_trainer(**trainer)
    with pytest.raises(SpecError, match=r"spec\.kubernetes\.checkpointSecret: spec\.trainer\.(checkpointDir|"
                                        r"resumeFrom) '.*' is on object storage, and no Secret gives the pods"):
        mf.resolved_job(parse_job(raw))


def test_model_claim_is_mounted_read_only_by_each_models_subpath():
    """Issue 24 N6: kubernetes.modelPvc shows the pods the directories the spec names, not the claim's others."""
    objs = _all_manifests(_raw("gpu-grpo-7b.yaml"))
    mounts = [m for per in _claim_mounts(objs, "models") for m in per]
    assert mounts and all(m == {"name": "models", "mountPath": "/models/Qwen2.5-7B-Instruct", "readOnly": True,
                                "subPath": "Qwen2.5-7B-Instruct"} for m in mounts)
    # a path relative to the claim, and one model inside another's directory (seen through the outer mount)
    models = {"actor": {"source": "path", "path": "team/base"},
              "reward": {"type": "model", "model": {"source": "path", "path": "/models/team/base/rm"}}}
    raw = _raw("gpu-grpo-7b.yaml", models=models)
    ran = _ran(objs := _all_manifests(raw))
    assert (ran.spec.models.actor.path, ran.spec.models.reward.model.path) == ("/models/team/base",
                                                                              "/models/team/base/rm")
    assert {m["subPath"] for per in _claim_mounts(objs, "models") for m in per} == {"team/base"}


@pytest.mark.parametrize("path", ["/opt/models/x", "/models/../etc", "team/../../etc"])
def test_a_model_path_off_the_model_claim_is_refused(path):
    models = {**_raw("gpu-grpo-7b.yaml")["spec"]["models"], "actor": {"source": "path", "path": path}}
    raw = _raw("gpu-grpo-7b.yaml", models=models)
    with pytest.raises(SpecError, match=r"spec\.models\.actor\.path: with kubernetes\.modelPvc, give the model's "
                                        r"directory on that claim"):
        mf.resolved_job(parse_job(raw))


@pytest.mark.parametrize("cache_dir, expected", [
    ("prompt-cache", "/tmp/prompt-cache"),  # relative: the pod's scratch
    ("/tmp/x", "/tmp/x"),
    (f"{CK}/ml/tiny-grpo/cache", f"{CK}/ml/tiny-grpo/cache"),  # inside the job's own directory on the claim
    (f"{CK}/ml/other-job/cache", None),  # another job's directory
    ("/etc/hybridflow/cache", None),
    ("/tmp/../etc", None),
])
def test_cache_dir_is_confined_to_the_jobs_own_directories(cache_dir, expected):
    raw = _with_trainer(kubernetes={"checkpointPvc": "ck"})
    raw["spec"]["data"] = {**raw["spec"]["data"], "cacheDir": cache_dir}
    if expected is None:
        with pytest.raises(SpecError, match=r"spec\.data\.cacheDir: .* is outside this job's own directories"):
            mf.resolved_job(parse_job(raw))
        return
    ran = _ran(objs := _all_manifests(raw))
    assert ran.spec.data.cache_dir == expected and mf.resolved_job(ran) == ran
    _claim_mounts(objs, "checkpoints")  # the pods validate


def test_an_accepted_job_is_compared_resolved_and_an_edit_it_may_not_have_is_only_ignored():
    """A spec accepted by an older operator (resumeFrom below the whole claim's mount, a relative cacheDir) is the
    same job, not an edit; once accepted, an edit naming another namespace's checkpoint or object storage without
    credentials is a change to ignore (the job keeps running), not a SpecError that fails it."""
    from hybridflow_operator.handlers import _accepted_job

    def job(**trainer):
        raw = _with_trainer(kubernetes={"checkpointPvc": "ck"}, **trainer)
        raw["spec"]["data"] = {**raw["spec"]["data"], "cacheDir": "prompt-cache"}
        return raw, parse_job(raw)

    raw, live = job(resumeFrom="tiny-grpo-2pods")
    _, old = job(checkpointDir=f"{CK}/ml/tiny-grpo", resumeFrom=f"{CK}/ml/tiny-grpo-2pods")
    memo = {"accepted": old}
    accepted, changed = _accepted_job(_Cluster(), live, "1234-abcd", {}, memo)
    assert accepted == old and not changed
    for edit in ({"resumeFrom": "s3://bucket/runs/team-b/job"}, {"resumeFrom": f"{CK}/team-b/job"},
                 {"checkpointDir": "s3://bucket/runs"}):
        _, edited = job(**edit)
        with pytest.raises(SpecError):
            mf.resolved_job(edited)  # refused at acceptance
        accepted, changed = _accepted_job(_Cluster(), edited, "1234-abcd", {}, memo)
        assert accepted == old and changed, edit


def test_resume_from_may_not_climb_out_of_its_directory():
    trainer = {**_raw("tiny-grpo.yaml")["spec"]["trainer"], "resumeFrom": "../other-team/their-job"}
    with pytest.raises(SpecError, match=r"resumeFrom.*climbs out of its directory"):
        parse_job(_raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointPvc": "ck"}))
    # nor around it: a path in URL clothes (file://, local://) would not be confined; http(s) would fetch anything
    for field in ("resumeFrom", "checkpointDir"):
        for url in (f"file://{CK}/other-team/their-job", f"local://{CK}/other-team/x", "http://10.0.0.1/x"):
            trainer = {**_raw("tiny-grpo.yaml")["spec"]["trainer"], field: url}
            with pytest.raises(SpecError, match=rf"{field}.*is not object storage; use a plain path"):
                parse_job(_raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointPvc": "ck"}))


def test_a_job_created_suspended_is_accepted_at_once():
    """Issue 24 N1: its spec ConfigMap (and digest) is made at the first tick, suspended or not, so a spec edited
    while it waits is a change to ignore, never what its first pods are made of."""
    job = parse_job(_raw("tiny-grpo.yaml", runPolicy={"suspend": True}))
    plan = decide(job, None, {}, [], NOW)
    assert plan.status["phase"] == "Suspending" and plan.create_static and plan.create_gang is None
    later = decide(job, None, {"phase": "Running", "restarts": 0}, pods(), NOW)
    assert later.status["phase"] == "Suspending" and not later.create_static  # a suspend later: nothing to make


def test_pods_use_only_what_the_accepted_spec_names():
    """At every gang start the pods are checked against the accepted spec: a Secret, ConfigMap, PVC or
    ServiceAccount it does not name, or the user's reward ConfigMap mounted in place of the job's copy, is
    refused."""
    accepted = parse_job(_files_job(rewardConfigMap="my-reward", dataPvc="prompts"))
    raw = _files_job(rewardConfigMap="my-reward", dataPvc="prompts")
    uid = raw["metadata"]["uid"]
    assert mf.foreign_references(mf.gang_pods(accepted, uid, 0), accepted) == []
    assert ("ConfigMap", "word-problems-reward") in mf.pod_references(mf.gang_pods(accepted, uid, 0))
    edited = _files_job(rewardConfigMap="my-reward", dataPvc="other-data", rayAuthSecret="builder-token",
                        checkpointSecret="s3-admin", serviceAccountName="deployer")
    assert mf.foreign_references(mf.gang_pods(parse_job(edited), edited["metadata"]["uid"], 0), accepted) == [
        "PersistentVolumeClaim other-data", "Secret builder-token", "Secret s3-admin", "ServiceAccount deployer"]
    pods_ = mf.gang_pods(accepted, uid, 0)
    pods_[0]["spec"]["volumes"].append({"name": "x", "configMap": {"name": "my-reward"}})
    pods_[0]["spec"]["volumes"].append({"name": "p", "projected": {"sources": []}})
    pods_[1]["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "db"}}]
    assert mf.foreign_references(pods_, accepted) == ["ConfigMap my-reward", "Secret db", "projected volume p"]


def test_the_reward_copy_is_immutable_owned_and_bounded():
    raw = _files_job(rewardConfigMap="my-reward")
    job = parse_job(raw)
    cm = mf.reward_configmap(job, raw["metadata"]["uid"], "def compute_score(*a): return 1\n")
    assert cm["immutable"] is True and cm["metadata"]["name"] == "word-problems-reward"
    assert cm["data"] == {"word_problem_reward.py": "def compute_score(*a): return 1\n"}
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "1234-abcd"
    kubernetes_validate.validate(cm, K8S_VERSIONS[-1], strict=True)
    assert mf.reward_copy_problem("r.py", "x" * (mf.MAX_CONFIGMAP_BYTES - 4)) == ""
    assert "a ConfigMap holds at most 1048576 (1 MiB)" in mf.reward_copy_problem("r.py", "x" * mf.MAX_CONFIGMAP_BYTES)


def test_status_messages_are_capped():
    """Issue 24 N9: whatever a message quotes (a user's 200 KB key, a pod's log), each status message and each
    condition's stays at about 1 KiB; and a long reason that repeats is still one event, not one per tick."""
    from hybridflow_operator.phases import MAX_MESSAGE

    plan = decide(None, "spec.placement." + "k" * 200_000 + ": unknown role", {}, [], NOW)
    messages = [plan.status["message"], *(c["message"] for c in plan.status["conditions"])]
    assert len(messages) == 3 and all(len(m) == MAX_MESSAGE and m.endswith("\u2026") for m in messages)
    job = parse_job(_files_job(rewardConfigMap="my-reward"))
    why = "spec.kubernetes.dataPvc: " + "x" * 5000
    first = decide(job, None, {}, [], NOW, missing_inputs=why)
    assert len(first.status["message"]) == MAX_MESSAGE and len(first.events) == 1
    assert decide(job, None, first.status, [], NOW, missing_inputs=why).events == []


class _Cluster:
    """What `Kube.read` would find, by (kind, name): the API double the handlers' helpers are handed."""

    def __init__(self, **objects):
        self.objects = {tuple(k.split(":")): v for k, v in objects.items()}

    def read(self, kind, namespace, name):
        return self.objects.get((kind, name))


def _owned(uid: str, **data) -> dict:
    return {"metadata": {"ownerReferences": [{"uid": uid, "controller": True}]}, "data": data}


def test_the_accepted_spec_is_json_only_and_never_replaced_by_an_edited_live_one():
    """Issue 24 N7: a spec ConfigMap without job.json (an older operator's job.yaml, or a YAML alias bomb) is not
    the job's spec, even owned by the job: YAML is never parsed. N1: once a digest is recorded, a spec ConfigMap
    that is gone is not replaced by the live spec unless that is exactly the one accepted."""
    from hybridflow_operator import handlers

    raw = _raw("tiny-grpo.yaml")
    live = parse_job(raw)
    text = mf.spec_text(live)
    yaml_only = _Cluster(**{"ConfigMap:tiny-grpo-spec": _owned("1234-abcd", **{"job.yaml": yaml.safe_dump(raw)})})
    with pytest.raises(SpecError, match=r"does not hold the spec this job started with \(digest none \(no key job"):
        handlers._accepted_job(yaml_only, live, "1234-abcd", {}, {})
    gone = _Cluster()
    accepted = {"acceptedSpecDigest": mf.content_digest(text)}
    assert handlers._accepted_job(gone, live, "1234-abcd", accepted, {}) == (live, False)  # a create to retry
    edited = parse_job(_raw("tiny-grpo.yaml", kubernetes={"rayAuthSecret": "builder-token"}))
    with pytest.raises(SpecError, match="which held the spec this job was accepted with, is gone"):
        handlers._accepted_job(gone, edited, "1234-abcd", accepted, {})


def test_a_reward_copy_is_used_only_when_it_is_the_jobs_and_remade_only_from_the_accepted_file():
    from hybridflow_operator import handlers
    from hybridflow_operator.policy import Policy

    raw = _files_job(rewardConfigMap="my-reward")
    job = parse_job(raw)
    key, good = "word_problem_reward.py", "def compute_score(*a): return 1\n"
    status = {"rewardDigest": mf.content_digest(good)}
    marked = {"metadata": {"labels": {"hybridflow.io/for-jobs": "true"}}}

    def copy_in(world: _Cluster):
        return handlers._reward_to_copy(world, Policy.from_env(), job, raw["metadata"]["uid"], status, None)

    # there, and the job's: nothing to make
    assert copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned("1234-abcd", **{key: good})})) is None
    with pytest.raises(SpecError, match="word-problems-reward exists but was not made for this job"):
        copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned("someone-else", **{key: good})}))
    with pytest.raises(SpecError, match="word-problems-reward does not hold what this job was accepted with"):
        copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned("1234-abcd", **{key: "import os\n"})}))
    # the copy gone: made again from the same file
    assert copy_in(_Cluster(**{"ConfigMap:my-reward": {**marked, "data": {key: good}}})) == {key: good}
    with pytest.raises(SpecError, match="no longer holds the files accepted"):  # ... never from an edited one
        copy_in(_Cluster(**{"ConfigMap:my-reward": {**marked, "data": {key: "import os\n"}}}))


def _agent_job(tools="tools.py", env="game.py", **k8s) -> dict:
    """The word-problems job with an agent whose tools and environment are the user's files."""
    raw = _files_job(**k8s)
    raw["spec"]["rollout"]["agent"] = {k: v for k, v in (("toolsFile", tools), ("environmentFile", env)) if v}
    return raw


def test_tools_and_environment_files_are_keys_of_the_code_configmap_and_resolved_into_its_copy():
    """Issue 51 M5: kubernetes.rewardConfigMap holds every code file of the job; the spec the pods run names each
    inside the mount of the job's copy, the sandbox pods mount that copy (never the user's ConfigMap, never the data
    claim), and every key is copied."""
    from hybridflow_operator import environments as envs

    raw = _agent_job(dataPvc="prompts", rewardConfigMap="my-code")
    job = parse_job(raw)
    assert mf.code_keys(job) == {"word_problem_reward.py": "spec.models.reward.function.path",
                                 "tools.py": "spec.rollout.agent.toolsFile",
                                 "game.py": "spec.rollout.agent.environmentFile"}
    ran = mf.resolved_job(job)
    agent = ran.spec.rollout.agent
    assert (agent.tools_file, agent.environment_file) == (f"{mf.REWARD_MOUNT}/tools.py", f"{mf.REWARD_MOUNT}/game.py")
    assert ran.spec.models.reward.function.path == f"{mf.REWARD_MOUNT}/word_problem_reward.py"
    assert mf.resolved_job(ran) == ran  # idempotent
    assert mf.code_keys(ran) == mf.code_keys(job)
    pod = envs.environment_pod(job, "1234-abcd", 0)
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["reward"] == {"name": "reward", "configMap": {"name": "word-problems-reward"}}
    assert not [v for v in vols.values() if "persistentVolumeClaim" in v]  # the data claim: prompts only, head only
    files = {"word_problem_reward.py": "def compute_score(*a): return 1\n", "tools.py": "def add(a: int): ...\n",
             "game.py": "class Environment: ...\n"}
    cm = mf.reward_configmap(job, "1234-abcd", files)
    assert cm["data"] == files and cm["immutable"] is True
    assert mf.code_digests(files) == {k: mf.content_digest(v) for k, v in sorted(files.items())}
    assert mf.code_copy_problem(files) == ""
    big = {**files, "game.py": "x" * mf.MAX_CONFIGMAP_BYTES}
    assert "the job's code files (game.py, tools.py, word_problem_reward.py) are" in mf.code_copy_problem(big)
    # an agent job scored by its environment alone: the code ConfigMap holds its tools and environment, no reward
    raw = _agent_job(rewardConfigMap="my-code")
    raw["spec"]["models"]["reward"] = {"type": "scorer", "scorers": [{"name": "math"}]}
    job = parse_job(raw)
    assert set(mf.code_keys(job)) == {"tools.py", "game.py"} and mf.reward_key(job) == ""
    assert {v["name"] for v in envs.environment_pod(job, "1234-abcd", 0)["spec"]["volumes"]} >= {"reward"}


@pytest.mark.parametrize("change, field", [
    ({"tools": "tools.py"}, "spec.rollout.agent.toolsFile"),
    ({"tools": None, "env": "envs/game.py"}, "spec.rollout.agent.environmentFile"),
    ({"tools": None, "env": None, "reward": "/data/rewards/r.py"}, "spec.models.reward.function.path"),
])
def test_a_code_file_on_the_data_claim_is_refused_naming_the_field_and_the_way_out(change, field, tmp_path, capsys):
    """Issue 51 M5: the operator cannot read a claim, so code read from kubernetes.dataPvc could change under a
    running job: refused at validation (parse_job: the operator's acceptance and `hybridflow validate` alike), and by
    resolved_job for a spec edited past it; the message names the field and the ConfigMap key to use instead."""
    from hybridflow.cli import main

    raw = _agent_job(tools=change.get("tools"), env=change.get("env"), dataPvc="prompts")
    if change.get("reward"):
        raw["spec"]["rollout"]["agent"] = {"tools": ["calculator"]}
        raw["spec"]["models"]["reward"]["function"]["path"] = change["reward"]
    key = Path(change.get("reward") or change.get("env") or change["tools"]).name
    with pytest.raises(SpecError) as err:
        parse_job(raw)
    msg = str(err.value)
    assert f"{field}: '" in msg and "would be read from kubernetes.dataPvc" in msg, msg
    assert f"put the file in kubernetes.rewardConfigMap (the job's code ConfigMap) under the key '{key}'" in msg, msg
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(manifest)]) == 2
    assert "would be read from kubernetes.dataPvc" in capsys.readouterr().err
    # the same spec with the code ConfigMap: accepted, the file a key of it
    raw["spec"]["kubernetes"]["rewardConfigMap"] = "my-code"
    if change.get("reward"):
        raw["spec"]["models"]["reward"]["function"]["path"] = key
    elif change.get("env"):
        raw["spec"]["rollout"]["agent"]["environmentFile"] = key
    job = parse_job(raw)
    assert key in mf.code_keys(job)
    # resolved_job refuses it too (a spec changed after parsing, or an older operator's accepted one)
    job.spec.kubernetes.reward_config_map = None
    if change.get("reward"):
        job.spec.models.reward.function.path = change["reward"]
    with pytest.raises(SpecError, match="would be read from kubernetes.dataPvc"):
        mf.resolved_job(job)


def test_a_tools_file_with_the_code_configmap_must_be_one_of_its_keys():
    with pytest.raises(SpecError, match=r"spec.rollout.agent.toolsFile: with kubernetes.rewardConfigMap it is the "
                                        r"ConfigMap's key \(a file name such as tools.py\), got 'agents/tools.py'"):
        parse_job(_agent_job(tools="agents/tools.py", rewardConfigMap="my-code"))


def test_every_code_file_is_copied_and_checked_and_a_missing_key_is_named():
    """Issue 51 M5: the copy must hold every key status.codeDigests recorded, and nothing else; a key missing from
    the user's ConfigMap holds the job Pending naming it; a job accepted before codeDigests (status.rewardDigest
    only) keeps its copy."""
    from hybridflow_operator import handlers
    from hybridflow_operator.policy import Policy

    raw = _agent_job(rewardConfigMap="my-code")
    job, uid = parse_job(raw), raw["metadata"]["uid"]
    files = {"word_problem_reward.py": "def compute_score(*a): return 1\n", "tools.py": "def add(a: int): ...\n",
             "game.py": "class Environment: ...\n"}
    status = {"codeDigests": mf.code_digests(files)}
    marked = {"labels": {"hybridflow.io/for-jobs": "true"}}

    def copy_in(world: _Cluster, st=status):
        return handlers._reward_to_copy(world, Policy.from_env(), job, uid, st, None)

    assert copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned(uid, **files)})) is None
    for bad in ({**files, "tools.py": "import os\n"}, {k: v for k, v in files.items() if k != "game.py"},
                {**files, "extra.py": "x = 1\n"}):
        with pytest.raises(SpecError, match="word-problems-reward does not hold what this job was accepted with"):
            copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned(uid, **bad)}))
    assert copy_in(_Cluster(**{"ConfigMap:my-code": {"metadata": marked, "data": files}})) == files  # gone: remade
    with pytest.raises(SpecError, match=r"no longer holds the files accepted \(game.py sha256:"):
        copy_in(_Cluster(**{"ConfigMap:my-code": {"metadata": marked, "data": {**files, "game.py": "import os\n"}}}))
    # accepted by an operator that copied the reward file alone: its copy is still the job's
    reward = "word_problem_reward.py"
    legacy = {"rewardDigest": mf.content_digest(files[reward])}
    assert copy_in(_Cluster(**{"ConfigMap:word-problems-reward": _owned(uid, **{reward: files[reward]})}),
                   legacy) is None
    # a key missing from the user's ConfigMap: named, with the field that names it; nothing read to copy
    world = _Cluster(**{"ConfigMap:my-code": {"metadata": marked, "data": {reward: files[reward], "tools.py": "x"}}})
    why, found = handlers._missing_inputs(world, Policy.from_env(), job, "ml", {})
    assert why == ("spec.rollout.agent.environmentFile: ConfigMap 'my-code' has no key 'game.py' (its keys: "
                   "tools.py, word_problem_reward.py)") and found is None
    world = _Cluster(**{"ConfigMap:my-code": {"metadata": marked, "data": files}})
    assert handlers._missing_inputs(world, Policy.from_env(), job, "ml", {}) == ("", files)
    assert handlers._missing_inputs(world, Policy.from_env(), job, "ml", status) == ("", None)  # copied already


def _resting_job(**run_policy):
    return parse_job(_raw("tiny-grpo.yaml", runPolicy={"backoffLimit": 2, **run_policy}))


def _cond(ctype: str, value: str) -> dict:
    return {"type": ctype, "status": value, "reason": "r", "message": "m", "lastTransitionTime": iso(NOW)}


def test_a_job_rests_only_when_nothing_of_its_own_can_move_it():
    """Issue 24 N8: what a tick may skip. Suspended and finished jobs wait for a change (or their TTL); a job waiting
    for a missing input or refused by the API server looks again with a backoff, never past its deadline; every
    active phase counts each tick."""
    from hybridflow_operator.phases import Rest, resting

    done = iso(NOW - dt.timedelta(seconds=30))
    assert resting(_resting_job(suspend=True), {"phase": "Suspended"}, NOW) == Rest("suspended", None)
    assert resting(_resting_job(suspend=False), {"phase": "Suspended"}, NOW) is None  # being resumed
    assert resting(_resting_job(suspend=True), {"phase": "Suspending"}, NOW) is None  # pods still to delete
    assert resting(_resting_job(), {"phase": "Succeeded", "completionTime": done}, NOW) == Rest("finished", None)
    assert resting(_resting_job(ttlSecondsAfterFinished=100), {"phase": "Failed", "completionTime": done},
                   NOW) == Rest("ttl", 70.0)
    assert resting(_resting_job(ttlSecondsAfterFinished=10), {"phase": "Succeeded", "completionTime": done},
                   NOW) == Rest("ttl", 0.0)  # due: the next tick deletes it
    assert resting(None, {"phase": "Failed"}, NOW) == Rest("finished", None)  # an invalid spec: until it is edited
    waiting = {"phase": "Pending", "startTime": done, "conditions": [_cond("InputsReady", "False")]}
    assert resting(_resting_job(), waiting, NOW) == Rest("inputs", None, retry=True)
    assert resting(_resting_job(activeDeadlineSeconds=100), waiting, NOW) == Rest("inputs", 70.0, retry=True)
    refused = {"phase": "Pending", "startTime": done, "conditions": [_cond("CreateRefused", "True")]}
    assert resting(_resting_job(), refused, NOW) == Rest("refused", None, retry=True)
    for status in ({"phase": "Pending", "conditions": [_cond("InputsReady", "True"), _cond("CreateRefused", "False")]},
                   {"phase": ""}, {"phase": "Initializing"}, {"phase": "Running"}, {"phase": "Restarting"}):
        assert resting(_resting_job(), status, NOW) is None, status


def test_backoff_doubles_from_the_first_delay_up_to_the_most():
    from hybridflow_operator.phases import backoff

    assert [backoff(t, 5.0, 60.0) for t in range(6)] == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert backoff(10_000, 0.25, 60.0) == 60.0  # no overflow however long it waits


OWN_PODS = {"podSelector": {"matchLabels": {mf.LABEL_JOB: "tiny-grpo"}}}
OBJECT_STORE = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"protocol": "TCP", "port": 443}]}
TRACKER = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 5000}]}


def _egress(raw: dict, egress=None) -> list[dict]:
    job = parse_job(raw)
    (np,) = [o for o in mf.static_children(job, raw["metadata"]["uid"], TOKEN, ["monitoring"], egress)
             if o["kind"] == "NetworkPolicy"]
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(np, version, strict=True)
    return np["spec"]["egress"]


def test_job_egress_reaches_its_own_pods_dns_and_the_object_store_only_for_object_storage_jobs():
    """Issue 24 N4: a job's pods may connect to their own pods, the cluster's DNS, the object store when the job
    checkpoints to one, and the platform's extra rules; nothing else (not the API server, not other tenants, not
    the metadata service: an ipBlock around it gets it as `except`)."""
    from hybridflow_operator.policy import DEFAULT_DNS, Egress

    raw = _raw("tiny-grpo.yaml")
    assert _egress(raw) == [{"to": [OWN_PODS]}, DEFAULT_DNS]  # the operator's defaults, as the chart's values
    egress = Egress(object_store=OBJECT_STORE, extra=(TRACKER,))
    assert _egress(raw, egress) == [{"to": [OWN_PODS]}, DEFAULT_DNS, TRACKER]  # no object store: not its business
    trainer = {**raw["spec"]["trainer"], "checkpointDir": "s3://bucket/runs"}
    s3 = _raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointSecret": "team-s3"})
    confined = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16", "100.100.100.200/32"]}}],
                "ports": [{"protocol": "TCP", "port": 443}]}
    assert _egress(s3, egress) == [{"to": [OWN_PODS]}, DEFAULT_DNS, confined, TRACKER]
    assert _egress(s3) == [{"to": [OWN_PODS]}, DEFAULT_DNS], "no object store configured: none reachable"


def test_an_ipblock_containing_link_local_gets_it_as_except_and_one_inside_is_refused():
    from hybridflow_operator.policy import Egress, PolicyError, confine_peer, confine_rule

    for cidr, excepts, expected in [
        ("0.0.0.0/0", None, ["169.254.0.0/16", "100.100.100.200/32"]),
        ("::/0", None, ["fe80::/10", "fd00:ec2::254/128", "fd00:ec2::23/128"]),
        ("169.0.0.0/8", ["10.0.0.0/8"], ["10.0.0.0/8", "169.254.0.0/16"]),
        ("169.0.0.0/8", ["169.254.0.0/15"], ["169.254.0.0/15"]),  # a wider except holds it already
        ("0.0.0.0/0", ["169.254.169.254/32"], ["169.254.169.254/32", "169.254.0.0/16", "100.100.100.200/32"]),
        # issue 51 L1: the metadata addresses outside link-local (Alibaba's; AWS's IPv6 service and Pod Identity)
        ("100.64.0.0/10", None, ["100.100.100.200/32"]),
        ("0.0.0.0/0", ["100.100.0.0/16"], ["100.100.0.0/16", "169.254.0.0/16"]),
        ("fd00::/8", None, ["fd00:ec2::254/128", "fd00:ec2::23/128"]),
        ("fd00:ec2::200/120", ["fd00:ec2::254/127"], ["fd00:ec2::254/127"]),
        ("fc00::/7", ["fd00:ec2::/64"], ["fd00:ec2::/64"]),
    ]:
        block = {"cidr": cidr, **({"except": excepts} if excepts else {})}
        assert confine_peer({"ipBlock": block}, "x") == {"ipBlock": {"cidr": cidr, "except": expected}}, cidr
    for peer in ({"ipBlock": {"cidr": "10.0.0.0/8"}}, {"namespaceSelector": {}}, {"podSelector": {"matchLabels": {}}}):
        assert confine_peer(peer, "x") == peer
    for cidr in ("169.254.169.254/32", "169.254.0.0/16", "169.254.20.10", "fe80::1/128"):
        with pytest.raises(PolicyError, match=r"networkPolicy\.egressExtra\[0\]\.to\[1\]\.ipBlock\.cidr .*\(link-local"):
            Egress(extra=({"to": [{"podSelector": {}}, {"ipBlock": {"cidr": cidr}}]},)).rules(object_storage=False)
    for cidr in ("100.100.100.200/32", "fd00:ec2::254", "fd00:ec2::23/128"):
        with pytest.raises(PolicyError, match=r"to\[0\]\.ipBlock\.cidr .* \(a cloud metadata service's address\)"):
            Egress(extra=({"to": [{"ipBlock": {"cidr": cidr}}]},)).rules(object_storage=False)
    with pytest.raises(PolicyError, match=r"networkPolicy\.objectStore\.to\[0\]"):
        Egress(object_store={"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]}).rules(object_storage=True)
    with pytest.raises(PolicyError, match="allows every destination"):
        confine_rule({"ports": [{"port": 443}]}, "networkPolicy.egressExtra[0]")  # no `to`: anywhere
    with pytest.raises(PolicyError, match="not a CIDR"):
        confine_peer({"ipBlock": {"cidr": "metadata.google.internal"}}, "x")


def test_egress_and_the_namespace_label_come_from_the_operators_environment():
    """The chart passes its networkPolicy values as JSON (deployment.yaml); a value the chart should have refused
    stops the operator at start, naming the variable or the rule."""
    from hybridflow_operator.policy import DEFAULT_DNS, NAMESPACE_LABEL, Egress, Policy, PolicyError

    assert Egress.from_env({}) == Egress() and Egress().dns == DEFAULT_DNS
    env = {"HYBRIDFLOW_EGRESS_DNS": json.dumps({"to": [{"podSelector": {}}], "ports": [{"port": 5353}]}),
           "HYBRIDFLOW_EGRESS_OBJECT_STORE": json.dumps(OBJECT_STORE),
           "HYBRIDFLOW_EGRESS_EXTRA": json.dumps([TRACKER]), "HYBRIDFLOW_NAMESPACE_LABEL": NAMESPACE_LABEL}
    policy = Policy.from_env(env)
    assert policy.egress.rules(object_storage=True) == [
        {"to": [{"podSelector": {}}], "ports": [{"port": 5353}]},
        {**OBJECT_STORE, "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16",
                                                                           "100.100.100.200/32"]}}]}, TRACKER]
    assert policy.namespace_label == "hybridflow.io/jobs=enabled"
    assert policy.acts_in({"hybridflow.io/jobs": "enabled", "team": "a"})
    assert not policy.acts_in({"hybridflow.io/jobs": "yes"}) and not policy.acts_in(None)
    assert Policy.from_env({}).acts_in(None), "a namespaced install: every namespace it watches"
    for key, value, message in [
        ("HYBRIDFLOW_EGRESS_EXTRA", "[{to: []}]", "HYBRIDFLOW_EGRESS_EXTRA: not JSON"),
        ("HYBRIDFLOW_EGRESS_EXTRA", json.dumps(TRACKER), "HYBRIDFLOW_EGRESS_EXTRA: a JSON list"),
        ("HYBRIDFLOW_EGRESS_EXTRA", json.dumps([{"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]}]),
         "networkPolicy.egressExtra[0].to[0].ipBlock.cidr 169.254.169.254/32 is inside 169.254.0.0/16"),
        ("HYBRIDFLOW_NAMESPACE_LABEL", "hybridflow.io/jobs", "HYBRIDFLOW_NAMESPACE_LABEL: key=value"),
    ]:
        with pytest.raises(PolicyError, match=re.escape(message)):
            Policy.from_env({key: value})


# --- asynchronous RL: a rollout pool of its own (issue 26, item 7) -----------------------------------------------

ASYNC = parse_job(_raw("tiny-async-k8s.yaml"))
TRAINER_ROLES = ["actor", "reference"]  # the roles the job runs (JobSpec.roles) that are not placed elsewhere


def _pool_pod(pool: str, gen: int = 0, phase: str = "Running", ready: bool = True, deleting: bool = False) -> PodView:
    return PodView(f"tiny-async-k8s-{pool}-0-g{gen}", "worker", gen, phase, deleting, pool=pool, ready=ready)


def test_a_lost_rollout_pod_of_an_async_job_is_replaced_with_its_replica_rebuilt_and_no_checkpoint_resume():
    """The PodReplaced event says how the controller mends each pool: an async job's rollout pod gets its replica
    rebuilt while training goes on (trainer/replicas.py); its trainer pod, and any pod of a sync or one_step_off
    job, a rebuild of the worker groups from the last checkpoint."""
    head = PodView("tiny-async-k8s-head-g0", "head", 0, "Running", ready=True)
    for pool, mode, expected in [("rollout", "async", "rebuilds the rollout replica in it while training goes on"),
                                 ("trainer", "async", "rebuilds its worker groups from the last checkpoint"),
                                 ("rollout", "one_step_off", "rebuilds its worker groups from the last checkpoint")]:
        job = parse_job(_raw("tiny-async-k8s.yaml", rollout={"mode": mode}))
        other = "trainer" if pool == "rollout" else "rollout"
        plan = decide(job, None, {"phase": "Running", "restarts": 0},
                      [head, _pool_pod(other), _pool_pod(pool, phase="Failed")], NOW)
        assert plan.status["phase"] == "Running" and plan.delete_pods == [f"tiny-async-k8s-{pool}-0-g0"]
        (event,) = _events(plan, "PodReplaced")
        assert event.endswith(expected), (pool, mode, event)
    assert ASYNC.spec.replica_pool("rollout") and not ASYNC.spec.replica_pool("trainer")


def test_pool_status_lists_every_pool_with_the_roles_placed_on_it_and_its_ready_pods():
    """status.pools: spec.resourcePools' order, spec.placement's roles (the first pool takes the rest), pods counted
    by pool and Ready; a pod of a pool the spec does not have counts nowhere."""
    pods = [("rollout", False), ("trainer", True), ("rollout", True), ("gone", True)]
    assert pool_status(ASYNC.spec, pods) == [
        {"name": "trainer", "roles": TRAINER_ROLES, "pods": 1, "ready": 1},
        {"name": "rollout", "roles": ["rollout"], "pods": 2, "ready": 1}]
    assert pool_status(ASYNC.spec, []) == [
        {"name": "trainer", "roles": TRAINER_ROLES, "pods": 0, "ready": 0},
        {"name": "rollout", "roles": ["rollout"], "pods": 0, "ready": 0}]
    colocated = parse_job(_raw("tiny-grpo-k8s.yaml")).spec
    assert pool_status(colocated, [("default", True), ("default", True)]) == [
        {"name": "default", "roles": ["actor", "rollout", "reference"], "pods": 2, "ready": 2}]
    ppo = parse_job({"spec": {"algorithm": {"name": "ppo"}, "models": {"reference": False}}}).spec
    assert pool_status(ppo, [])[0]["roles"] == ["actor", "rollout", "critic"]  # only what the job runs


def test_the_status_write_shows_both_pools_of_the_current_generation_only():
    """The status the handler writes (decide's plan) carries status.pools: the head is no pool's, pods of an older
    generation or being deleted are not counted, and a gang restart shows the new generation's (none yet)."""
    head = PodView("tiny-async-k8s-head-g0", "head", 0, "Running", ready=True)
    starting = [head, _pool_pod("trainer"), _pool_pod("rollout", phase="Pending", ready=False)]
    plan = decide(ASYNC, None, {"phase": "Initializing", "restarts": 0}, starting, NOW)
    assert plan.status["pools"] == [{"name": "trainer", "roles": TRAINER_ROLES, "pods": 1, "ready": 1},
                                    {"name": "rollout", "roles": ["rollout"], "pods": 1, "ready": 0}]
    running = [head, _pool_pod("trainer"), _pool_pod("rollout"), _pool_pod("rollout", gen=1),
               _pool_pod("trainer", deleting=True)]
    plan = decide(ASYNC, None, {"phase": "Running", "restarts": 0}, running, NOW)
    assert [(p["name"], p["pods"], p["ready"]) for p in plan.status["pools"]] == [("trainer", 1, 1), ("rollout", 1, 1)]
    failed = [head, _pool_pod("trainer"), _pool_pod("rollout", phase="Failed", ready=False)]
    gang = ASYNC.model_copy(update={"spec": ASYNC.spec.model_copy(update={
        "run_policy": ASYNC.spec.run_policy.model_copy(update={"restart_policy": "gang"})})})
    plan = decide(gang, None, {"phase": "Running", "restarts": 0}, failed, NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1
    assert [(p["name"], p["pods"], p["ready"]) for p in plan.status["pools"]] == [("trainer", 0, 0), ("rollout", 0, 0)]
    assert "pools" not in decide(None, "spec.x: bad", {}, [], NOW).status, "no spec, no pools to show"


def test_pod_view_reads_the_pool_label_and_the_ready_condition():
    from hybridflow_operator.handlers import _pod_view

    pod = mf.worker_pod(ASYNC, "uid", ASYNC.spec.pool("rollout"), 0, 0)
    assert (view := _pod_view(pod)).pool == "rollout" and not view.ready  # created, no status yet
    pod["status"] = {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"},
                                                        {"type": "Ready", "status": "True"}]}
    assert _pod_view(pod).ready
    pod["status"]["conditions"][1]["status"] = "False"
    assert not _pod_view(pod).ready


def _selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) over labels, as the API does."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if not {"In": lambda: labels.get(key) in values, "NotIn": lambda: labels.get(key) not in values,
                "Exists": lambda: key in labels, "DoesNotExist": lambda: key not in labels}[op]():
            return False
    return True


def _peer_matches(peer: dict, policy_ns: str, pod: dict) -> bool:
    """A NetworkPolicyPeer against a pod {"ns", "ns_labels", "labels"}: podSelector alone means the policy's own
    namespace; an ipBlock never names a pod of the cluster here (the job's policy has none towards pods)."""
    if "ipBlock" in peer:
        return False
    in_ns = (_selects(peer["namespaceSelector"], pod["ns_labels"]) if "namespaceSelector" in peer
             else pod["ns"] == policy_ns)
    return in_ns and _selects(peer.get("podSelector") or {}, pod["labels"])


def _rules_admit(rules: list[dict], side: str, policy_ns: str, peer_pod: dict, port: int) -> bool:
    """Whether one of the rules admits peer_pod at `port` (peers or ports empty or absent: every one)."""
    return any((not r.get(side) or any(_peer_matches(p, policy_ns, peer_pod) for p in r[side])) and
               (not r.get("ports") or any(p.get("protocol", "TCP") == "TCP" and p.get("port") == port
                                          for p in r["ports"]))
               for r in rules)


def _np_allows(np: dict, src: dict, dst: dict, port: int) -> bool:
    """Whether the job's NetworkPolicy lets a TCP connection from pod src to pod dst's port through: egress where it
    selects src, ingress where it selects dst (a pod it does not select is not fenced by it)."""
    ns, spec = np["metadata"]["namespace"], np["spec"]

    def fenced(pod: dict, kind: str) -> bool:
        return pod["ns"] == ns and _selects(spec["podSelector"], pod["labels"]) and kind in spec["policyTypes"]

    out_ok = not fenced(src, "Egress") or _rules_admit(spec.get("egress", []), "to", ns, dst, port)
    in_ok = not fenced(dst, "Ingress") or _rules_admit(spec.get("ingress", []), "from", ns, src, port)
    return out_ok and in_ok


def test_the_network_policy_admits_the_weight_stream_between_the_pools_on_any_port_and_no_outsider():
    """The weight stream's gloo group listens on a kernel-picked port at the trainer's rank 0 pod IP, and every
    rollout rank connects to it (and back): the job's NetworkPolicy must let the trainer pool's pods and the rollout
    pool's pods reach each other on any port, and nothing outside the job reach either on such a port."""
    raw = _raw("tiny-async-k8s.yaml")
    objs = _all_manifests(raw)
    (np,) = [o for o in objs if o["kind"] == "NetworkPolicy"]

    def pod(labels: dict, ns: str = "ml") -> dict:
        return {"ns": ns, "ns_labels": {"kubernetes.io/metadata.name": ns}, "labels": labels}

    job_pods = {o["metadata"]["labels"].get(mf.LABEL_POOL, "head"): pod(o["metadata"]["labels"])
                for o in objs if o["kind"] == "Pod"}
    assert set(job_pods) == {"head", "trainer", "rollout"}
    trainer, rollout = job_pods["trainer"], job_pods["rollout"]
    stream_ports = [1024, 29500, 45678, 65535]  # any: the kernel picks it
    for port in stream_ports:
        assert _np_allows(np, trainer, rollout, port) and _np_allows(np, rollout, trainer, port), port
        assert _np_allows(np, job_pods["head"], rollout, port) and _np_allows(np, rollout, job_pods["head"], port)
    outsiders = {
        "a pod of the namespace": pod({"app": "x"}),
        "another job's pod": pod({**trainer["labels"], mf.LABEL_JOB: "other"}),
        "the job's labels in another namespace": pod(trainer["labels"], ns="evil"),
        "a scraper's namespace": pod({"app": "prometheus"}, ns="monitoring"),
        "the operator's namespace": pod({"app": "hybridflow-operator"}, ns="hybridflow-system"),
        "kube-dns": {"ns": "kube-system", "ns_labels": {"kubernetes.io/metadata.name": "kube-system"},
                     "labels": {"k8s-app": "kube-dns"}},
    }
    for what, outsider in outsiders.items():
        for target in (trainer, rollout):
            for port in stream_ports:
                assert not _np_allows(np, outsider, target, port), (what, port)
                assert not _np_allows(np, target, outsider, port), (what, port)  # nor does the stream leak out
    # the one door from outside: the metrics port, from the scrapers' namespaces only
    assert _np_allows(np, outsiders["a scraper's namespace"], job_pods["head"], 8000)
    assert not _np_allows(np, outsiders["a pod of the namespace"], job_pods["head"], 8000)


def gang3(head="Running", w1="Running", **w1_view) -> list[PodView]:
    """The head and two pool pods (tiny-grpo-k8s.yaml's gang), the second in phase `w1`."""
    return [PodView("h-g0", "head", 0, head), PodView("w0-g0", "worker", 0, "Running"),
            PodView("w1-g0", "worker", 0, w1, **w1_view)]


def _events(plan, reason: str) -> list[str]:
    return [m for _, r, m in plan.events if r == reason]


def test_a_failed_pool_pod_is_replaced_alone_while_the_head_and_the_other_pods_run():
    """restartPolicy failedPod (the default): the failed pod is deleted and made again under its name once gone;
    the head and the healthy pod are never touched, the phase stays Running, no gang generation is used."""
    three = gang3(w1="Failed", message="OOMKilled (exit 137)")
    plan = decide(REPLACING, None, {"phase": "Running", "restarts": 0}, three, NOW)
    st = plan.status
    assert st["phase"] == "Running" and st["restarts"] == 0 and plan.delete_pods == ["w1-g0"]
    assert st["podReplacements"] == 1 and st["replacing"] == ["w1-g0"] and plan.create_gang == 0
    (event,) = _events(plan, "PodReplaced")
    assert event.startswith("pod w1-g0 failed: OOMKilled (exit 137); replacing it alone: the head and 2 other pod(s) "
                            "keep running (h-g0, w0-g0)"), event
    assert st["lastReplacement"]["message"] == event
    # the old pod terminating, then gone: made again (the handler skips a name still taken), counted once
    for left in ([*three[:2], PodView("w1-g0", "worker", 0, "Failed", deleting=True)], three[:2]):
        plan = decide(REPLACING, None, st, left, NOW)
        assert plan.status["phase"] == "Running" and plan.create_gang == 0 and not plan.delete_pods
        assert plan.status["podReplacements"] == 1 and not _events(plan, "PodReplaced")
        st = plan.status
    plan = decide(REPLACING, None, st, [*three[:2], PodView("w1-g0", "worker", 0, "Running")], NOW)
    assert "replacing" not in plan.status and plan.create_gang is None and plan.status["phase"] == "Running"


def test_past_the_replacement_limit_or_when_the_head_fails_the_gang_restarts():
    st = {"phase": "Running", "restarts": 0, "podReplacements": 2}  # replacementLimit 2 used up
    plan = decide(REPLACING, None, st, gang3(w1="Failed"), NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1 and "replacing" not in plan.status
    plan = decide(REPLACING, None, {"phase": "Running", "restarts": 0}, gang3(head="Failed"), NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1, "the head holds the controller"
    plan = decide(JOB, None, {"phase": "Running", "restarts": 0}, pods(worker="Failed"), NOW)
    assert plan.status["phase"] == "Restarting", "restartPolicy gang: every failure restarts the gang"


def test_a_pool_pod_that_disappeared_is_made_again_and_an_evicted_one_is_not_counted():
    plan = decide(REPLACING, None, {"phase": "Running", "restarts": 0}, gang3()[:2], NOW)
    assert plan.status["phase"] == "Running" and plan.create_gang == 0 and plan.status["podReplacements"] == 1
    assert _events(plan, "PodReplaced")[0].startswith("1 pool pod(s) disappeared; replacing it alone")
    evicted = gang3(w1="Failed", disruption="EvictionByEvictionAPI")
    plan = decide(REPLACING, None, {"phase": "Running", "restarts": 0}, evicted, NOW)
    assert plan.status["phase"] == "Running" and plan.delete_pods == ["w1-g0"]
    assert plan.status["podReplacements"] == 0 and "not counted" in _events(plan, "PodReplaced")[0]


def test_a_job_that_completes_no_step_within_its_progress_deadline_is_stalled_and_its_gang_restarts():
    quiet = {"phase": "Running", "restarts": 0, "step": 7, "lastProgressTime": iso(NOW - dt.timedelta(seconds=1000))}
    plan = decide(REPLACING, None, quiet, gang3(), NOW)  # the default deadline's floor is 900 s
    assert plan.status["phase"] == "Restarting" and plan.status["reason"] == "Stalled"
    assert plan.status["restarts"] == 1 and sorted(plan.delete_pods) == ["h-g0", "w0-g0", "w1-g0"]
    assert "no step completed for 1000s after step 7 (progress deadline 900s" in plan.status["message"]
    assert _events(plan, "Stalled")
    slow = {**quiet, "slowestStepSeconds": 120.0}  # ten times the slowest step: 1200 s
    assert decide(REPLACING, None, slow, gang3(), NOW).status["phase"] == "Running"
    own = parse_job(_raw("tiny-grpo-k8s.yaml", runPolicy={"progressDeadlineSeconds": 60}))
    plan = decide(own, None, {**slow, "lastProgressTime": iso(NOW - dt.timedelta(seconds=61))}, gang3(), NOW)
    assert plan.status["reason"] == "Stalled" and "runPolicy.progressDeadlineSeconds" in plan.status["message"]
    # the clock starts when the job starts Running, and moves with every step the operator polls
    started = decide(REPLACING, None, {"phase": "Initializing", "restarts": 0}, gang3(), NOW).status
    assert started["phase"] == "Running" and started["lastProgressTime"] == iso(NOW)
    st = {"step": 7, "lastProgressTime": "then", "slowestStepSeconds": 30.0}
    merge_progress(st, {"step": 7, "lastStepSeconds": 12.5}, "/ck", "now")
    assert st["lastProgressTime"] == "then" and st["slowestStepSeconds"] == 30.0
    merge_progress(st, {"step": 8, "lastStepSeconds": 42.0, "recoveries": 1, "lastRecoverySeconds": 31.5}, "/ck", "now")
    assert st["lastProgressTime"] == "now" and st["slowestStepSeconds"] == 42.0 and st["recoveries"] == 1


def test_a_taken_pod_name_is_a_condition_naming_the_pod_and_the_job_rests_until_it_tries_again():
    """Issue 51 L4 (phases.names_taken): the job stays Pending with CreateRefused (PodNameTaken) naming the pods, one
    event per new message, and rests with a backoff as for any refused create."""
    from hybridflow_operator.phases import names_taken, resting

    status = {"phase": "Pending", "restarts": 0, "startTime": iso(NOW)}
    plan = names_taken(status, "ml", ["j-head-g0"], NOW)
    (cond,) = plan.status["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("CreateRefused", "True", "PodNameTaken")
    assert cond["message"] == ("pod ml/j-head-g0 exists but was not made for this job (another owner, other labels), "
                               "so the job's pod of that name cannot be created; delete it, or give the job another "
                               "name")
    assert plan.events == [("Warning", "PodNameTaken", cond["message"])] and plan.status["phase"] == "Pending"
    assert plan.create_gang is None and not plan.delete_pods
    again = names_taken(plan.status, "ml", ["j-head-g0"], NOW)
    assert again.events == [] and again.status == plan.status  # said once
    job = parse_job(_raw("tiny-grpo.yaml"))
    assert resting(job, plan.status, NOW).why == "refused"
    two = names_taken(status, "ml", ["j-head-g0", "j-default-0-g0"], NOW).status["conditions"][0]["message"]
    assert two.startswith("pods ml/j-head-g0, ml/j-default-0-g0 exist but were not made for this job")


# --- placement: auto on Kubernetes: the plan pod and status.plan (issue 52, item 2) -------------------------------

def _auto_raw(**spec_changes) -> dict:
    raw = _raw("tiny-async-k8s.yaml", **spec_changes)
    raw["spec"]["placement"] = "auto"
    return raw


def _a_plan() -> dict:
    """A record as a plan pod prints it (hybridflow.api.plan): pools of the planner's own, not the user's."""
    from hybridflow.api.plan import plan_fields

    raw = _raw("tiny-async-k8s.yaml")
    raw["spec"]["resourcePools"] = [{"name": "learner", "nodes": 1, "devicesPerNode": 1},
                                    {"name": "gen", "nodes": 1, "devicesPerNode": 1}]
    raw["spec"]["placement"] = {"actor": "learner", "reference": "learner", "rollout": "gen"}
    raw["spec"]["training"]["microBatchSize"] = 8
    summary = {"placement": "hybrid (actor+reference:1, rollout:1)", "pools": {"learner": 1, "gen": 1},
               "mode": "async", "layout": "fsdp t_g=1 mb=8", "devices": 2, "accelerator": "cpu",
               "predictedStepSeconds": 0.5, "candidates": 18}
    return {"summary": summary, "fields": plan_fields(parse_job(raw))}


def _plan_view(phase: str, output: str = "", message: str = "", deleting: bool = False) -> PodView:
    return PodView("tiny-async-k8s-plan", "plan", 0, phase, deleting, message=message, output=output)


@pytest.mark.parametrize("version", [K8S_VERSIONS[0], K8S_VERSIONS[-1]])
def test_the_plan_pod_is_small_holds_no_credential_and_reads_the_spec_and_models_only(version):
    from hybridflow_operator.plan_pod import TERMINATION_LOG, plan_pod

    for raw in (_auto_raw(), _auto_raw(kubernetes={**_raw("tiny-async-k8s.yaml")["spec"]["kubernetes"],
                                                    "modelPvc": "models", "checkpointSecret": "team-s3"},
                                       models={"actor": {"source": "path", "path": "qwen/0.5b"}})):
        pod = plan_pod(parse_job(raw), "1234-abcd")
        kubernetes_validate.validate(pod, version, strict=True)
        spec, (c,) = pod["spec"], pod["spec"]["containers"]
        assert pod["metadata"]["name"] == "tiny-async-k8s-plan"
        labels = pod["metadata"]["labels"]
        assert labels[mf.LABEL_ROLE] == "plan" and mf.LABEL_GENERATION not in labels
        assert c["command"] == ["hybridflow", "plan", "/etc/hybridflow/job.json", "--auto", "--write-plan",
                                TERMINATION_LOG] and c["terminationMessagePath"] == TERMINATION_LOG
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"  # a failure's message: its log's tail
        assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in spec and "initContainers" not in spec
        assert not [e for e in c["env"] if "valueFrom" in e], "no credential: no Ray token, no storage key"
        assert spec["securityContext"] == mf.POD_SECURITY and c["securityContext"] == mf.CONTAINER_SECURITY
        assert c["resources"]["limits"]["memory"] == "1Gi" and "nvidia.com/gpu" not in c["resources"]["limits"]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["spec"]["configMap"]["name"] == "tiny-async-k8s-spec"
        assert set(vols) <= {"spec", "scratch", "models"}
    assert vols["models"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert {"name": "models", "mountPath": "/models/qwen/0.5b", "readOnly": True, "subPath": "qwen/0.5b"} in \
        c["volumeMounts"]
    assert mf.foreign_references([pod], parse_job(raw)) == []


def test_an_auto_job_gets_its_plan_pod_where_its_gang_would_start_and_nothing_of_the_gang():
    from hybridflow_operator.plan_pod import plan_step

    job = parse_job(_auto_raw())
    first = decide(job, None, {}, [], NOW)
    assert first.create_gang == 0 and first.create_static  # what a job that places its roles itself gets
    plan = plan_step(first, job, None, NOW)
    assert plan.create_plan_pod and plan.create_gang is None and plan.create_static  # its ConfigMap: the pod reads it
    assert (plan.status["phase"], plan.status["reason"]) == ("Pending", "Planning")
    assert [r for _, r, _ in plan.events] == ["Planning"]  # not "creating the head, pool pods ..."
    cond = next(c for c in plan.status["conditions"] if c["type"] == "Planned")
    assert (cond["status"], cond["reason"]) == ("False", "Planning") and "tiny-async-k8s-plan" in cond["message"]
    # while it runs: nothing more, no second plan pod, no event
    running = plan_step(decide(job, None, plan.status, [], NOW), job, _plan_view("Running"), NOW)
    assert not running.create_plan_pod and running.create_gang is None and not running.events
    assert running.status == plan.status
    # inputs missing: neither gang nor plan pod (admit_gang held the gang first)
    from hybridflow_operator.phases import admit_gang
    held = plan_step(admit_gang(decide(job, None, {}, [], NOW), {}, [], NOW, "PVC x not found"), job, None, NOW)
    assert not held.create_plan_pod and held.status["reason"] == "InputsMissing"
    # a Kueue job whose Workload is yet to be made: its plan pod first (the Workload is made from the plan)
    from hybridflow_operator.phases import Queue
    queued = plan_step(decide(job, None, {}, [], NOW, queue=Queue("q", None)), job, None, NOW, unqueued=True)
    assert queued.create_plan_pod and queued.status["phase"] == "Queued"


def test_a_plan_that_succeeded_is_recorded_then_the_gang_is_the_plans_with_the_plan_in_its_env():
    from hybridflow.api.plan import PLAN_ENV
    from hybridflow_operator.plan_pod import plan_step, with_plan, with_plan_env

    job, record = parse_job(_auto_raw()), _a_plan()
    st = plan_step(decide(job, None, {}, [], NOW), job, None, NOW).status
    done = plan_step(decide(job, None, st, [], NOW), job, _plan_view("Succeeded", json.dumps(record)), NOW)
    assert done.status["plan"] == record and done.delete_pods == ["tiny-async-k8s-plan"]
    assert done.create_gang is None  # built from the plan at the next tick
    assert (done.status["reason"], _events(done, "Planned")[0]) == ("Planned", done.status["message"])
    assert "hybrid (actor+reference:1, rollout:1), fsdp t_g=1 mb=8, mode async; pools learner 1, gen 1" in \
        done.status["message"]
    planned = with_plan(job, done.status)
    assert [p.name for p in planned.spec.resource_pools] == ["learner", "gen"] and planned.spec.pool("rollout").name \
        == "gen" and planned.spec.training.micro_batch_size == 8
    assert with_plan(job, {}) is job and with_plan(ASYNC, done.status) is ASYNC  # no plan; a job that places itself
    nxt = decide(planned, None, done.status, [], NOW)
    nxt = plan_step(nxt, planned, _plan_view("Succeeded", json.dumps(record), deleting=True), NOW)
    assert nxt.create_gang == 0 and not nxt.create_plan_pod and nxt.status["plan"] == record
    pods = with_plan_env(mf.gang_pods(planned, "1234-abcd", 0), nxt.status.get("plan"))
    assert [p["metadata"]["name"] for p in pods] == ["tiny-async-k8s-head-g0", "tiny-async-k8s-learner-0-g0",
                                                     "tiny-async-k8s-gen-0-g0"]
    for p in pods:
        (env,) = [e["value"] for e in p["spec"]["containers"][0]["env"] if e["name"] == PLAN_ENV]
        assert json.loads(env) == record
    # kept across gang restarts (status is carried over), and a plan pod still there then goes
    restart = decide(planned, None, {**done.status, "phase": "Restarting", "restarts": 1}, [], NOW)
    restart = plan_step(restart, planned, _plan_view("Succeeded", json.dumps(record)), NOW)
    assert restart.status["plan"] == record and restart.create_gang == 1 and "tiny-async-k8s-plan" in \
        restart.delete_pods


@pytest.mark.parametrize("view,why", [
    (_plan_view("Failed", message="container plan exited with code 2 (Error): /etc/hybridflow/job.json: "
                "spec.placement: auto: no placement of this job's models fits its 2 x cpu (spec.resourcePools"),
     "failed: container plan exited with code 2 (Error): /etc/hybridflow/job.json: spec.placement: auto: no "
     "placement of this job's models fits its 2 x cpu (spec.resourcePools"),
    (_plan_view("Succeeded", output="placement auto: ..."), "gave no plan this job can run: pod tiny-async-k8s-plan's "
     "termination message: not a plan (JSON expected)"),
    (_plan_view("Succeeded", output=json.dumps({"summary": {}, "fields": {"placement": {}}})),
     "gave no plan this job can run: pod tiny-async-k8s-plan's plan: a plan names spec.resourcePools"),
    (_plan_view("Succeeded", output='{"summary": {"predictedStepSeconds": NaN}, "fields": {}}'),
     "gave no plan this job can run: Out of range float values are not JSON compliant"),
])
def test_a_plan_pod_that_fails_or_prints_no_plan_fails_the_job_saying_why(view, why):
    from hybridflow_operator.plan_pod import plan_step

    job = parse_job(_auto_raw())
    st = plan_step(decide(job, None, {}, [], NOW), job, None, NOW).status
    plan = plan_step(decide(job, None, st, [], NOW), job, view, NOW)
    assert (plan.status["phase"], plan.status["reason"]) == ("Failed", "PlanFailed")
    assert why in plan.status["message"] and "plan" not in plan.status, plan.status["message"]
    assert plan.delete_pods == [] and plan.create_gang is None  # the failed pod stays for its logs
    later = plan_step(decide(job, None, plan.status, [], NOW), job, view, NOW)
    assert later.status == plan.status and later.delete_pods == ([] if view.phase == "Failed" else [view.name])


def test_a_queued_jobs_plan_with_more_pools_than_a_workload_holds_fails_as_at_acceptance():
    """A plan is judged as the spec was at acceptance: a job queued through Kueue whose plan makes more podSets
    than a Workload holds (the head, the sandbox pool and one per pool) fails PlanFailed naming the limit, instead
    of failing later when its Workload is made."""
    from hybridflow.api.plan import plan_fields
    from hybridflow_operator.plan_pod import plan_step

    raw = _auto_raw()
    raw["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    job = parse_job(raw)
    wide = _raw("tiny-async-k8s.yaml")
    wide["spec"]["resourcePools"] = [{"name": f"p{i}", "devicesPerNode": 1} for i in range(8)]
    wide["spec"]["placement"] = {"actor": "p0", "reference": "p1", "rollout": "p2"}
    record = {"summary": {}, "fields": plan_fields(parse_job(wide))}
    st = plan_step(decide(job, None, {}, [], NOW), job, None, NOW, unqueued=True).status
    plan = plan_step(decide(job, None, st, [], NOW), job, _plan_view("Succeeded", output=json.dumps(record)), NOW)
    assert (plan.status["phase"], plan.status["reason"]) == ("Failed", "PlanFailed"), plan.status
    assert "Kueue podSets" in plan.status["message"] and "plan" not in plan.status


def test_the_plan_pod_view_carries_a_succeeded_containers_termination_message():
    from hybridflow_operator.handlers import _pod_view

    pod = {"metadata": {"name": "j-plan", "labels": {mf.LABEL_ROLE: "plan"}},
           "status": {"phase": "Succeeded", "containerStatuses": [{"name": "plan", "state": {"terminated": {
               "exitCode": 0, "reason": "Completed", "message": '{"summary": {}}'}}}]}}
    view = _pod_view(pod)
    assert (view.role, view.phase, view.output, view.message, view.exit_code) == \
        ("plan", "Succeeded", '{"summary": {}}', "", None)


def test_the_spec_configmap_keeps_the_accepted_auto_spec_when_the_job_is_built_from_its_plan():
    from hybridflow_operator.plan_pod import with_plan

    job = parse_job(_auto_raw())
    planned = with_plan(job, {"plan": _a_plan()})
    (cm,) = [o for o in mf.static_children(planned, "u", TOKEN, [], accepted=job) if o["kind"] == "ConfigMap"]
    assert cm["data"][mf.SPEC_KEY] == mf.spec_text(job) and json.loads(mf.spec_text(job))["spec"]["placement"] == "auto"
