"""The MFU's pieces: the measured matmul peak (the best of a few windows, so other work on the machine does not
lower the ceiling), the actor's peak measured at its first update rather than at start, and the job's MFU pooled
over the ranks (FLOP/s over peak, each summed) rather than a mean of the ranks' ratios."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hybridflow import flops
from hybridflow.flops import matmul_peak_flops, pooled_mfu
from hybridflow.single_controller.context import WorkerContext
from support.tiny_actor import P, R, ragged_batch


def test_the_peak_is_the_best_window_not_the_first(monkeypatch):
    """A window slowed by other work (here the first, as a rank still loading beside another would slow it) reads
    low; the peak is the fastest window's rate."""
    steps = itertools.chain([0.1] * 3, itertools.repeat(0.01))  # seconds between clock reads: slow, then fast
    now = itertools.accumulate(steps)
    monkeypatch.setattr(flops, "perf_counter", lambda: next(now))
    size = 16
    # 100 matmuls a second once the clock runs fast: 2 size^3 FLOPs each
    assert matmul_peak_flops(torch.float32, size=size, seconds=0.1) == pytest.approx(2.0 * size**3 * 100, rel=0.1)


def test_a_window_of_one_slow_call_is_still_a_rate(monkeypatch):
    now = itertools.count(0.0, 2.0)  # every call takes 2 s, far over the window: one call, not three
    monkeypatch.setattr(flops, "perf_counter", lambda: next(now))
    calls = []
    assert flops.calls_per_second(lambda: calls.append(1), 0.1) == pytest.approx(0.5)
    assert len(calls) == 1


def test_the_jobs_mfu_is_total_flops_over_total_peak():
    """One rank's peak read at a quarter of the other's: the mean of the ratios (0.5 and 2.0) says 1.25, more than
    the machine can do; the ranks' 100 FLOP/s of 125 say 0.8."""
    from hybridflow.trainer.step import mean_stats

    ranks = [{"update_flops_per_s": 50.0, "peak_flops": 100.0, "mfu": 0.5},
             {"update_flops_per_s": 50.0, "peak_flops": 25.0, "mfu": 2.0}]
    stats = mean_stats(ranks, "")
    assert stats["mfu"] == pytest.approx(0.8)
    assert stats["update_flops_per_s"] == 50.0 and stats["peak_flops"] == 62.5  # the rest stay per-rank means
    assert mean_stats(ranks, "critic_")["critic_mfu"] == pytest.approx(0.8)
    assert pooled_mfu([{"loss": 1.0}]) is None and "mfu" not in mean_stats([{"loss": 1.0}], "")


def test_the_actor_measures_its_peak_at_its_first_update(one_rank, tiny_dir, monkeypatch):
    """Not at start, where another rank may still be loading or starting generation: once, at the first update,
    and each update reports it beside its FLOP/s."""
    from hybridflow.api import parse_job
    from hybridflow.roles import actor
    from hybridflow.roles.config import actor_config

    measured = []
    monkeypatch.setattr(actor, "matmul_peak_flops", lambda *a, **k: measured.append(a) or 1e12)
    job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                     "spec": {"rollout": {"engine": "hf", "maxPromptLength": P, "maxResponseLength": R},
                              "training": {"microBatchSize": 3, "computeDtype": "float32"},
                              "trainer": {"promptsPerStep": 8}}})
    worker = actor.ActorWorker(WorkerContext(0, 1, 0, "cpu"), actor_config(job.spec), str(tiny_dir))
    assert measured == []
    batch = ragged_batch()
    batch.non_tensors["uid"] = np.arange(len(batch))
    for _ in range(2):
        stats = worker.update_actor(batch)
    assert measured == [(torch.float32, "cpu")]
    assert stats["peak_flops"] == 1e12 and stats["mfu"] == pytest.approx(stats["update_flops_per_s"] / 1e12)
    # one rank of each model-parallel replica answers (a TP x PP = 2 layout: world 2, one data-parallel rank): its
    # FLOP/s are the replica's, so its peak is both ranks'
    from hybridflow.single_controller.protocol import DPRank

    worker.ctx, worker._dp_rank = WorkerContext(0, 2, 0, "cpu"), DPRank(0, 1, True)
    stats = worker.update_actor(batch)
    assert stats["peak_flops"] == 2e12 and stats["mfu"] == pytest.approx(stats["update_flops_per_s"] / 2e12)
