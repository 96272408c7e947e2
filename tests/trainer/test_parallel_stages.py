"""Stages that do not depend on each other run at the same time when their roles live on different resource pools,
and take turns when colocated; each stage's seconds are measured either way (real Ray, FSDP2 workers, HF rollout)."""
import time
from pathlib import Path

import pytest
from support.paths import ROOT

from hybridflow.trainer import setup, task as tasks
from hybridflow.trainer.step import AlgorithmState, Step, skipped_stages
from hybridflow.models.builders import materialize
from hybridflow.api import load_job, parse_job, dump_job

pytestmark = pytest.mark.slow


def _job(tmp_path: Path, separate_pools: bool):
    doc = dump_job(load_job(ROOT / "examples" / "tiny-grpo.yaml"))
    s = doc["spec"]
    s["rollout"]["engine"] = "hf"
    s["training"]["onPolicyOldLogProbs"] = False  # the old_log_prob stage runs, beside the reference
    s["trainer"].update(checkpointDir=str(tmp_path / "ckpt"), promptsPerStep=64)
    # A deeper model than the example's, so each stage takes long enough to measure.
    s["models"]["actor"]["tiny"].update(numLayers=6, hiddenSize=128, intermediateSize=512)
    if separate_pools:
        s["resourcePools"] = [{"name": "default", "devicesPerNode": 1}, {"name": "ref", "devicesPerNode": 1}]
        s["placement"] = {"reference": "ref"}
    else:
        s["resourcePools"] = [{"name": "default", "devicesPerNode": 1}]
    return parse_job(doc)


@pytest.mark.parametrize("separate_pools", [True, False], ids=["two-pools", "colocated"])
def test_independent_stages_overlap_across_pools(tmp_path, model_cache, local_ray, separate_pools):
    job = _job(tmp_path, separate_pools)
    model_dir = materialize(job.spec.models.actor, model_cache, job.spec.trainer.seed)
    task = tasks.build_task(job, model_dir)
    local_ray(job)
    w = setup.build_workers(job, model_dir, task, None, None)
    try:
        assert (w.pools["reference"] != w.pools["actor"]) == separate_pools
        step = Step(job.spec, w.roles, w.pools, task.reward.scorers(), AlgorithmState.for_spec(job.spec),
                    w.rollouts(lambda: tasks.prompt_batch(task.train[:64]), task.stop_token_ids),
                    skipped_stages(job.spec))
        rollout = step.generate(tasks.prompt_batch(task.train[:64]))
        step.compute(rollout, "old_log_prob", "reference")  # warm-up: first calls pay one-off costs
        walls, sums = [], []
        for _ in range(3):
            step.clock.seconds.clear()
            t0 = time.perf_counter()
            out = step.compute(rollout, "old_log_prob", "reference")
            walls.append(time.perf_counter() - t0)
            sums.append(step.clock.seconds["old_log_prob"] + step.clock.seconds["reference"])
            assert step.clock.seconds["old_log_prob"] > 0 and step.clock.seconds["reference"] > 0
        assert "old_log_probs" in out and "ref_log_probs" in out
        wall, total = min(walls), min(sums)
        print(f"{'two pools' if separate_pools else 'colocated'}: {wall:.3f}s wall, stages sum to {total:.3f}s")
        if separate_pools:
            assert wall < 0.8 * total, f"no overlap: {wall:.3f}s wall for {total:.3f}s of stages"
        else:  # taking turns: the stage times add up to the wall time, nothing counted twice
            assert total <= wall * 1.05, f"stages {total:.3f}s exceed the wall time {wall:.3f}s"
            assert total >= wall * 0.7, f"stages {total:.3f}s miss most of the wall time {wall:.3f}s"
    finally:
        w.shutdown()
