"""Scenario: faults. A worker pod killed mid-run (gang restart, resume from the checkpoint, no step lost or
repeated); the operator killed mid-run (the new one adopts the pods); an evicted pod (restart, backoff not used)
and backoffLimit exhausted (Failed, with why); chaos: random pods killed at random times."""
from __future__ import annotations

import random
import time

from kube.harness import wait_for

from e2e.helpers import job_variant, live_pod_names, phase
from e2e.worlds import current_head

STEPS = 30
CHAOS_KILLS = 3
LONG = {"trainer": {"steps": STEPS, "saveFreq": 3}, "metrics": {"port": 8000, "lingerSeconds": 0}}


def _start(world, tmp_path, name, **changes):
    world.kubectl("apply", "--validate=false", "-f", str(job_variant(tmp_path, name, **{**LONG, **changes})))
    wait_for(lambda: phase(world, name) == "Running", 300, f"{name} Running")


def _finish(world, name, head):
    wait_for(lambda: phase(world, name) in ("Succeeded", "Failed"), 600, lambda: f"the end; {world.logs(head)}")
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


def test_an_eviction_does_not_use_the_backoff_limit_and_exhausting_it_fails_the_job(world, tmp_path):
    """backoffLimit 1: a killed pod uses the one restart; an evicted pod (a drain) restarts the gang without using
    any; the next killed pod fails the job, with which pod and why."""
    name = "fault-backoff"
    _start(world, tmp_path, name, runPolicy={"backoffLimit": 1})
    for gen, fault in ((0, world.kill_pod_processes), (1, world.evict_pod), (2, world.kill_pod_processes)):
        pod = f"{name}-default-0-g{gen}"
        wait_for(lambda: pod in live_pod_names(world.kube, name) and world.pod_running(pod), 300, f"{pod} running")
        fault(pod)
        if gen < 2:
            wait_for(lambda: phase(world, name) == "Running" and world.kube.status(name).get("restarts") == gen + 1,
                     300, f"generation {gen + 1} running; {world.kube.status(name)}")
    wait_for(lambda: phase(world, name) == "Failed", 120, "phase Failed")
    st = world.kube.status(name)
    assert st["reason"] == "BackoffLimitExceeded" and st["disruptions"] == 1, st
    assert f"{name}-default-0-g2" in st["message"] and "137" in st["message"], st["message"]
    restarts = [e.message for e in world.kube.events() if e.involved_object.name == name and e.reason == "GangRestart"]
    assert any("not counted against runPolicy.backoffLimit" in m for m in restarts), restarts


def test_chaos_random_pods_killed_at_random_times_and_every_step_runs_once(world, tmp_path):
    """A fixed seed picks which pod of the running gang dies and when (head or worker, any moment of training,
    a checkpoint save included); the job still ends Succeeded with each step in the step log exactly once."""
    rng = random.Random(13)
    name = "fault-chaos"
    _start(world, tmp_path, name, runPolicy={"backoffLimit": CHAOS_KILLS})
    kills = []
    while len(kills) < CHAOS_KILLS:
        gen = len(kills)
        wait_for(lambda: phase(world, name) in ("Running", "Succeeded") and world.kube.status(name)["restarts"] == gen,
                 300, f"generation {gen} running; {world.kube.status(name)}")
        time.sleep(rng.uniform(0.0, 6.0))
        pod = rng.choice([p for p in live_pod_names(world.kube, name) if p.endswith(f"-g{gen}")])
        if phase(world, name) != "Running" or not world.pod_running(pod):
            break  # finished before this kill: the kills so far are the scenario
        world.kill_pod_processes(pod)
        kills.append(pod)
        wait_for(lambda: world.kube.status(name).get("restarts") == gen + 1, 120, f"the restart after killing {pod}")
    st = _finish(world, name, current_head(world.kube, name))
    assert kills, "the job ended before any pod was killed"
    assert st["phase"] == "Succeeded" and st["restarts"] == len(kills), (kills, _restart_reasons(world, name))
    assert world.step_log(name) == list(range(1, STEPS + 1)), f"a step was lost or repeated; killed {kills}"
