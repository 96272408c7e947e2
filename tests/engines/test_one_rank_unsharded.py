"""One rank computing in its weights' dtype trains a plain module, not an FSDP2 one (api.training.fsdp_unsharded;
issue 57): there is nothing to shard, gather, reduce or cast there, and FSDP2's per-layer copies cost time and, with
the weights kept gathered, a model's worth of memory. What a step computes does not change: in float64 on a real tiny
HF model, in several micro-batches, the plain module's losses, gradient norm, gradients, weights after the step and
log-probs equal FSDP2's on the same rank."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from hybridflow.api.training import fsdp_unsharded
from hybridflow.engines.train import fsdp
from hybridflow.engines.train.fsdp import FSDPEngine, load_hf_model
from support.gradients import gradients_at_step
from support.tiny_actor import masked_log_probs, ragged_batch

MICRO = 2  # rows per micro-batch: the 8 rows in 4, so gradients accumulate


def _step(model_dir) -> dict:
    engine = FSDPEngine(load_hf_model(model_dir, "float64"), 1e-2, 1e9, "cpu", compute_dtype=torch.float64)

    def loss_fn(model, mb):
        logp, _ = engine.log_probs(model, mb, 1.0)
        mask = mb["response_mask"].double()
        loss = -(logp * mb["advantages"] * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"loss": loss.item()}

    batch = ragged_batch()
    batch = batch.with_columns(advantages=batch["advantages"].double())
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t.clone()  # noqa: E731
    with gradients_at_step(engine.optimizer, engine.module.named_parameters, whole) as grads:
        stats = engine.train_mini_batch(batch, MICRO, loss_fn)
    return {"sharded": engine.sharded, "stats": stats, "log_probs": masked_log_probs(engine, batch, MICRO),
            "grads": grads,
            "params": dict(engine.full_params()),
            "dtensors": any(isinstance(p, DTensor) for p in engine.module.parameters())}


def test_one_rank_in_its_weights_dtype_trains_unsharded_and_takes_fsdps_step(one_rank, tiny_dir, monkeypatch):
    plain = _step(tiny_dir)
    monkeypatch.setattr(fsdp, "fsdp_unsharded", lambda *a: False)  # FSDP2 on the same rank, for comparison
    sharded = _step(tiny_dir)
    assert (plain["sharded"], plain["dtensors"]) == (False, False)
    assert (sharded["sharded"], sharded["dtensors"]) == (True, True)
    assert plain["stats"]["loss"] == pytest.approx(sharded["stats"]["loss"], rel=1e-12)  # the same forward
    # FSDP2 reduces gradients in fp32 (its reduce dtype) even on one rank: the float64 module's are exact, FSDP2's
    # rounded to fp32, hence fp32's tolerance from here on
    assert plain["stats"]["grad_norm"] == pytest.approx(sharded["stats"]["grad_norm"], rel=1e-6)
    for name, g in sharded["grads"].items():
        torch.testing.assert_close(plain["grads"][name], g, rtol=1e-6, atol=1e-9, msg=name)
        # AdamW's first step moves each weight by about lr x sign(gradient): a gradient near its epsilon turns fp32
        # rounding into ~1e-6 here
        torch.testing.assert_close(plain["params"][name], sharded["params"][name], rtol=0, atol=1e-4, msg=name)
    torch.testing.assert_close(plain["log_probs"], sharded["log_probs"], rtol=1e-4, atol=1e-5)

def test_fsdp_stays_where_it_shards_or_casts():
    assert fsdp_unsharded(1, {"float32"}, "float32")  # one AVX2 rank: fp32 masters computing in fp32
    assert not fsdp_unsharded(2, {"float32"}, "float32")  # two ranks: the shards are the point
    assert not fsdp_unsharded(1, {"float32"}, "bfloat16")  # FSDP2's mixed precision casts each layer
    assert not fsdp_unsharded(1, {"bfloat16", "float32"}, "bfloat16")  # LoRA's fp32 adapters on a bf16 base
