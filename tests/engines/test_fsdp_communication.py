"""FSDP's communication switches (spec.training.keepGatheredForBackward, reduceGradientsPerStep; issue 57) change how
often the ranks gather weights and reduce gradients, never what a step computes: on two real gloo ranks, in float64
on a real tiny HF model, an update in several micro-batches with both switches on makes the same losses, gradient
norm, weights and log-probs as the plain one, and a forward pass without backward leaves every layer back in its
shard (the generation engine comes next). `auto` is on for CPU pools and off on GPUs."""
from __future__ import annotations

import torch

from hybridflow.api.training import fsdp_switch_on
from hybridflow.engines.train.fsdp import FSDPEngine, load_hf_model
from support.gradients import gradients_at_step
from support.rank_process import gloo_ranks
from support.tiny_actor import masked_log_probs, ragged_batch, token_mean_policy_loss

MICRO = 1  # rows per micro-batch: each rank's 4 rows in 4 micro-batches, so accumulation and deferral both happen


def _run(model_dir: str, keep: bool, reduce: bool) -> dict:
    engine = FSDPEngine(load_hf_model(model_dir, "float64"), 1e-2, 1e9, "cpu", compute_dtype=torch.float64,
                        keep_gathered=keep, reduce_per_step=reduce)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = ragged_batch()
    batch = batch.with_columns(advantages=batch["advantages"].double()).index(torch.arange(rank, len(batch), world))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            gradients_at_step(engine.optimizer, engine.module.named_parameters, lambda g: g.full_tensor()) as grads:
        stats = engine.train_mini_batch(batch, MICRO, token_mean_policy_loss(engine))
    calls = {e.key: e.count for e in prof.key_averages()}
    layers = engine.module.model.layers
    seen = []  # while the last layer runs a forward without backward, whether the first is back in its shard
    hook = layers[-1].register_forward_pre_hook(
        lambda *_: seen.append(type(layers[0].self_attn.q_proj.weight).__name__ == "DTensor"))
    logp = masked_log_probs(engine, batch, MICRO)
    hook.remove()
    sharded = all(type(p).__name__ == "DTensor" for p in engine.module.parameters())
    return {"stats": stats, "log_probs": logp, "grads": grads, "resharded_during_forward": all(seen) and seen != [], "reductions": calls.get("c10d::_reduce_scatter_base_", 0),
            "gathers": calls.get("c10d::_allgather_base_", 0), "params": dict(engine.full_params()), "sharded_after_forward": sharded}


def _both(model_dir: str) -> dict:
    return {"plain": _run(model_dir, False, False), "both": _run(model_dir, True, True)}


def test_fewer_gathers_and_one_reduction_per_step_compute_the_same_update(tiny_dir, tmp_path):
    for runs in gloo_ranks(_both, tmp_path, str(tiny_dir)):
        plain, both = runs["plain"], runs["both"]
        assert plain["stats"]["grad_norm"] > 0
        # 4 micro-batches over 3 FSDP units (2 layers, the root): a reduction per unit per micro-batch, or per step;
        # a gather per unit for each forward and each backward, or one per unit per optimizer step
        assert (plain["reductions"], both["reductions"]) == (12, 3)
        assert (plain["gathers"], both["gathers"]) == (24, 3)
        # the gradients are reduced in fp32 (FSDP's reduce dtype) either way, in another order: fp32 rounding apart
        torch.testing.assert_close(both["stats"]["grad_norm"], plain["stats"]["grad_norm"], rtol=1e-5, atol=0)
        torch.testing.assert_close(both["stats"]["loss"], plain["stats"]["loss"], rtol=1e-9, atol=1e-12)
        assert set(both["grads"]) == set(plain["grads"]) == set(both["params"]) == set(plain["params"])
        for name, g in plain["grads"].items():  # fp32 rounding of the largest entry (measured: 1.3e-7 of it)
            torch.testing.assert_close(both["grads"][name], g, rtol=0, atol=1e-6 * float(g.abs().max()), msg=name)
            # AdamW's first step moves each weight by about lr x sign(gradient): a gradient near its epsilon turns
            # fp32 rounding into ~3e-6 here, a gradient of another sign into 2e-2
            torch.testing.assert_close(both["params"][name], plain["params"][name], rtol=0, atol=1e-4, msg=name)
        torch.testing.assert_close(both["log_probs"], plain["log_probs"], rtol=1e-5, atol=1e-7)
        assert both["sharded_after_forward"] and plain["sharded_after_forward"]
        # a forward without backward holds two gathered layers at a time, not the whole model, either way
        assert both["resharded_during_forward"] and plain["resharded_during_forward"]


def test_auto_switches_on_for_cpu_pools_of_several_ranks_and_off_on_one_rank_and_gpus():
    assert fsdp_switch_on("auto", "cpu", 2) and not fsdp_switch_on("auto", "gpu", 2)
    assert not fsdp_switch_on("auto", "cpu", 1)  # one rank: nothing to gather, a model's worth of memory to lose
    assert fsdp_switch_on("on", "gpu", 2) and fsdp_switch_on("on", "cpu", 1) and not fsdp_switch_on("off", "cpu", 2)
