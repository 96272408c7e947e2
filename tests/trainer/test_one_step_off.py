"""`one_step_off` (issue 26): batch k+1 generates on the rollout pool while batch k trains. The tiny GRPO example on
one trainer rank and one vLLM rollout rank, one 40-step run (its own module: the shared Ray holds one two-pool job
at a time): it learns to the synchronous example's thresholds, and every batch after the first is exactly one
policy version old, token by token."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.async_runs import assert_learned, async_example_job, rollout_log, run_example, step_log

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_cache, shared_ray):
    done = run_example(async_example_job(tmp_path_factory.mktemp("one-step-off"), "one_step_off"), model_cache,
                       shared_ray)
    done.w.shutdown()  # the tests read its files and summary only
    return done


def test_it_learns_to_the_synchronous_examples_thresholds(run):
    """(measured: 0.85 held-out after 40 steps; sync on the same two pools 0.92)"""
    assert_learned(run.summary)


def test_every_batch_after_the_first_is_one_version_old(run):
    log = rollout_log(run.job)
    assert {r["staleness"] for r in log if r["trainer_version"] == 0} == {0}
    assert {r["staleness"] for r in log if r["trainer_version"] > 0} == {1}
    assert all(set(r["token_versions"]) == {max(0, r["trainer_version"] - 1)} for r in log)
    steps = step_log(run.job)
    assert [r["step"] for r in steps] == list(range(1, 41))
    assert all(r["rollout_policy_version"] == r["step"] for r in steps)
    assert all(r["staleness_max"] == min(1, r["step"] - 1) for r in steps)


def test_a_checkpoint_leaves_the_batch_generated_ahead_to_the_resumed_job(run):
    """At step 20 the next step's prompts are already drawn (and generating): the checkpoint's data position is the
    20 batches trained, so a job resumed from it trains the 21st instead of skipping it."""
    state = json.loads((Path(run.job.spec.trainer.checkpoint_dir) / "step_00000020" / "trainer_state.json").read_text())
    assert state["step"] == 20 and state["data_position"] == 20
