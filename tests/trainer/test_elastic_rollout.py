"""An elastic rollout pool (issue 29, item 3; trainer.replicas, single_controller.membership) on real parts: the
async example with spec.rolloutPool {minReplicas 1, maxReplicas 2} in the shared Ray, whose one node holds the
rollout pool's slots 0 and 1 (as two pods would on Kubernetes). The controller starts with one vLLM replica and
grows into slot 1 while training runs; the new replica takes work only once its weights sum to the trainer's. Then
pod 1 is given notice the way its preStop hook does it on Kubernetes, `hybridflow leave-pool` in a process of its
own: its replica stops taking work, finishes what it is in, is ended, and the pod is released; the slot, still in
the cluster, is not grown into again. In between, the grown replica is lost and rebuilt in its slot (a recovery,
counted as a replacement, not a second join; what it was generating is generated again by the other). Training never
stops: the trainer's process is the one it started with, every step runs once, every prompt group drawn is trained
exactly once, and the replica that stays holds the trainer's final weights. Then that replica, the last one, is lost
during a weight sync: the sync is kept for the rebuilt one, which is given the version it missed before the job
would evaluate with it (settle)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import ray
import yaml

from hybridflow.api import parse_job
from hybridflow.models.builders import materialize
from hybridflow.trainer import setup, task as tasks
from support.live_jobs import assert_each_draw_trained_once, fit_while
from support.paths import ROOT

pytestmark = pytest.mark.slow

STEPS = 110  # ~0.2-0.45 s each: the grown replica joins at once, the lost one is back ~50 steps later (~19 s),
# it leaves ~15 steps after that (~6 s): about twice the steps these take, measured


def _job(tmp_path: Path):
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async.yaml").read_text())
    spec = doc["spec"]
    spec["resourcePools"] = [{"name": "trainer", "devicesPerNode": 1}, {"name": "p1", "devicesPerNode": 1}]
    spec["placement"] = {"actor": "trainer", "rollout": "p1"}
    spec["rolloutPool"] = {"minReplicas": 1, "maxReplicas": 2}
    spec["rollout"]["maxStaleness"] = 1024  # none dropped: every prompt drawn must be trained
    spec["trainer"].update(steps=STEPS, checkpointDir=str(tmp_path / "run"), rolloutLog=True, saveFreq=0)
    spec["metrics"]["port"] = 0
    return parse_job(doc)


def _records(steps_log: Path) -> list[dict]:
    return [json.loads(line) for line in steps_log.read_text().splitlines()] if steps_log.exists() else []


def _when(steps_log: Path, done: threading.Event, seen: Callable[[dict], bool]) -> dict | None:
    while not done.is_set():
        records = _records(steps_log)
        if records and seen(records[-1]):
            return records[-1]
        time.sleep(0.05)
    return None


def _kill_then_leave(steps_log: Path, group, address: str, done: threading.Event, out: dict) -> None:
    """Once a step ran on both replicas, the grown one is lost (its process killed, as a lost pod looks to the
    controller); once it is back, its pod is given notice: the real preStop command, in a process of its own."""
    if _when(steps_log, done, lambda r: r.get("rollout_replicas_working") == 2) is None:
        return
    out["killed"] = group.hosts[1]
    ray.kill(group.hosts[1], no_restart=True)
    back = _when(steps_log, done, lambda r: "replica_recovery_seconds" in r)
    if back is None:
        return
    out["at_step"] = back["step"]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "leave-pool", f"--address={address}", "--pool=p1", "--index=1",
         "--timeout=120"], capture_output=True, text=True, timeout=180)
    out.update(rc=proc.returncode, said=proc.stdout + proc.stderr, seconds=time.perf_counter() - t0)


def test_the_pool_grows_into_a_new_pod_and_a_pod_given_notice_leaves_while_training_goes_on(
        tmp_path, model_cache, shared_ray):
    job = _job(tmp_path)
    model_dir = materialize(job.spec.models.actor, model_cache, job.spec.trainer.seed)
    task = tasks.build_task(job, model_dir)
    shared_ray.check_fits(job)
    w = setup.build_workers(job, model_dir, task, None, None)
    left = {}
    try:
        rollout_group = next(g for g in w.groups if "rollout" in g.roles)
        trainer_group = next(g for g in w.groups if "actor" in g.roles)
        assert len(rollout_group.hosts) == 1 and rollout_group.pool.slots == [0]  # minReplicas to start with
        first, trainer_host = rollout_group.hosts[0], trainer_group.hosts[0]
        steps_log = Path(job.spec.trainer.checkpoint_dir) / "steps.jsonl"
        summary = fit_while(job, w, task,
                            lambda done: _kill_then_leave(steps_log, rollout_group, shared_ray.address, done, left))
        assert summary.steps_done == STEPS
        steps = _records(steps_log)
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # each once: no recovery, nothing again

        # grown: slot 1's replica joined (weights checked, else joined() raises) and worked beside the first
        joined = [r for r in steps if "replica_join_seconds" in r]
        assert len(joined) == 1 and 0 < joined[0]["replica_join_seconds"] < 300, joined
        assert any(r["rollout_replicas_working"] == 2 for r in steps)
        # lost, then rebuilt in its slot: a recovery (not a second join), counted as a replacement
        assert "killed" in left, "no step ever ran on two replicas"
        rebuilt = [r for r in steps if "replica_recovery_seconds" in r]
        assert len(rebuilt) == 1 and rebuilt[0]["step"] > joined[0]["step"], (joined, rebuilt)
        assert "at_step" in left, "the rebuilt replica never took work"
        alone = [r["step"] for r in steps if joined[0]["step"] < r["step"] < rebuilt[0]["step"]
                 and r["rollout_replicas_working"] == 1]
        assert alone, "no step ran on the surviving replica alone while the lost one was rebuilt"
        assert trainer_group.hosts[0] is trainer_host  # the trainer was never rebuilt

        # left: the real preStop command was answered once the controller released pod 1, and nothing was rebuilt
        assert left["rc"] == 0 and "left pool p1: the controller released its replicas" in left["said"], left
        assert steps[-1]["rollout_replicas_left_total"] == 1
        assert steps[-1]["rollout_replicas_added_total"] == 1
        assert steps[-1]["rollout_replicas_replaced_total"] == 1
        assert steps[-1]["rollout_replicas_working"] == 1 and steps[-1]["rollout_replicas"] == 1
        assert w.replicas.working() == [0] and rollout_group.hosts[0] is first
        assert rollout_group.pool.slots == [0]  # pod 1's placement group given back, slot 1 not grown into again
        assert rollout_group.hosts[1] is not left["killed"]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(rollout_group.hosts[1].node_address.remote(), timeout=30)
        print(f"grown replica took work {joined[0]['replica_join_seconds']:.1f} s after its slot was seen (step "
              f"{joined[0]['step']}); rebuilt after its loss in {rebuilt[0]['replica_recovery_seconds']:.1f} s "
              f"(prompts generated again: {steps[-1]['regenerated_prompts_total']:.0f}); pod 1 given notice after "
              f"step {left['at_step']}, released in {left['seconds']:.1f} s")

        assert_each_draw_trained_once(job, STEPS)  # no trajectory lost or trained twice

        # the replica that stayed holds the trainer's final weights
        rollout, actor = w.replicas.handle([0]), w.roles["actor"]
        trainer = actor.weight_checksums_as(rollout.generation_dtype_name())[0]
        assert rollout.weight_checksums() == [trainer]
        assert rollout.policy_version() == [STEPS]

        # the last replica lost during a sync: no replica left, the sync is kept for the rebuilt one, which takes
        # the version it missed before an evaluation would use it (settle); the trainer is the same process
        ray.kill(rollout_group.hosts[0], no_restart=True)
        assert w.sync_weights(STEPS + 1)["rollout_policy_version"] == STEPS + 1 and w.replicas.working() == []
        w.weights.settle()
        assert rollout_group.hosts[0] is not first and w.replicas.working() == [0]
        assert rollout.policy_version() == [STEPS + 1]
        assert rollout.weight_checksums() == [trainer]  # no update since: the same weights, a new version
        assert trainer_group.hosts[0] is trainer_host
    finally:
        w.shutdown()
