"""The two-pool async example (examples/tiny-async.yaml: one trainer rank, one vLLM rollout rank, weights streamed
between them) run to its end in the shared Ray, and what the runs' tests read from it: shared by
tests/trainer/test_async_rollout.py (`async`) and tests/trainer/test_one_step_off.py (`one_step_off`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hybridflow.api import parse_job
from hybridflow.metrics import JobMetrics
from hybridflow.models.builders import materialize
from hybridflow.trainer import loop, setup, task as tasks
from support.learning import LEARNED_GAIN, LEARNED_MIN
from support.paths import ROOT

MAX_STALENESS = 2
SYNC_TIMEOUT_S = 10.0


def async_example_job(tmp_path: Path, mode: str):
    """The async example (one trainer rank, one rollout rank) in `mode`, its rollout log on."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async.yaml").read_text())
    spec = doc["spec"]
    assert spec["rollout"]["maxStaleness"] == MAX_STALENESS
    spec["rollout"].update(mode=mode, weightSyncTimeoutSeconds=SYNC_TIMEOUT_S)
    if mode == "async":  # partial rollouts of 2 tokens (responses are 6), and a queue of 4 steps' prompts
        spec["rollout"].update(partialRolloutTokens=2, queuePrompts=128)
        # one prompt group per micro-batch: the same update (micro-batches are weighed), done slower than the
        # rollout rank generates on any machine, so the queue fills and the staleness bound binds (with one
        # micro-batch a step, an AVX2 machine trained as fast as it generated and the bound was never reached)
        spec["training"]["microBatchSize"] = 1
    else:
        del spec["rollout"]["maxStaleness"]
    # one_step_off saves at step 20 (test_one_step_off reads its data position)
    spec["trainer"].update(checkpointDir=str(tmp_path / "run"), rolloutLog=True, saveFreq=20 if mode == "one_step_off"
                           else 0)
    spec["metrics"]["port"] = 0
    return parse_job(doc)


@dataclass
class Run:
    job: Any
    w: Any  # setup.Workers, up until the module's tests are done
    task: Any
    model_dir: Path
    summary: Any  # loop.RunSummary
    engines: list[str]  # the rollout engines' instance ids before the run


def run_example(job, model_cache, shared_ray) -> Run:
    """Workers for the job in the shared Ray, and its whole fit(); the workers stay up for the tests."""
    model_dir = materialize(job.spec.models.actor, model_cache, job.spec.trainer.seed)
    task = tasks.build_task(job, model_dir)
    shared_ray.ensure_running()
    shared_ray.check_fits(job)
    w = setup.build_workers(job, model_dir, task, None, None)
    try:
        engines = w.roles["rollout"].instance_id()
        summary = loop.fit(job, w, task, JobMetrics(job.metadata.name), progress=lambda _: None)
    except BaseException:
        w.shutdown()
        raise
    return Run(job, w, task, model_dir, summary, engines)


def rollout_log(job) -> list[dict]:
    root = Path(job.spec.trainer.checkpoint_dir) / "rollouts"
    return [json.loads(line) for f in sorted(root.glob("step_*.jsonl")) for line in f.read_text().splitlines()]


def step_log(job) -> list[dict]:
    return [json.loads(line) for line in (Path(job.spec.trainer.checkpoint_dir) / "steps.jsonl").read_text().splitlines()]


def assert_learned(summary) -> None:
    assert summary.steps_done == 40
    assert summary.eval_after.reward >= LEARNED_MIN, summary.eval_after
    assert summary.eval_after.reward - summary.eval_before.reward >= LEARNED_GAIN
