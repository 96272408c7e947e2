"""spec.trainer.profileSteps (issue 57): a stage's time by kind of op, from torch's real profiler. The kinds come from
the op names the profiler records (the ones a CPU update, vLLM's CPU generation and FSDP's collectives produce);
what no op covers is reported too; the statistics a role returns become a table in the log and in bench/."""
from __future__ import annotations

import pytest
import torch

from hybridflow.api import parse_job
from hybridflow.profiling import (
    OTHER, OUTSIDE, format_table, op_kind, profile_report, profile_tables, profiled, rank_means, seconds_by_kind,
)

# names as torch's profiler records them in a CPU update (FSDP2 on gloo), vLLM's CPU generation and the optimizer
KINDS_OF = {
    "aten::mm": "matmul", "aten::addmm": "matmul", "_C::onednn_mm": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "_C::cpu_attention_with_kv_cache": "attention",
    "aten::_log_softmax": "softmax", "aten::_log_softmax_backward_data": "softmax",
    "aten::_fused_adamw_": "optimizer", "Optimizer.step#AdamW.step": "optimizer",
    "c10d::_allgather_base_": "communication", "c10d::_reduce_scatter_base_": "communication",
    "FSDP::all_gather (model.layers.3)": "fsdp", "FSDP::post_backward_reduce": "fsdp",
    "aten::copy_": "copy_cast", "aten::_to_copy": "copy_cast", "aten::cat": "copy_cast",
    "aten::fill_": "fill_alloc", "aten::empty": "fill_alloc",
    "aten::index": "indexing", "aten::embedding_dense_backward": "indexing",
    "aten::mul": "elementwise", "aten::silu_backward": "elementwise", "aten::rsqrt": "elementwise",
    "aten::sum": "reduction", "aten::linalg_vector_norm": "reduction",
    "autograd::engine::evaluate_function: MmBackward0": "autograd", "MmBackward0": "autograd",
    "_C::fused_gumbel_argmax": OTHER, "aten::view": OTHER,
}


def test_each_op_name_has_its_kind():
    assert {name: op_kind(name) for name in KINDS_OF} == KINDS_OF


def test_seconds_add_up_by_kind_and_what_no_op_covers_is_outside():
    by_kind = seconds_by_kind([("aten::mm", 2.0), ("aten::addmm", 1.0), ("aten::mul", 0.5), ("aten::view", 0.1)], 4.0)
    assert by_kind["matmul"] == 3.0 and by_kind["elementwise"] == 0.5 and by_kind[OTHER] == 0.1
    assert by_kind[OUTSIDE] == pytest.approx(0.4)
    assert seconds_by_kind([("aten::mm", 3.0)], 2.0)[OUTSIDE] == 0.0  # ops on other threads: never negative


def test_a_profiled_block_reports_its_matmuls_and_an_unprofiled_one_nothing():
    a = torch.randn(256, 256)
    with profiled("update", False) as off:
        a @ a
    assert off == {}
    with profiled("update", True) as on:
        for _ in range(20):
            b = torch.relu(a @ a)
        b.sum()
    assert on["profile_update_matmul_s"] > 0 and on["profile_update_ops"] >= 40
    assert on["profile_update_wall_s"] >= on["profile_update_matmul_s"]
    kinds = sum(v for k, v in on.items() if k.endswith("_s") and "wall" not in k)
    assert kinds == pytest.approx(on["profile_update_wall_s"], rel=0.05)  # every second of the wall is somewhere


def test_a_steps_statistics_become_one_table_per_stage():
    stats = {"profile_update_wall_s": 10.0, "profile_update_matmul_s": 7.0, "profile_update_fsdp_s": 2.0,
             "profile_update_gpu_matmul_s": 1.0, "critic_profile_update_wall_s": 5.0, "reward_mean": 0.3,
             "profile_generate_wall_s": 4.0, "profile_generate_matmul_s": 3.0, "profile_update_ops": 100.0}
    stats["critic_profile_update_matmul_s"] = 4.0
    tables = profile_tables(stats)
    assert tables == {"update": ({"matmul": 7.0, "fsdp": 2.0}, 10.0), "update (gpu)": ({"matmul": 1.0}, 10.0),
                      "generate": ({"matmul": 3.0}, 4.0), "critic_update": ({"matmul": 4.0}, 5.0)}
    text = profile_report(stats)
    assert "| update: kind | seconds | share of 10.00 s |" in text and "| matmul | 7.000 | 70.0% |" in text
    assert "| generate: kind | seconds | share of 4.00 s |" in text
    assert text.index("| matmul | 7.000") < text.index("| fsdp | 2.000")  # largest first
    assert profile_report({"reward_mean": 0.3}) == ""
    assert format_table("update", {"matmul": 1.0, "other": 0.0}, 2.0).count("\n") == 2  # kinds with no time left out


def test_profile_steps_are_step_numbers():
    def job(steps):
        return {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "p"},
                "spec": {"trainer": {"profileSteps": steps}}}

    assert parse_job(job([2, 5])).spec.trainer.profile_steps == [2, 5]
    with pytest.raises(Exception, match="profileSteps"):
        parse_job(job([0]))


def test_a_profiler_that_cannot_start_leaves_the_work_done_and_the_profile_empty(caplog, monkeypatch):
    """A profiler that fails to start (a Kineto or CUPTI failure, which this machine cannot produce: a test double
    of torch's start raises it) costs the step its profile, said once in the log, never the step."""
    from torch.profiler import profile

    def failing_start(self):  # test double: torch's profiler start failing as a broken CUPTI makes it fail
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED (test double)")

    monkeypatch.setattr(profile, "start", failing_start)
    a = torch.randn(64, 64)
    with caplog.at_level("WARNING", logger="hybridflow.profiling"):
        with profiled("update", True) as stats:
            b = a @ a
    assert stats == {} and b.shape == (64, 64)
    assert "profile not taken: the profiler could not start (CUPTI_ERROR_NOT_INITIALIZED" in caplog.text


def test_an_error_in_the_profiled_work_is_the_error_seen():
    with pytest.raises(ZeroDivisionError):
        with profiled("update", True):
            1 / 0
    with profiled("update", True) as again:  # the profiler was stopped: a later stage profiles as before
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert again["profile_update_matmul_s"] > 0


def test_a_rank_without_a_profile_leaves_the_others_mean():
    """A rank whose profiler could not run reports no profile: the mean is the reporting ranks', not diluted."""
    per_rank = [{"profile_update_matmul_s": 2.0, "loss": 1.0}, {"loss": 3.0}]
    assert rank_means(per_rank, "profile_") == {"profile_update_matmul_s": 2.0}
    assert rank_means(per_rank) == {"profile_update_matmul_s": 2.0, "loss": 2.0}
