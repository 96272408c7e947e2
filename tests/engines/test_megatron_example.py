"""The 3D-HybridEngine's example with pipeline stages, run as a user runs it (`hybridflow run`'s own load, prepare
and execute, in this process on the suite's shared Ray): megatron-core trains at TP=2 x PP=2 on four CPU ranks and
generates at TP=2 in one stage on the same ranks.

It must learn as the FSDP examples do (tests/algorithms/test_algorithm_examples.py's thresholds: greedy held-out reward of at
least 0.4, a gain of at least 0.3; measured 0.000 -> 1.000 in 20 steps, twice, 50-57 s as `hybridflow run` on a
2-core AMX machine: 40 steps, as the example had, took 93 s and reached it too), and every step's transition must move the bytes of the paper's formula: a rank receives
(t*p - t_g*p_g) / (t_g*p_g*t*p) of the model, here 1/4, and holds 1/t_g of it for generation."""
import json

import pytest
import yaml
from support.paths import ROOT
from support.reshard_baselines import comm_fraction
from support.learning import EXAMPLES_LEARNED_GAIN, EXAMPLES_LEARNED_MIN

from hybridflow.checkpoint import read_step_log
from hybridflow.engines.bridge.layout import Layout

EXAMPLE = ROOT / "examples" / "tiny-grpo-megatron-pp.yaml"


@pytest.mark.slow
def test_pipeline_parallel_example_learns_and_reshards_by_the_formula(tmp_path, run_here):
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    t, p = spec["training"]["tensorParallel"], spec["training"]["pipelineParallel"]
    t_g = spec["rollout"]["tensorParallel"]
    assert (t, p, t_g) == (2, 2, 2)
    rc, printed = run_here(EXAMPLE, {"spec.trainer.checkpointDir": str(tmp_path / "run")}, cwd=tmp_path)
    assert rc == 0, printed[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_after"] >= EXAMPLES_LEARNED_MIN, summary
    assert summary["eval_after"] - summary["eval_before"] >= EXAMPLES_LEARNED_GAIN, summary
    records = read_step_log(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, spec["trainer"]["steps"] + 1))
    model_bytes = records[0]["generation_weight_bytes"] * t_g  # float32 weights, 1/t_g of them per rank
    expected = float(comm_fraction(Layout(p=p, t=t, d=1, p_g=1, t_g=t_g), "hybridflow")) * model_bytes
    for r in records:
        assert r["reshard_bytes"] == pytest.approx(expected, rel=0.02), r["step"]
        assert r["generation_weight_bytes"] * t_g == model_bytes
