"""The phase machine, pure: starts, restarts, replacements, suspends, rests and the conditions and events that say
why (phases.transition, the state machine alone), and a whole tick's plan (phases.decide: the transition and the
steps every tick's plan also carries)."""
import datetime as dt
from dataclasses import replace

import pytest

from hybridflow.api import parse_job
from hybridflow.api.status import pool_status
from hybridflow_operator import manifests as mf
from hybridflow_operator.phases import (
    STUCK_TERMINATING_SECONDS, Inputs, Observed, PodView, decide, iso, set_condition, transition,
)
from hybridflow_operator.progress import merge_progress, parse_progress
from support.operator_views import NOW, _raw, pods, _files_job, ASYNC, _events


JOB = parse_job(_raw("tiny-grpo.yaml", runPolicy={"backoffLimit": 1, "restartPolicy": "gang"}))

# The default restart policy: a failed pool pod is replaced alone (restartPolicy failedPod). Two pool pods.
REPLACING = parse_job(_raw("tiny-grpo-k8s.yaml", runPolicy={"backoffLimit": 1, "replacementLimit": 2}))


def test_a_tick_that_creates_pods_decides_twice_the_second_time_with_their_inputs():
    """decide(job, Observed): a plan that would create the gang before its inputs were looked up comes back half
    done (needs_inputs: no digest recorded yet); with the inputs, whole (the spec's digest recorded before its
    ConfigMap is made, the code files' digests and copy); with an input missing, no pod is created; a tick that
    creates nothing is whole at once."""
    seen = Observed(status={}, now=NOW)
    first = decide(JOB, seen)
    assert first.needs_inputs and "acceptedSpecDigest" not in first.status
    whole = decide(JOB, replace(seen, inputs=Inputs("", {"reward.py": "def score(s): return 1.0\n"})))
    assert not whole.needs_inputs and whole.create_gang == 0 and whole.status["phase"] == "Pending"
    assert whole.status["acceptedSpecDigest"] and whole.status["codeDigests"] and whole.copy_code
    waiting = decide(JOB, replace(seen, inputs=Inputs("persistentvolumeclaim/data is not there")))
    assert not waiting.needs_inputs and waiting.create_gang is None
    running = decide(JOB, Observed(status={**whole.status, "phase": "Running"}, now=NOW, pods=pods()))
    assert not running.needs_inputs and running.create_gang is None and running.status["phase"] == "Running"


def test_a_job_breaking_the_job_policy_fails_instead_of_starting():
    plan = decide(JOB, Observed(status={}, now=NOW, inputs=Inputs(""), broken=("spec.kubernetes.image: not allowed",)))
    assert plan.create_gang is None and plan.status["phase"] == "Failed", plan.status
    assert "spec.kubernetes.image" in plan.status["message"]


def test_new_job_creates_everything():
    plan = transition(JOB, None, {}, [], NOW)
    assert plan.status["phase"] == "Pending" and plan.create_static and plan.create_gang == 0
    assert plan.status["startTime"] == iso(NOW) and plan.status["restarts"] == 0


def test_pending_to_initializing_to_running():
    st = {"phase": "Pending", "restarts": 0}
    assert transition(JOB, None, st, pods(head="Pending", worker="Pending"), NOW).status["phase"] == "Pending"
    assert transition(JOB, None, st, pods(head="Running", worker="Pending"), NOW).status["phase"] == "Initializing"
    plan = transition(JOB, None, {"phase": "Initializing", "restarts": 0}, pods(), NOW)
    assert plan.status["phase"] == "Running" and ("Normal", "AllPodsRunning") == plan.events[0][:2]


