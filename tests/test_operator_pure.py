"""The operator's pure functions: manifests (validated with the official schemas) and the phase machine."""
import datetime as dt
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from hybridflow.spec import parse_job, pool_resource
from hybridflow_operator import manifests as mf
from hybridflow_operator.phases import PodView, decide, iso, set_condition
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
    return mf.static_children(raw, job) + mf.gang_pods(raw, job, generation=0)


@pytest.mark.parametrize("example", ["tiny-grpo.yaml", "gpu-grpo-7b.yaml", "tiny-ppo.yaml"])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_strictly(example, version):
    for obj in _all_manifests(_raw(example)):
        if obj["kind"] == "PodGroup":  # a Volcano CRD: not in the official schemas; checked below
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_unknown_fields():
    pod = _all_manifests(_raw("tiny-grpo.yaml"))[2]
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
    resolved = yaml.safe_load(cm["data"]["job.yaml"])
    assert resolved["spec"]["trainer"]["checkpointDir"] == mf.CHECKPOINT_MOUNT
    assert resolved["spec"]["metrics"]["address"] == "0.0.0.0"
    assert parse_job(resolved).spec == mf.resolved_job(job).spec
    head = next(p for p in pods if p["metadata"]["labels"][mf.LABEL_ROLE] == "head")
    assert "hybridflow driver /etc/hybridflow/job.yaml" in head["spec"]["containers"][0]["command"][-1]
    assert not any("nvidia.com/gpu" in str(c.get("resources")) for c in head["spec"]["containers"])


def test_ray_auth_from_a_user_secret_only():
    job_raw = _raw("tiny-grpo.yaml")
    env = {e["name"]: e for e in _all_manifests(job_raw)[2]["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "disabled" and "RAY_AUTH_TOKEN" not in env
    job_raw["spec"]["kubernetes"] = {"rayAuthSecret": "ray-token"}
    env = {e["name"]: e for e in _all_manifests(job_raw)[2]["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "ray-token", "key": "token"}


def test_generations_never_collide():
    raw = _raw("tiny-grpo.yaml")
    job = parse_job(raw)
    g0 = {p["metadata"]["name"] for p in mf.gang_pods(raw, job, 0)}
    g1 = {p["metadata"]["name"] for p in mf.gang_pods(raw, job, 1)}
    assert not g0 & g1


# --- the phase machine -------------------------------------------------------------------------------------------

JOB = parse_job(_raw("tiny-grpo.yaml", runPolicy={"backoffLimit": 1}))


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
    assert vols["reward"]["configMap"] == {"name": "my-reward"}
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
    ran = parse_job(yaml.safe_load(cm["data"]["job.yaml"]))
    assert ran.spec.data.train == ["/data/word_problems/train.jsonl", "/data/more/*.jsonl"]
    assert ran.spec.models.reward.function.path == "/var/lib/hybridflow/reward/word_problem_reward.py"
    assert mf.resolved_job(ran) == ran


@pytest.mark.parametrize("change,message", [
    ({"data": {"source": "files", "train": ["/etc/passwd"], "promptKey": "q"}},
     r"spec.data.train\[0\]: with kubernetes.dataPvc, give a path inside the volume"),
    ({"data": {"source": "files", "train": ["../x.jsonl"]}}, r"spec.data.train\[0\]: .*no '..'"),
])
def test_data_paths_must_stay_inside_the_volume(change, message):
    from hybridflow.spec import SpecError

    raw = _files_job(dataPvc="prompts")
    raw["spec"]["data"].update(change["data"])
    with pytest.raises(SpecError, match=message):
        parse_job(raw)


def test_reward_configmap_needs_a_function_named_by_its_key():
    from hybridflow.spec import SpecError

    raw = _files_job(rewardConfigMap="my-reward")
    raw["spec"]["models"]["reward"]["function"]["path"] = "rewards/word_problem_reward.py"
    with pytest.raises(SpecError, match=r"function.path: with kubernetes.rewardConfigMap it is the ConfigMap's key"):
        parse_job(raw)
    raw["spec"]["models"]["reward"] = {"type": "scorer", "scorers": [{"name": "math"}]}
    with pytest.raises(SpecError, match=r"rewardConfigMap: holds a reward file, so spec.models.reward.type must be"):
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
    from hybridflow_operator.handlers import _pod_view, last_error

    tail = ("2026-11-30 ray started\nsome progress\nerror: /etc/hybridflow/job.yaml: cannot run here\n"
            "  spec.data.train: 'x.jsonl' does not exist\n")
    assert last_error(tail) == "/etc/hybridflow/job.yaml: cannot run here spec.data.train: 'x.jsonl' does not exist"
    assert last_error("just a line\nKilled\n") == "Killed"
    pod = {"metadata": {"name": "j-head-g0", "labels": {mf.LABEL_ROLE: "head"}},
           "status": {"phase": "Failed", "containerStatuses": [{"name": "controller", "state": {"terminated": {
               "exitCode": 2, "reason": "Error", "message": tail}}}]}}
    view = _pod_view(pod)
    assert view.exit_code == 2 and view.message.endswith("spec.data.train: 'x.jsonl' does not exist")
