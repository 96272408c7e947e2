"""bench/async.py's cost model and table arithmetic (pure functions; no runs): the projection must follow its
stated formulas, an overlapped mode must never come out slower than the placement it overlaps, and the measured
rates must leave the warm-up steps out."""
from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.api import parse_job

from support.paths import ROOT


def _load():
    # "async" is a keyword: the file cannot be imported by name
    spec = importlib.util.spec_from_file_location("bench_async", ROOT / "bench" / "async.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


ab = _load()
GRID = [0.0, 0.01, 0.3, 1.0, 2.5, 40.0]


def test_overlapped_modes_never_slower_than_sync_apart_on_the_same_stage_times():
    for g, t, s in itertools.product(GRID, GRID, GRID):
        st = ab.Stages(g, t, s, swap=min(s, 0.01))
        apart = ab.FORMULAS["sync apart"](st, 2)
        one_off = ab.FORMULAS["one_step_off"](st, 2)
        asynchronous = ab.FORMULAS["async"](st, 2)
        assert one_off <= apart + 1e-12, (g, t, s)
        assert asynchronous <= one_off + 1e-12, (g, t, s)
        # overlap hides the shorter stages, never the longest: the transfer is a stage of its own
        assert asynchronous >= max(g, t, s), (g, t, s)


def test_async_without_staleness_is_sync_apart():
    st = ab.Stages(3.0, 2.0, 0.5, swap=0.1)
    assert ab.FORMULAS["async"](st, 0) == ab.FORMULAS["sync apart"](st, 0) == 5.5
    assert ab.FORMULAS["async"](st, 1) == pytest.approx(3.1)
    assert ab.FORMULAS["one_step_off"](st, 1) == pytest.approx(3.5)


def test_projection_follows_the_stated_formulas():
    w = ab.Workload(params=1e9, sequences=100, prompt_tokens=10, response_tokens=30, forward_passes=1)
    c = ab.Cluster(peak_flops=1e12, mfu=0.5, decode_tokens_per_s_per_gpu=100.0, decode_step_s=0.01,
                   reshard_bytes_per_s=1e10, link_bytes_per_s=1e9, hbm_bytes_per_s=1e11)
    tokens = 100 * 40
    st, it = ab.project("sync colocated", 8, 0.5, 2, w, c)
    assert st.train == pytest.approx(8 * 1e9 * tokens / (8 * 0.5 * 1e12))  # 6NT update + 2NT reference
    assert st.generate == pytest.approx(100 * 30 / (8 * 100.0))
    assert st.sync == pytest.approx(2e9 / 1e10)
    assert it == pytest.approx(st.generate + st.train + st.sync)
    st, it = ab.project("sync apart", 8, 0.25, 2, w, c)  # 6 trainer + 2 rollout GPUs
    assert (st.train, st.generate, st.sync) == pytest.approx((8e9 * tokens / (6 * 0.5e12), 100 * 30 / 200.0, 2.0))
    assert it == pytest.approx(st.generate + st.train + st.sync)
    off, it = ab.project("one_step_off", 8, 0.25, 2, w, c)  # + the trainer's old-log-prob pass
    assert off.train == pytest.approx(10e9 * tokens / (6 * 0.5e12))
    assert it == pytest.approx(max(off.generate, off.train) + off.sync)
    st, it = ab.project("async", 8, 0.25, 2, w, c)
    assert it == pytest.approx(max(st.generate + 2e9 / 1e11, st.train, st.sync))
    # many rollout GPUs: a response's serial decode steps are the floor
    st, _ = ab.project("sync apart", 4096, 0.5, 2, w, c)
    assert st.generate == pytest.approx(30 * 0.01)


def test_default_projection_overlap_gains_at_every_printed_size():
    for gpus in (8, 64, 512):
        apart = ab.project("sync apart", gpus, 0.5)[1]
        off_stages, one_off = ab.project("one_step_off", gpus, 0.5)
        assert one_off <= apart
        assert ab.project("async", gpus, 0.5)[1] <= one_off
        # what one_step_off pays beyond the formula on sync apart's stage times is its old-log-prob pass only
        on = ab.project("sync apart", gpus, 0.5)[0]
        assert off_stages.train - on.train == pytest.approx(on.train / 4)


def test_split_rejects_what_cannot_be_split():
    assert ab.split_gpus(8, 0.5) == (4, 4)
    assert ab.split_gpus(2, 0.99) == (1, 1)
    with pytest.raises(ValueError, match="--gpus"):
        ab.split_gpus(1, 0.5)
    with pytest.raises(ValueError, match="--rollout-share"):
        ab.split_gpus(8, 1.0)
    with pytest.raises(ValueError, match="unknown formula"):
        ab.project("two_steps_off", 8, 0.5)


def _record(step: int, it: float, apart: bool) -> dict:
    rec = {"step": step, "iteration_seconds": it, "tokens": 100.0, "reward_mean": 0.1 * step,
           "stages": {"generate": 0.5, "actor_update": 0.25, "old_log_prob": 0.125, "reshard": 0.0625},
           "reshard_bytes": 2e6, "rollout_busy_seconds": 0.75}
    if apart:
        rec.update(weight_sync_seconds=0.05, weight_sync_bytes=3e6, trainer_idle_fraction=0.4,
                   rollout_idle_fraction=0.2, staleness_mean=1.0, staleness_max=step % 3)
    return rec


def test_summary_leaves_the_warm_up_steps_out():
    records = [_record(1, 100.0, True), _record(2, 50.0, True), *(_record(s, 0.5, True) for s in range(3, 7))]
    row = ab.summarise(records, {"eval_before": 0.0, "eval_after": 0.9}, wall=30.0)
    assert row["steps/s"] == pytest.approx(2.0)  # 4 steps in 2 s: steps 1 and 2 do not count
    assert row["tokens/s"] == pytest.approx(200.0)
    assert row["train s/step"] == pytest.approx(0.375)  # every stage but generation and the weight sync
    assert row["generation s/step"] == 0.75  # the rollout side's busy time, not the trainer's wait
    assert (row["weight-sync s/sync"], row["weight-sync MB/sync"]) == (0.05, 3.0)
    assert (row["staleness max"], row["held-out reward after"]) == (2, 0.9)
    assert row["reward (last step)"] == pytest.approx(0.6)
    colocated = ab.summarise([_record(s, 1.0, False) for s in range(1, 5)], {}, wall=1.0)
    assert colocated["trainer idle fraction"] is None and colocated["staleness mean"] is None
    assert (colocated["generation s/step"], colocated["weight-sync s/sync"]) == (0.5, 0.0625)
    assert colocated["weight-sync MB/sync"] == 2.0


def test_every_mode_builds_a_valid_job_from_the_example():
    base = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    seen = set()
    for key in ab.MODES:
        job = parse_job(ab.job_doc(base, key, 5, Path("/tmp/async-bench") / key))
        s = job.spec
        apart = s.pool("rollout").name != s.pool("actor").name
        assert apart == (key != "a"), key
        assert s.trainer.steps == 5 and s.metrics.port == 0
        seen.add((s.rollout.mode, s.rollout.max_staleness if s.rollout.mode == "async" else 0,
                  s.rollout.partial_rollout_tokens, apart))
    assert len(seen) == len(ab.MODES)  # five different jobs
    assert base["spec"]["resourcePools"][0]["devicesPerNode"] == 2  # the base manifest itself is not changed
