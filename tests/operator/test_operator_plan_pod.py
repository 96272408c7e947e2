"""`placement: auto`: the plan pod, its plan recorded, and the gang built from it."""
import json

import kubernetes_validate
import pytest

from hybridflow.api import parse_job
from hybridflow_operator import manifests as mf
from hybridflow_operator.phases import PodView, transition
from support.operator_views import plan_record, K8S_VERSIONS, NOW, _raw, TOKEN, ASYNC, _events


def _auto_raw(**spec_changes) -> dict:
    raw = _raw("tiny-async-k8s.yaml", **spec_changes)
    raw["spec"]["placement"] = "auto"
    return raw


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
    first = transition(job, None, {}, [], NOW)
    assert first.create_gang == 0 and first.create_static  # what a job that places its roles itself gets
    plan = plan_step(first, job, None, NOW)
    assert plan.create_plan_pod and plan.create_gang is None and plan.create_static  # its ConfigMap: the pod reads it
    assert (plan.status["phase"], plan.status["reason"]) == ("Pending", "Planning")
    assert [r for _, r, _ in plan.events] == ["Planning"]  # not "creating the head, pool pods ..."
    cond = next(c for c in plan.status["conditions"] if c["type"] == "Planned")
    assert (cond["status"], cond["reason"]) == ("False", "Planning") and "tiny-async-k8s-plan" in cond["message"]
    # while it runs: nothing more, no second plan pod, no event
    running = plan_step(transition(job, None, plan.status, [], NOW), job, _plan_view("Running"), NOW)
    assert not running.create_plan_pod and running.create_gang is None and not running.events
    assert running.status == plan.status
    # inputs missing: neither gang nor plan pod (admit_gang held the gang first)
    from hybridflow_operator.phases import admit_gang
    held = plan_step(admit_gang(transition(job, None, {}, [], NOW), {}, [], NOW, "PVC x not found"), job, None, NOW)
    assert not held.create_plan_pod and held.status["reason"] == "InputsMissing"
    # a Kueue job whose Workload is yet to be made: its plan pod first (the Workload is made from the plan)
    from hybridflow_operator.phases import Queue
    queued = plan_step(transition(job, None, {}, [], NOW, queue=Queue("q", None)), job, None, NOW, unqueued=True)
    assert queued.create_plan_pod and queued.status["phase"] == "Queued"


def test_a_plan_that_succeeded_is_recorded_then_the_gang_is_the_plans_with_the_plan_in_its_env():
    from hybridflow.api.plan import PLAN_ENV
    from hybridflow_operator.plan_pod import plan_step, with_plan, with_plan_env

    job, record = parse_job(_auto_raw()), plan_record(micro_batch=8, predictedStepSeconds=0.5, candidates=18)
    st = plan_step(transition(job, None, {}, [], NOW), job, None, NOW).status
    done = plan_step(transition(job, None, st, [], NOW), job, _plan_view("Succeeded", json.dumps(record)), NOW)
    assert done.status["plan"] == record and done.delete_pods == ["tiny-async-k8s-plan"]
    assert done.create_gang is None  # built from the plan at the next tick
    assert (done.status["reason"], _events(done, "Planned")[0]) == ("Planned", done.status["message"])
    assert "hybrid (actor+reference:1, rollout:1), fsdp t_g=1 mb=8, mode async; pools learner 1, gen 1" in \
        done.status["message"]
    planned = with_plan(job, done.status)
    assert [p.name for p in planned.spec.resource_pools] == ["learner", "gen"] and planned.spec.pool("rollout").name \
        == "gen" and planned.spec.training.micro_batch_size == 8
    assert with_plan(job, {}) is job and with_plan(ASYNC, done.status) is ASYNC  # no plan; a job that places itself
    nxt = transition(planned, None, done.status, [], NOW)
    nxt = plan_step(nxt, planned, _plan_view("Succeeded", json.dumps(record), deleting=True), NOW)
    assert nxt.create_gang == 0 and not nxt.create_plan_pod and nxt.status["plan"] == record
    pods = with_plan_env(mf.gang_pods(planned, "1234-abcd", 0), nxt.status.get("plan"))
    assert [p["metadata"]["name"] for p in pods] == ["tiny-async-k8s-head-g0", "tiny-async-k8s-learner-0-g0",
                                                     "tiny-async-k8s-gen-0-g0"]
    for p in pods:
        (env,) = [e["value"] for e in p["spec"]["containers"][0]["env"] if e["name"] == PLAN_ENV]
        assert json.loads(env) == record
    # kept across gang restarts (status is carried over), and a plan pod still there then goes
    restart = transition(planned, None, {**done.status, "phase": "Restarting", "restarts": 1}, [], NOW)
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
    st = plan_step(transition(job, None, {}, [], NOW), job, None, NOW).status
    plan = plan_step(transition(job, None, st, [], NOW), job, view, NOW)
    assert (plan.status["phase"], plan.status["reason"]) == ("Failed", "PlanFailed")
    assert why in plan.status["message"] and "plan" not in plan.status, plan.status["message"]
    assert plan.delete_pods == [] and plan.create_gang is None  # the failed pod stays for its logs
    later = plan_step(transition(job, None, plan.status, [], NOW), job, view, NOW)
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
    st = plan_step(transition(job, None, {}, [], NOW), job, None, NOW, unqueued=True).status
    plan = plan_step(transition(job, None, st, [], NOW), job, _plan_view("Succeeded", output=json.dumps(record)), NOW)
    assert (plan.status["phase"], plan.status["reason"]) == ("Failed", "PlanFailed"), plan.status
    assert "Kueue podSets" in plan.status["message"] and "plan" not in plan.status


def test_the_plan_pod_view_carries_a_succeeded_containers_termination_message():
    from hybridflow_operator.watch import pod_view

    pod = {"metadata": {"name": "j-plan", "labels": {mf.LABEL_ROLE: "plan"}},
           "status": {"phase": "Succeeded", "containerStatuses": [{"name": "plan", "state": {"terminated": {
               "exitCode": 0, "reason": "Completed", "message": '{"summary": {}}'}}}]}}
    view = pod_view(pod)
    assert (view.role, view.phase, view.output, view.message, view.exit_code) == \
        ("plan", "Succeeded", '{"summary": {}}', "", None)


def test_the_spec_configmap_keeps_the_accepted_auto_spec_when_the_job_is_built_from_its_plan():
    from hybridflow_operator.plan_pod import with_plan

    job = parse_job(_auto_raw())
    planned = with_plan(job, {"plan": plan_record(micro_batch=8, predictedStepSeconds=0.5, candidates=18)})
    (cm,) = [o for o in mf.static_children(planned, "u", TOKEN, [], accepted=job) if o["kind"] == "ConfigMap"]
    assert cm["data"][mf.SPEC_KEY] == mf.spec_text(job) and json.loads(mf.spec_text(job))["spec"]["placement"] == "auto"
