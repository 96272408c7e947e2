"""Scenario: faults. One job meets them in turn: the operator killed mid-run (the new one adopts the pods), a worker
pod killed (gang restart, resume from the checkpoint), then random pods killed at random times (chaos); no step is
lost or repeated. Another: an evicted pod (restart, backoff not used) and backoffLimit exhausted (Failed, with why)."""
from __future__ import annotations

import random
import time

from kube.harness import wait_for

from e2e.helpers import job_variant, live_pod_names, phase
from e2e.worlds import current_head

STEPS = 30
# Seed 13 kills the head, then a worker: chaos of both kinds of pod (a third kill, the head again, added ~35 s
# and nothing the first two do not show).
CHAOS_KILLS = 2
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


def _first_step_logged(log: str) -> int | None:
    """The first progress line's step ("step 7/30 | ..."): where a gang generation's driver started training."""
    for line in log.splitlines():
        if line.startswith("step ") and "/" in line:
            return int(line.split()[1].split("/")[0])
    return None


def test_killed_operator_and_killed_pods_lose_and_repeat_no_step(world, tmp_path):
    """One job through the faults a running gang meets. The operator is SIGKILLed mid-run: the new one adopts the
    running pods (same names and UIDs, nothing created) and goes on managing the job. Then a worker pod is killed
    after a checkpoint: the gang restarts and the new driver resumes from that checkpoint, not from scratch. Then
    chaos: a fixed seed picks which pod of the running gang dies and when (head or worker, any moment of training,
    a checkpoint save included). The job ends Succeeded, one restart per kill, each step in the step log once."""
    rng = random.Random(13)
    name = "fault-kills"
    _start(world, tmp_path, name, runPolicy={"backoffLimit": 1 + CHAOS_KILLS})

    before = {p.metadata.name: p.metadata.uid for p in world.kube.pods(name)}
    world.restart_operator()
    seen = world.kube.status(name).get("lastCheckpointStep", 0)
    ck = wait_for(lambda: (c := world.kube.status(name).get("lastCheckpointStep", 0)) > seen and c >= 3 and c, 300,
                  "a checkpoint, polled into status by the new operator")
    after = {p.metadata.name: p.metadata.uid for p in world.kube.pods(name)}
    assert after == before, "the new operator replaced or added pods instead of adopting them"
    assert world.kube.status(name).get("restarts", 0) == 0

    kills = [f"{name}-default-1-g0"]
    world.kill_pod_processes(kills[0])
    wait_for(lambda: world.kube.status(name).get("restarts") == 1, 120, "the gang restart")
    resumed_at = wait_for(lambda: _first_step_logged(world.logs(f"{name}-head-g1")), 300,
                          lambda: f"generation 1 training; {_restart_reasons(world, name)}") - 1
    assert resumed_at >= ck and resumed_at % 3 == 0, (ck, resumed_at)  # from a checkpoint, not from scratch
    wait_for(lambda: "GangRestart" in [e.reason for e in world.kube.events() if e.involved_object.name == name], 30,
             "the GangRestart event (kopf posts events after the status)")

    while len(kills) < 1 + CHAOS_KILLS:
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
    assert st["phase"] == "Succeeded" and st["restarts"] == len(kills), (kills, _restart_reasons(world, name))
    assert world.step_log(name) == list(range(1, STEPS + 1)), f"a step was lost or repeated; killed {kills}"


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
    def restarts() -> list[str]:
        return [e.message for e in world.kube.events() if e.involved_object.name == name and e.reason == "GangRestart"]
    wait_for(lambda: any("not counted against runPolicy.backoffLimit" in m for m in restarts()), 30,
             lambda: f"the eviction's GangRestart event; events: {restarts()}")
