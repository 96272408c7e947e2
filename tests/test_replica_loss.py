"""A rollout replica lost during an async job is replaced alone (issue 29, item 1; trainer.replicas), on real parts:
the async example with two vLLM rollout replicas in the shared Ray, one of them killed (its Ray actor, as a lost
pod looks to the controller) once step 2 is logged. Training goes on: fit() runs to the end without a whole-job
recovery (it would raise: no Recoveries is given), the trainer's process is the one it started with, every step
runs once, every prompt group drawn is trained exactly once (what the lost replica was generating is generated again),
the replacement takes work only after its weights were checked, and the job ends with both replicas holding the
trainer's weights. Then a replica is lost during a weight sync: the sync reaches the other one; then that one too: the
sync is kept for the rebuilt ones, which are given the version they missed."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import ray
import yaml

from hybridflow.api import parse_job
from hybridflow.models.builders import materialize
from hybridflow.trainer import setup
from support.live_jobs import assert_each_draw_trained_once, fit_while

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
STEPS = 80  # ~0.45 s each here (AVX2): ~35 s after the kill, twice what the replacement took to build (13-19 s)
KILL_AFTER_STEP = 2


def _job(tmp_path: Path):
    """examples/tiny-async.yaml on two rollout replicas (shared Ray pool p1: 2 devices); staleness
    unbounded so that no group is dropped and every prompt drawn must be trained."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async.yaml").read_text())
    spec = doc["spec"]
    spec["resourcePools"] = [{"name": "trainer", "devicesPerNode": 1}, {"name": "p1", "devicesPerNode": 2}]
    spec["placement"] = {"actor": "trainer", "rollout": "p1"}
    spec["rollout"]["maxStaleness"] = 1024
    spec["trainer"].update(steps=STEPS, checkpointDir=str(tmp_path / "run"), rolloutLog=True, saveFreq=0)
    spec["metrics"]["port"] = 0
    return parse_job(doc)


def _kill_after(steps_log: Path, step: int, host, done: threading.Event, killed: list[float]) -> None:
    while not done.is_set():
        lines = steps_log.read_text().splitlines() if steps_log.exists() else []
        if len(lines) >= step:
            ray.kill(host, no_restart=True)
            killed.append(time.perf_counter())
            return
        time.sleep(0.02)


def test_a_lost_rollout_replica_is_replaced_while_training_goes_on(tmp_path, model_cache, shared_ray):
    job = _job(tmp_path)
    model_dir = materialize(job.spec.models.actor, model_cache, job.spec.trainer.seed)
    task = setup.build_task(job, model_dir)
    shared_ray.check_fits(job)
    w = setup.build_workers(job, model_dir, task, None, None)
    killed = []
    try:
        rollout_group = next(g for g in w.groups if "rollout" in g.roles)
        trainer_group = next(g for g in w.groups if "actor" in g.roles)
        trainer_host, lost_host = trainer_group.hosts[0], rollout_group.hosts[1]
        engines = w.roles["rollout"].instance_id()
        steps_log = Path(job.spec.trainer.checkpoint_dir) / "steps.jsonl"
        summary = fit_while(job, w, task, lambda done: _kill_after(steps_log, KILL_AFTER_STEP, lost_host, done, killed))
        assert killed, "the replica was never killed"
        assert summary.steps_done == STEPS
        steps = [json.loads(line) for line in steps_log.read_text().splitlines()]
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # each once, none again after the loss
        assert trainer_group.hosts[0] is trainer_host  # the trainer was never rebuilt
        assert ray.get(trainer_host.node_address.remote())

        # the replacement: rank 1 is a new engine, rank 0 the one the job started with; it took work again
        assert rollout_group.hosts[1] is not lost_host
        now = w.roles["rollout"].instance_id()
        assert now[0] == engines[0] and now[1] != engines[1], (engines, now)
        assert steps[-1]["rollout_replicas_replaced_total"] == 1
        rejoined = [r for r in steps if "replica_recovery_seconds" in r]
        assert len(rejoined) == 1 and rejoined[0]["step"] > KILL_AFTER_STEP, [r["step"] for r in rejoined]
        assert 0 < rejoined[0]["replica_recovery_seconds"] < 300
        assert any(r["rollout_replicas_working"] == 1 for r in steps), "no step ran on the surviving replica alone"
        assert steps[-1]["rollout_replicas_working"] == 2
        print(f"replica lost after step {KILL_AFTER_STEP}, took work again at step {rejoined[0]['step']}, "
              f"{rejoined[0]['replica_recovery_seconds']:.1f} s after the loss; prompts generated again: "
              f"{steps[-1]['regenerated_prompts_total']:.0f}")

        assert_each_draw_trained_once(job, STEPS)  # no trajectory lost or trained twice

        # both replicas hold the trainer's final weights
        rollout, actor = w.roles["rollout"], w.roles["actor"]
        assert rollout.policy_version() == [STEPS, STEPS]
        trainer = actor.weight_checksums_as(rollout.generation_dtype_name())[0]
        assert rollout.weight_checksums() == [trainer, trainer]

        # a replica lost during a sync: the sync goes to the other one, the lost one is rebuilt and takes the
        # version it missed before the job evaluates with it (settle); the trainer is the same process throughout
        first = rollout_group.hosts[1]
        ray.kill(first, no_restart=True)
        stats = w.sync_weights(STEPS + 1)
        assert stats["rollout_policy_version"] == STEPS + 1 and w.replicas.working() == [0]
        # and the other one too, before the first is back: no replica left, the sync is kept for the rebuilt ones
        second = rollout_group.hosts[0]
        ray.kill(second, no_restart=True)
        assert w.sync_weights(STEPS + 2)["rollout_policy_version"] == STEPS + 2 and w.replicas.working() == []
        w.weights.settle()
        assert rollout_group.hosts[1] is not first and rollout_group.hosts[0] is not second
        assert w.replicas.working() == [0, 1]
        assert rollout.policy_version() == [STEPS + 2, STEPS + 2]
        assert rollout.weight_checksums() == [trainer, trainer]  # no update since: the same weights, new versions
        assert trainer_group.hosts[0] is trainer_host
    finally:
        w.shutdown()
