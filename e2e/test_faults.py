"""Scenario: faults. A worker pod killed mid-run (gang restart, resume from the checkpoint, no step lost or
repeated); the operator killed mid-run (the new one adopts the pods); backoffLimit exhausted (Failed, with why)."""
from __future__ import annotations

from kube.harness import wait_for

from e2e.helpers import job_variant, live_pod_names, phase
from e2e.worlds import current_head

STEPS = 30
LONG = {"trainer": {"steps": STEPS, "saveFreq": 3}, "metrics": {"port": 8000, "lingerSeconds": 0}}


def _start(world, tmp_path, name, **changes):
    world.kubectl("apply", "--validate=false", "-f", str(job_variant(tmp_path, name, **{**LONG, **changes})))
    wait_for(lambda: phase(world, name) == "Running", 300, f"{name} Running")


def _finish(world, name, head):
    wait_for(lambda: phase(world, name) in ("Succeeded", "Failed"), 600, f"the end; {world.logs(head)}")
    return world.kube.status(name)


def _restart_reasons(world, name: str) -> str:
    """Why each gang restart happened, and the newest head's log: what a failed scenario needs to be read."""
    why = [e.message for e in world.kube.events() if e.involved_object.name == name and e.reason == "GangRestart"]
    head = current_head(world.kube, name)
    return f"restarts: {why}; {head}: {world.logs(head)[-3000:]}"


def test_killed_worker_restarts_the_gang_and_resumes_from_the_checkpoint(world, tmp_path):
    name = "fault-worker"
    _start(world, tmp_path, name)
    ck = wait_for(lambda: world.kube.status(name).get("lastCheckpointStep", 0) >= 3
                  and world.kube.status(name)["lastCheckpointStep"], 300, "a checkpoint")
    world.kill_pod_processes(f"{name}-default-1-g0")
    wait_for(lambda: world.kube.status(name).get("restarts") == 1, 120, "the gang restart")
    st = _finish(world, name, f"{name}-head-g1")
    assert st["phase"] == "Succeeded", st
    assert st["restarts"] == 1, _restart_reasons(world, name)
    assert world.step_log(name) == list(range(1, STEPS + 1)), "a step was lost or repeated"
    resumed = world.logs(f"{name}-head-g1")
    start = int(resumed.split("(from step ")[1].split(")")[0])
    assert start >= ck and start % 3 == 0, resumed[-2000:]  # from a checkpoint, not from scratch
    assert "GangRestart" in [e.reason for e in world.kube.events() if e.involved_object.name == name]


def test_killed_operator_is_replaced_and_adopts_the_pods(world, tmp_path):
    name = "fault-operator"
    _start(world, tmp_path, name)
    before = {p.metadata.name: p.metadata.uid for p in world.kube.pods(name)}
    world.restart_operator()
    st = _finish(world, name, f"{name}-head-g0")
    assert st["phase"] == "Succeeded" and st.get("restarts", 0) == 0, st
    after = {p.metadata.name: p.metadata.uid for p in world.kube.pods(name)}
    assert after.items() <= before.items(), "the new operator created pods of its own"
    assert world.step_log(name) == list(range(1, STEPS + 1))


def test_exhausted_backoff_limit_fails_the_job_with_the_reason(world, tmp_path):
    name = "fault-backoff"
    _start(world, tmp_path, name, runPolicy={"backoffLimit": 1})
    for gen in (0, 1):
        pod = f"{name}-default-0-g{gen}"
        wait_for(lambda: pod in live_pod_names(world.kube, name) and world.pod_running(pod), 300, f"{pod} running")
        world.kill_pod_processes(pod)
        if gen == 0:
            wait_for(lambda: phase(world, name) == "Running" and world.kube.status(name).get("restarts") == 1, 300,
                     "generation 1 running")
    wait_for(lambda: phase(world, name) == "Failed", 120, "phase Failed")
    st = world.kube.status(name)
    assert st["reason"] == "BackoffLimitExceeded"
    assert f"{name}-default-0-g1" in st["message"] and "137" in st["message"], st["message"]