def test_missing_pods_are_created_while_pending_but_restart_the_gang_while_running():
    plan = transition(JOB, None, {"phase": "Pending", "restarts": 0}, pods()[:1], NOW)
    assert plan.create_gang == 0 and plan.status["phase"] == "Pending"
    plan = transition(JOB, None, {"phase": "Running", "restarts": 0}, pods()[:1], NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1


def test_failure_restarts_then_backoff_fails():
    plan = transition(JOB, None, {"phase": "Running", "restarts": 0}, pods(worker="Failed"), NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1
    assert sorted(plan.delete_pods) == ["h-g0", "w-g0"]
    # old generation still terminating: wait
    plan = transition(JOB, None, plan.status, pods(gen=0, deleting=True), NOW)
    assert plan.status["phase"] == "Restarting" and plan.create_gang is None
    plan = transition(JOB, None, plan.status, [], NOW)
    assert plan.status["phase"] == "Pending" and plan.create_gang == 1
    plan = transition(JOB, None, {**plan.status, "phase": "Running"}, pods(gen=1, head="Failed"), NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "BackoffLimitExceeded"
    assert plan.delete_pods == ["w-g1"]  # the head stays for its logs


def test_a_disrupted_pod_restarts_the_gang_without_using_the_backoff_limit():
    """JOB allows one restart. An eviction (DisruptionTarget) restarts the gang for free; then a real failure
    uses the one restart; the next failure fails the job."""
    evicted = [PodView("h-g0", "head", 0, "Running"),
               PodView("w-g0", "worker", 0, "Running", True, disruption="EvictionByEvictionAPI")]
    plan = transition(JOB, None, {"phase": "Running", "restarts": 0}, evicted, NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1
    assert plan.status["disruptions"] == 1 and "not counted against runPolicy.backoffLimit" in plan.status["message"]
    assert "EvictionByEvictionAPI" in plan.status["message"]
    st = {**plan.status, "phase": "Running"}
    plan = transition(JOB, None, st, pods(gen=1, worker="Failed"), NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 2 and "(1/1)" in plan.status["message"]
    plan = transition(JOB, None, {**plan.status, "phase": "Running"}, pods(gen=2, worker="Failed"), NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "BackoffLimitExceeded"
    assert "1 restart(s) used of runPolicy.backoffLimit=1" in plan.status["message"]


def test_an_evicted_pod_already_gone_still_does_not_use_the_backoff_limit():
    """The pod watch saw its DisruptionTarget, but the pod was deleted before the tick: only the head is left."""
    gone = [PodView("h-g0", "head", 0, "Running")]
    st = {"phase": "Running", "restarts": 0}
    plan = transition(JOB, None, st, gone, NOW, disrupted={"w-g0": "PreemptionByScheduler"})
    assert plan.status["disruptions"] == 1 and "PreemptionByScheduler" in plan.status["message"]
    assert transition(JOB, None, st, gone, NOW).status.get("disruptions") is None  # unseen: counted, as before


def test_a_pod_stuck_terminating_holds_a_gang_restart_back_only_for_a_while():
    st = {"phase": "Restarting", "restarts": 1}
    grace_end = NOW - dt.timedelta(seconds=30)  # 30 s past the grace period: wait
    stuck = [PodView("w-g0", "worker", 0, "Running", True, deletion_deadline=grace_end)]
    plan = transition(JOB, None, st, stuck, NOW)
    assert plan.create_gang is None  # within a minute of its grace period: wait
    plan = transition(JOB, None, st, stuck, NOW + dt.timedelta(seconds=STUCK_TERMINATING_SECONDS))
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
    from hybridflow_operator.watch import pod_view

    raw = {"metadata": {"name": "w-g0", "labels": {mf.LABEL_ROLE: "worker", mf.LABEL_GENERATION: "0"},
                        "creationTimestamp": iso(NOW)}, "status": {"phase": "Pending", **pod_status}}
    current = [PodView("h-g0", "head", 0, "Running"), pod_view(raw)]
    plan = transition(JOB, None, {"phase": "Initializing", "restarts": 0}, current, NOW)
    cond = next(c for c in plan.status["conditions"] if c["type"] == "PodsStarting")
    assert cond["status"] == "False" and cond["reason"] == reason and "w-g0" in cond["message"], cond
    assert [e[1] for e in plan.events] == [reason]
    again = transition(JOB, None, plan.status, current, NOW)
    assert again.events == [], "one event per reason, not one per tick"
    started = transition(JOB, None, again.status, pods(), NOW)
    assert next(c for c in started.status["conditions"] if c["type"] == "PodsStarting")["status"] == "True"


def test_a_pod_pending_too_long_is_reported():
    young = PodView("w-g0", "worker", 0, "Pending", pending_since=NOW - dt.timedelta(seconds=60))
    plan = transition(JOB, None, {"phase": "Pending", "restarts": 0}, [PodView("h-g0", "head", 0, "Pending"), young], NOW)
    assert not [c for c in plan.status.get("conditions", []) if c["type"] == "PodsStarting"]
    old = PodView("w-g0", "worker", 0, "Pending", pending_since=NOW - dt.timedelta(seconds=900))
    plan = transition(JOB, None, {"phase": "Pending", "restarts": 0}, [PodView("h-g0", "head", 0, "Pending"), old], NOW)
    assert next(c for c in plan.status["conditions"] if c["type"] == "PodsStarting")["reason"] == "PendingTooLong"


def test_success_cleans_up_workers_and_ttl_deletes_the_job():
    job = parse_job(_raw("tiny-grpo.yaml", runPolicy={"ttlSecondsAfterFinished": 60}))
    plan = transition(job, None, {"phase": "Running", "restarts": 0, "step": 37, "totalSteps": 40}, pods(head="Succeeded"),
                  NOW)
    assert plan.status["phase"] == "Succeeded" and plan.delete_pods == ["w-g0"]
    assert plan.status["step"] == 40  # the last polls can miss the final steps; a driver exits 0 only after them
    assert not transition(job, None, plan.status, pods(head="Succeeded")[:1], NOW).delete_job
    later = NOW + dt.timedelta(seconds=61)
    assert transition(job, None, plan.status, pods(head="Succeeded")[:1], later).delete_job


def test_suspend_and_resume():
    job = parse_job(_raw("tiny-grpo.yaml", runPolicy={"suspend": True}))
    st = {"phase": "Running", "restarts": 2, "step": 17}
    plan = transition(job, None, st, pods(gen=2), NOW)
    assert plan.status["phase"] == "Suspending" and sorted(plan.delete_pods) == ["h-g2", "w-g2"]
    plan = transition(job, None, plan.status, [], NOW)
    assert plan.status["phase"] == "Suspended" and plan.status["step"] == 17 and plan.status["restarts"] == 2
    assert transition(job, None, plan.status, [], NOW).status["phase"] == "Suspended"
    plan = transition(JOB, None, plan.status, [], NOW)
    assert plan.status["phase"] == "Pending" and plan.create_gang == 2


def test_deadline():
    job = parse_job(_raw("tiny-grpo.yaml", runPolicy={"activeDeadlineSeconds": 10}))
    st = {"phase": "Running", "restarts": 0, "startTime": iso(NOW - dt.timedelta(seconds=11))}
    plan = transition(job, None, st, pods(), NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "DeadlineExceeded"


def test_invalid_spec_fails_once():
    plan = transition(None, "spec.rollout.responsesPerPrompt: bad", {}, [], NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "ValidationFailed"
    again = transition(None, "spec.rollout.responsesPerPrompt: bad", plan.status, [], NOW)
    assert again.events == [] and again.status == plan.status


def test_stale_generation_pods_are_removed():
    plan = transition(JOB, None, {"phase": "Running", "restarts": 1}, pods(gen=1) + pods(gen=0)[:1], NOW)
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
    from hybridflow_operator.watch import pod_view

    pod = {"metadata": {"name": "j-default-0-g1", "labels": {mf.LABEL_GENERATION: "1"}},
           "status": {"phase": "Failed", key: [{"name": "c1", "state": {"terminated": {"exitCode": 137,
                                                                                     "reason": "Error"}}}]}}
    view = pod_view(pod)
    assert view.generation == 1 and view.phase == "Failed"
    assert view.message == f"{kind} c1 exited with code 137 (Error)"


def test_missing_inputs_hold_the_pods_back_with_a_reason_until_they_appear():
    job = parse_job(_files_job(rewardConfigMap="my-reward"))
    why = "spec.kubernetes.rewardConfigMap: ConfigMap 'my-reward' not found in namespace ml; create it"
    plan = transition(job, None, {}, [], NOW, missing_inputs=why)
    assert plan.create_gang is None and plan.status["phase"] == "Pending" and plan.status["reason"] == "InputsMissing"
    assert plan.events == [("Warning", "InputsMissing", why)]
    cond = next(c for c in plan.status["conditions"] if c["type"] == "InputsReady")
    assert cond["status"] == "False" and cond["message"] == why
    again = transition(job, None, plan.status, [], NOW, missing_inputs=why)
    assert again.create_gang is None and again.events == []  # one event, not one per tick
    paused = job.model_copy(deep=True)
    paused.spec.run_policy.suspend = True
    suspended = transition(paused, None, again.status, [], NOW)
    assert next(c for c in suspended.status["conditions"] if c["type"] == "InputsReady")["status"] == "False", \
        "nothing was checked: the condition must not flip"
    found = transition(job, None, again.status, [], NOW, missing_inputs="")
    assert found.create_gang == 0 and found.status["reason"] == "InputsFound"
    assert "creating the pods" in found.status["message"]
    assert next(c for c in found.status["conditions"] if c["type"] == "InputsReady")["status"] == "True"


def test_a_driver_that_rejects_its_input_fails_the_job_without_restarts():
    msg = "container controller exited with code 2 (Error): spec.data.train: cannot read '/data/x.parquet' as parquet"
    views = [PodView("h-g0", "head", 0, "Failed", message=msg, exit_code=2), PodView("w-g0", "worker", 0, "Running")]
    plan = transition(JOB, None, {"phase": "Running", "restarts": 0}, views, NOW)
    assert plan.status["phase"] == "Failed" and plan.status["reason"] == "InvalidInput" and plan.status["restarts"] == 0
    assert "cannot read '/data/x.parquet'" in plan.status["message"] and plan.delete_pods == ["w-g0"]
    views[0] = PodView("h-g0", "head", 0, "Failed", message="container controller exited with code 1", exit_code=1)
    assert transition(JOB, None, {"phase": "Running", "restarts": 0}, views, NOW).status["phase"] == "Restarting"


def test_the_drivers_error_is_read_from_its_log_tail():
    from hybridflow.api.errors import last_error
    from hybridflow_operator.watch import pod_view

    tail = ("2026-11-30 ray started\nsome progress\nerror: /etc/hybridflow/job.yaml: cannot run here\n"
            "  spec.data.train: 'x.jsonl' does not exist\n")
    assert last_error(tail) == "/etc/hybridflow/job.yaml: cannot run here spec.data.train: 'x.jsonl' does not exist"
    assert last_error("just a line\nKilled\n") == "Killed"
    pod = {"metadata": {"name": "j-head-g0", "labels": {mf.LABEL_ROLE: "head"}},
           "status": {"phase": "Failed", "containerStatuses": [{"name": "controller", "state": {"terminated": {
               "exitCode": 2, "reason": "Error", "message": tail}}}]}}
    view = pod_view(pod)
    assert view.exit_code == 2 and view.message.endswith("spec.data.train: 'x.jsonl' does not exist")


def test_status_messages_are_capped():
    """Issue 24 N9: whatever a message quotes (a user's 200 KB key, a pod's log), each status message and each
    condition's stays at about 1 KiB; and a long reason that repeats is still one event, not one per tick."""
    from hybridflow_operator.phases import MAX_MESSAGE

    plan = transition(None, "spec.placement." + "k" * 200_000 + ": unknown role", {}, [], NOW)
    messages = [plan.status["message"], *(c["message"] for c in plan.status["conditions"])]
    assert len(messages) == 3 and all(len(m) == MAX_MESSAGE and m.endswith("\u2026") for m in messages)
    job = parse_job(_files_job(rewardConfigMap="my-reward"))
    why = "spec.kubernetes.dataPvc: " + "x" * 5000
    first = transition(job, None, {}, [], NOW, missing_inputs=why)
    assert len(first.status["message"]) == MAX_MESSAGE and len(first.events) == 1
    assert transition(job, None, first.status, [], NOW, missing_inputs=why).events == []


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
        plan = transition(job, None, {"phase": "Running", "restarts": 0},
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
    plan = transition(ASYNC, None, {"phase": "Initializing", "restarts": 0}, starting, NOW)
    assert plan.status["pools"] == [{"name": "trainer", "roles": TRAINER_ROLES, "pods": 1, "ready": 1},
                                    {"name": "rollout", "roles": ["rollout"], "pods": 1, "ready": 0}]
    running = [head, _pool_pod("trainer"), _pool_pod("rollout"), _pool_pod("rollout", gen=1),
               _pool_pod("trainer", deleting=True)]
    plan = transition(ASYNC, None, {"phase": "Running", "restarts": 0}, running, NOW)
    assert [(p["name"], p["pods"], p["ready"]) for p in plan.status["pools"]] == [("trainer", 1, 1), ("rollout", 1, 1)]
    failed = [head, _pool_pod("trainer"), _pool_pod("rollout", phase="Failed", ready=False)]
    gang = ASYNC.model_copy(update={"spec": ASYNC.spec.model_copy(update={
        "run_policy": ASYNC.spec.run_policy.model_copy(update={"restart_policy": "gang"})})})
    plan = transition(gang, None, {"phase": "Running", "restarts": 0}, failed, NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1
    assert [(p["name"], p["pods"], p["ready"]) for p in plan.status["pools"]] == [("trainer", 0, 0), ("rollout", 0, 0)]
    assert "pools" not in transition(None, "spec.x: bad", {}, [], NOW).status, "no spec, no pools to show"


def test_pod_view_reads_the_pool_label_and_the_ready_condition():
    from hybridflow_operator.watch import pod_view

    pod = mf.worker_pod(ASYNC, "uid", ASYNC.spec.pool("rollout"), 0, 0)
    assert (view := pod_view(pod)).pool == "rollout" and not view.ready  # created, no status yet
    pod["status"] = {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"},
                                                        {"type": "Ready", "status": "True"}]}
    assert pod_view(pod).ready
    pod["status"]["conditions"][1]["status"] = "False"
    assert not pod_view(pod).ready


def gang3(head="Running", w1="Running", **w1_view) -> list[PodView]:
    """The head and two pool pods (tiny-grpo-k8s.yaml's gang), the second in phase `w1`."""
    return [PodView("h-g0", "head", 0, head), PodView("w0-g0", "worker", 0, "Running"),
            PodView("w1-g0", "worker", 0, w1, **w1_view)]


def test_a_failed_pool_pod_is_replaced_alone_while_the_head_and_the_other_pods_run():
    """restartPolicy failedPod (the default): the failed pod is deleted and made again under its name once gone;
    the head and the healthy pod are never touched, the phase stays Running, no gang generation is used."""
    three = gang3(w1="Failed", message="OOMKilled (exit 137)")
    plan = transition(REPLACING, None, {"phase": "Running", "restarts": 0}, three, NOW)
    st = plan.status
    assert st["phase"] == "Running" and st["restarts"] == 0 and plan.delete_pods == ["w1-g0"]
    assert st["podReplacements"] == 1 and st["replacing"] == ["w1-g0"] and plan.create_gang == 0
    (event,) = _events(plan, "PodReplaced")
    assert event.startswith("pod w1-g0 failed: OOMKilled (exit 137); replacing it alone: the head and 2 other pod(s) "
                            "keep running (h-g0, w0-g0)"), event
    assert st["lastReplacement"]["message"] == event
    # the old pod terminating, then gone: made again (the handler skips a name still taken), counted once
    for left in ([*three[:2], PodView("w1-g0", "worker", 0, "Failed", deleting=True)], three[:2]):
        plan = transition(REPLACING, None, st, left, NOW)
        assert plan.status["phase"] == "Running" and plan.create_gang == 0 and not plan.delete_pods
        assert plan.status["podReplacements"] == 1 and not _events(plan, "PodReplaced")
        st = plan.status
    plan = transition(REPLACING, None, st, [*three[:2], PodView("w1-g0", "worker", 0, "Running")], NOW)
    assert "replacing" not in plan.status and plan.create_gang is None and plan.status["phase"] == "Running"


def test_past_the_replacement_limit_or_when_the_head_fails_the_gang_restarts():
    st = {"phase": "Running", "restarts": 0, "podReplacements": 2}  # replacementLimit 2 used up
    plan = transition(REPLACING, None, st, gang3(w1="Failed"), NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1 and "replacing" not in plan.status
    plan = transition(REPLACING, None, {"phase": "Running", "restarts": 0}, gang3(head="Failed"), NOW)
    assert plan.status["phase"] == "Restarting" and plan.status["restarts"] == 1, "the head holds the controller"
    plan = transition(JOB, None, {"phase": "Running", "restarts": 0}, pods(worker="Failed"), NOW)
    assert plan.status["phase"] == "Restarting", "restartPolicy gang: every failure restarts the gang"


def test_a_pool_pod_that_disappeared_is_made_again_and_an_evicted_one_is_not_counted():
    plan = transition(REPLACING, None, {"phase": "Running", "restarts": 0}, gang3()[:2], NOW)
    assert plan.status["phase"] == "Running" and plan.create_gang == 0 and plan.status["podReplacements"] == 1
    assert _events(plan, "PodReplaced")[0].startswith("1 pool pod(s) disappeared; replacing it alone")
    evicted = gang3(w1="Failed", disruption="EvictionByEvictionAPI")
    plan = transition(REPLACING, None, {"phase": "Running", "restarts": 0}, evicted, NOW)
    assert plan.status["phase"] == "Running" and plan.delete_pods == ["w1-g0"]
    assert plan.status["podReplacements"] == 0 and "not counted" in _events(plan, "PodReplaced")[0]


def test_a_job_that_completes_no_step_within_its_progress_deadline_is_stalled_and_its_gang_restarts():
    quiet = {"phase": "Running", "restarts": 0, "step": 7, "lastProgressTime": iso(NOW - dt.timedelta(seconds=1000))}
    plan = transition(REPLACING, None, quiet, gang3(), NOW)  # the default deadline's floor is 900 s
    assert plan.status["phase"] == "Restarting" and plan.status["reason"] == "Stalled"
    assert plan.status["restarts"] == 1 and sorted(plan.delete_pods) == ["h-g0", "w0-g0", "w1-g0"]
    assert "no step completed for 1000s after step 7 (progress deadline 900s" in plan.status["message"]
    assert _events(plan, "Stalled")
    slow = {**quiet, "slowestStepSeconds": 120.0}  # ten times the slowest step: 1200 s
    assert transition(REPLACING, None, slow, gang3(), NOW).status["phase"] == "Running"
    own = parse_job(_raw("tiny-grpo-k8s.yaml", runPolicy={"progressDeadlineSeconds": 60}))
    plan = transition(own, None, {**slow, "lastProgressTime": iso(NOW - dt.timedelta(seconds=61))}, gang3(), NOW)
    assert plan.status["reason"] == "Stalled" and "runPolicy.progressDeadlineSeconds" in plan.status["message"]
    # the clock starts when the job starts Running, and moves with every step the operator polls
    started = transition(REPLACING, None, {"phase": "Initializing", "restarts": 0}, gang3(), NOW).status
    assert started["phase"] == "Running" and started["lastProgressTime"] == started["startupTime"] == iso(NOW)
    st = {"step": 7, "lastProgressTime": "then", "slowestStepSeconds": 30.0}
    merge_progress(st, {"step": 7, "lastStepSeconds": 12.5}, "/ck", "now")
    assert st["lastProgressTime"] == "then" and st["slowestStepSeconds"] == 30.0
    merge_progress(st, {"step": 8, "lastStepSeconds": 42.0, "recoveries": 1, "lastRecoverySeconds": 31.5}, "/ck", "now")
    assert st["lastProgressTime"] == "now" and st["slowestStepSeconds"] == 42.0 and st["recoveries"] == 1


def test_a_gangs_start_up_has_its_own_deadline_until_its_drivers_first_step():
    """A short progressDeadlineSeconds, set for hung steps, does not judge a (re)started gang's start-up: until its
    driver's first step it has startupDeadlineSeconds (default: the progress deadline, at least the floor), on the
    same clock (from Running, and from the driver's first report of the step it resumes from, a moved step), and
    that report does not end the start-up."""
    short = parse_job(_raw("tiny-grpo-k8s.yaml", runPolicy={"progressDeadlineSeconds": 60}))
    st = transition(short, None, {"phase": "Initializing", "restarts": 0, "step": 90}, gang3(), NOW).status
    assert st["startupTime"] == st["lastProgressTime"] == iso(NOW)
    at = lambda seconds: NOW + dt.timedelta(seconds=seconds)  # noqa: E731
    assert transition(short, None, dict(st), gang3(), at(600)).status["phase"] == "Running"  # 60 s judged the step
    plan = transition(short, None, dict(st), gang3(), at(901))
    assert plan.status["reason"] == "Stalled" and plan.status["restarts"] == 1
    assert "for 901s of the gang's start-up (start-up deadline 900s: the default" in plan.status["message"]
    assert "startupTime" not in plan.status  # its clock runs only while Running; the next gang's starts anew
    own = parse_job(_raw("tiny-grpo-k8s.yaml", runPolicy={"progressDeadlineSeconds": 60,
                                                          "startupDeadlineSeconds": 120}))
    plan = transition(own, None, dict(st), gang3(), at(121))
    assert plan.status["reason"] == "Stalled" and "(start-up deadline 120s: runPolicy.startupDeadlineSeconds)" in (
        plan.status["message"])
    merge_progress(st, {"step": 75}, "/ck", iso(at(300)))  # the resumed driver's endpoint, before its first step
    assert st["startupTime"] == iso(NOW) and st["lastProgressTime"] == iso(at(300))
    assert transition(short, None, dict(st), gang3(), at(1150)).status["phase"] == "Running"
    assert transition(short, None, dict(st), gang3(), at(1201)).status["reason"] == "Stalled"
    merge_progress(st, {"step": 76, "lastStepSeconds": 20.0}, "/ck", iso(at(610)))  # its first step
    assert "startupTime" not in st and st["lastProgressTime"] == iso(at(610))
    assert transition(short, None, dict(st), gang3(), at(669)).status["phase"] == "Running"
    plan = transition(short, None, dict(st), gang3(), at(671))
    assert plan.status["reason"] == "Stalled" and "after step 76 (progress deadline 60s" in plan.status["message"]


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
