"""Asynchronous RL (issue 26) on real parts: examples/tiny-async.yaml, rollout on a pool of its own (one trainer
rank, one vLLM rollout rank, weights streamed between them over gloo), in `async` (maxStaleness 2, partial rollouts,
a queue deep enough that groups age past the bound); `one_step_off` in test_one_step_off.py. One 40-step run in
the shared Ray, shared by the tests below: it learns to the synchronous example's thresholds (test_end_to_end), its
trajectory log proves the staleness bound, after the last sync the rollout engine holds the trainer's weights and
generates what HF generates with them, and a killed trainer is a named error, not a hang."""
from __future__ import annotations

import re
import time

import pytest
import ray

from support.async_runs import (MAX_STALENESS, SYNC_TIMEOUT_S, assert_learned, async_example_job, rollout_log,
                                run_example, step_log)
from support.hf_greedy import assert_greedy_matches_hf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, model_cache, shared_ray):
    run = run_example(async_example_job(tmp_path_factory.mktemp("async"), "async"), model_cache, shared_ray)
    try:
        yield run
    finally:
        run.w.shutdown()


def test_it_learns_to_the_synchronous_examples_thresholds(async_run):
    """Held-out reward after 40 steps at least LEARNED_MIN, up by at least LEARNED_GAIN: what the synchronous,
    colocated example must reach in test_end_to_end (measured: sync on two pools 0.92, async with maxStaleness 2
    0.87-0.88)."""
    assert_learned(async_run.summary)


def test_the_trajectory_log_proves_the_staleness_bound(async_run):
    """No trained token is older than maxStaleness versions; the bound is reached (the queue holds older groups,
    which are dropped and counted), and partial rollouts mix versions within a response, newest last."""
    job = async_run.job
    log = rollout_log(job)
    assert len(log) == 40 * job.spec.trainer.prompts_per_step * job.spec.rollout.responses_per_prompt
    for r in log:
        versions = r["token_versions"]
        assert versions, r
        assert r["trainer_version"] - min(versions) <= MAX_STALENESS, r
        assert r["staleness"] == r["trainer_version"] - min(versions)
        assert versions == sorted(versions) and max(versions) <= r["trainer_version"], r
    assert max(r["staleness"] for r in log) == MAX_STALENESS
    assert sum(len(set(r["token_versions"])) > 1 for r in log) > len(log) // 10  # partial rollouts
    steps = step_log(job)
    assert steps[-1]["dropped_stale_total"] > 0
    assert all(r["staleness_max"] <= MAX_STALENESS for r in steps)
    assert 0 < max(r["queue_depth"] for r in steps) <= 128


def test_after_the_last_sync_the_rollout_holds_the_trainers_weights(async_run):
    """The rollout engine (the same one, updated in place 40 times over the stream) sums to the trainer's weights
    cast to its dtype, and its greedy responses equal HF's on the trainer's exported weights."""
    job, w = async_run.job, async_run.w
    rollout, actor = w.roles["rollout"], w.roles["actor"]
    assert rollout.policy_version() == [40]
    assert rollout.instance_id() == async_run.engines
    trainer = actor.weight_checksums_as(rollout.generation_dtype_name())[0]
    assert rollout.weight_checksums() == [trainer]
    steps = step_log(job)
    assert all(r["weight_sync_bytes"] > 0 and r["weight_sync_seconds"] > 0 for r in steps)
    assert_greedy_matches_hf(job, w, async_run.task, async_run.model_dir, step=40)


def test_a_killed_trainer_is_a_named_error_within_the_timeout(async_run):
    """Last (it kills the trainer): the rollout rank waiting for a version from a trainer that died says so, naming
    it, well within weightSyncTimeoutSeconds plus a margin, instead of hanging."""
    w = async_run.w
    trainer_group = next(g for g in w.groups if "actor" in g.roles)
    ray.kill(trainer_group.hosts[0], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        w.sync_weights(41)
    took = time.monotonic() - t0
    # Which bucket it names depends on whether the kill landed before or during the send (ray.kill is asynchronous).
    assert re.search(r"sender trainer rank 0 did not send bucket \d+", str(err.value)), err.value
    assert "[waiting for policy version 41]" in str(err.value), err.value
    assert took < SYNC_TIMEOUT_S + 20, took
