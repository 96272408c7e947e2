"""bench/throughput.py's runs and tables (no job runs): `--ablate lora` runs the same job with and without
spec.training.lora, and its table carries the weight sync's bytes and what a rank holds by design with LoRA."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from hybridflow.api import parse_job

from support.paths import ROOT


def _load():
    spec = importlib.util.spec_from_file_location("bench_throughput", ROOT / "bench" / "throughput.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


tp = _load()
# SmolLM2-135M at rank 16 on every projection (hidden 576, k/v width 192, intermediate 1536, 30 layers):
# 30 x 16 x (2 x (576 + 576) + 2 x (576 + 192) + 3 x (576 + 1536)) = 4,884,480 adapter parameters
SMOLLM2_LORA_16 = 4_884_480


def test_ablate_lora_runs_the_same_job_with_and_without_lora():
    runs = tp.variants(each=False, gpu=False, ablate=["lora"])
    assert list(runs) == ["defaults", "with lora"]
    base, lora = (parse_job(doc).spec for doc in runs.values())
    assert base.training.lora is None and (lora.training.lora.rank, lora.training.lora.alpha) == (16, 32)
    # LoRA's learning rate, the only other change
    assert lora.training.actor_lr == pytest.approx(10 * base.training.actor_lr)
    same = {"training": {"lora", "actor_lr"}}
    for section in ("algorithm", "models", "data", "rollout", "training", "trainer"):
        left = getattr(base, section).model_dump(exclude=same.get(section, set()))
        assert left == getattr(lora, section).model_dump(exclude=same.get(section, set())), section
    assert "with lora" not in tp.variants(False, False, [])  # a feature runs only when named
    with pytest.raises(SystemExit, match="no optimisation or feature \\['loar'\\]"):
        tp.variants(False, False, ["loar"])


def test_the_table_has_the_sync_bytes_and_a_lora_ranks_parts():
    steps = [{"throughput_tokens_per_s": 10.0 * i, "iteration_seconds": 1.0, "tokens": 100, "mfu": 0.1,
              "stages": {"actor_update": 1.0, "old_log_prob": 0.5}, "actor_peak_memory_bytes": 1e9,
              "actor_peak_memory_bytes_total": 2e9, "reward_mean": 0.5, "generation_weight_bytes": 9.8e6 * i,
              "reshard_bytes": 0.0} for i in (1, 2, 3)]
    row = tp.summarise(steps, "float32", {"float32": 1e9}, 1000, 2)
    assert row["sync MB into generation (max rank)"] == pytest.approx(9.8 * 2.5)  # median of steps 2..3
    assert row["sync MB gathered (mean rank)"] == 0.0
    runs = tp.variants(False, False, ["lora"])
    full = tp.rank_memory_parts(runs["defaults"], "float32")
    lora = tp.rank_memory_parts(runs["with lora"], "float32")
    assert full["fp32 weight shard"] == pytest.approx(tp.SMOLLM2_PARAMS * 4 / 2 / 1e9) and "frozen base" not in full
    assert lora["fp32 weight shard"] == pytest.approx(SMOLLM2_LORA_16 * 4 / 2 / 1e9)
    assert lora["AdamW moments"] == pytest.approx(SMOLLM2_LORA_16 * 8 / 2 / 1e9)
    assert lora["frozen base"] == pytest.approx(tp.SMOLLM2_PARAMS * 4 / 2 / 1e9)  # fp32 compute: the base in fp32


def test_ablate_one_rank_runs_the_same_cores_as_one_rank_and_counts_its_whole_model():
    runs = tp.variants(False, False, ["one rank"])
    assert list(runs) == ["defaults", "with one rank"]
    base, one = (parse_job(doc).spec.resource_pools[0] for doc in runs.values())
    assert (base.devices_per_node, base.cpus_per_device) == (2, 1)
    assert (one.devices_per_node, one.cpus_per_device) == (1, 2)
    assert tp.pool_shape(runs["defaults"]) == (2, 2) and tp.pool_shape(runs["with one rank"]) == (1, 2)
    whole = tp.rank_memory_parts(runs["with one rank"], "float32")
    assert whole["fp32 weight shard"] == pytest.approx(tp.SMOLLM2_PARAMS * 4 / 1e9)  # one rank holds all of it


def test_ablate_one_rank_kept_gathered_is_one_rank_with_both_fsdp_switches_forced_on():
    runs = tp.variants(False, False, ["one rank", "one rank kept gathered"])
    one, kept = (parse_job(runs[f"with {n}"]).spec for n in ("one rank", "one rank kept gathered"))
    assert tp.pool_shape(runs["with one rank kept gathered"]) == (1, 2)
    assert (one.training.keep_gathered_for_backward, one.training.reduce_gradients_per_step) == ("auto", "auto")
    assert (kept.training.keep_gathered_for_backward, kept.training.reduce_gradients_per_step) == ("on", "on")


def test_ablate_fp32_attention_backward_runs_the_defaults_beside_the_bf16_backward():
    runs = tp.variants(False, False, ["fp32 attention backward"])
    assert [parse_job(doc).spec.training.fp32_attention_backward for doc in runs.values()] == ["auto", "off"]
