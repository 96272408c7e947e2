"""training.skipZeroAdvantageRows (issue 57: fewer FLOPs for the same step): the actor's update leaves out the rows
whose advantages are all zero and takes the same optimizer step. Real one-rank actor workers (FSDP2's engine, the
job's policy loss and aggregation) on the tiny model; the gradients the optimizer stepped on are compared, with the
rows each update actually computed."""
from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.losses import POLICY_LOSSES
from hybridflow.api import parse_job
from hybridflow.engines.train.base import InertRows
from hybridflow.engines.train.fsdp import FSDPEngine, load_hf_model
from hybridflow.roles.actor import zero_gradient_rows
from support.gradients import gradients_at_step
from support.rank_process import gloo_ranks
from support.tiny_actor import one_rank_actor, ragged_batch, ragged_batch_with_uids, token_mean_policy_loss

ZERO = [1, 3, 4]  # rows whose group scored alike: every advantage 0


def _batch(zero: list[int]):
    b = ragged_batch_with_uids()
    adv = b["advantages"].clone()
    adv[zero] = 0.0
    return b.with_columns(advantages=adv)


def _update(model_dir, batch, skip: bool, algorithm: dict):
    """One update of a fresh actor: its statistics, the gradients it stepped on, the rows its forwards computed."""
    actor = one_rank_actor(model_dir, algorithm, {"skipZeroAdvantageRows": skip})
    engine, rows = actor.engine, []
    log_probs = engine.log_probs

    def counting(model, mb, temperature):
        rows.append(len(mb))
        return log_probs(model, mb, temperature)

    engine.log_probs = counting
    with gradients_at_step(engine.optimizer, engine.module.named_parameters) as grads:
        stats = actor.update_actor(batch)
    return stats, grads, sum(rows), engine


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_update_leaves_out_zero_advantage_rows_and_steps_on_the_same_gradients(one_rank, tiny_dir, agg):
    batch = _batch(ZERO)
    full, full_grads, full_rows, _ = _update(tiny_dir, batch, False, {"lossAgg": agg})
    skip, skip_grads, skip_rows, _ = _update(tiny_dir, batch, True, {"lossAgg": agg})
    assert (full_rows, skip_rows) == (8, 5)
    assert (full["update_rows_skipped"], skip["update_rows_skipped"]) == (0.0, pytest.approx(3 / 8))
    assert skip["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5) and full["grad_norm"] > 0
    for name, g in full_grads.items():
        torch.testing.assert_close(skip_grads[name], g, rtol=1e-4, atol=1e-7, msg=name)
    # the policy loss and clip fraction are 0 on a row of zero advantage: their whole-batch values, as without
    # skipping; the entropy (observed, under the on-policy update) is the mean over the rows computed
    assert skip["pg_loss"] == pytest.approx(full["pg_loss"], rel=1e-5) and full["pg_loss"] != 0
    assert skip["clip_frac"] == full["clip_frac"]
    if agg == "token-mean":
        entropy = one_rank_actor(tiny_dir, {}).compute_log_prob(batch)["entropy"]
        mask = batch["response_mask"].bool()
        kept = torch.tensor([i not in ZERO for i in range(len(batch))])
        every, computed = float(entropy[mask].mean()), float(entropy[kept][mask[kept]].mean())
        assert abs(every - computed) > 5e-4  # the tiny model's entropies all lie near ln 32, ~1e-3 apart
        assert full["entropy_mean"] == pytest.approx(every, abs=2e-5)
        assert skip["entropy_mean"] == pytest.approx(computed, abs=2e-5)
    # the FLOP/s count the tokens computed, so the MFU does not read the rows left out as work done
    work = {run: stats["update_flops_per_s"] * stats["update_seconds"] for run, stats in (("full", full), ("skip", skip))}
    assert work["skip"] < 0.8 * work["full"]


def test_a_batch_of_only_zero_advantages_still_takes_its_optimizer_step(one_rank, tiny_dir):
    """One row runs, weighing nothing: every trained parameter gets a zero gradient and AdamW counts the step (a
    parameter without a gradient would be skipped, and its moments would not decay as the full update's do)."""
    stats, grads, rows, engine = _update(tiny_dir, _batch(list(range(8))), True, {})
    assert stats["update_rows_skipped"] == 1.0 and stats["grad_norm"] == 0.0 and rows == 1
    # the whole batch's policy loss is 0; no entropy was observed, so none is reported (not a 0 into the step's mean)
    assert stats["pg_loss"] == 0.0 and stats["clip_frac"] == 0.0 and "entropy_mean" not in stats
    assert grads and all(g is not None and not g.any() for g in grads.values())
    assert all(int(engine.optimizer.state[p]["step"]) == 1 for p in engine.trained)


def _algorithm(**fields):
    return parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                      "spec": {"algorithm": fields}}).spec.algorithm


def test_rows_are_left_out_only_under_a_loss_whose_gradient_is_a_multiple_of_the_advantage(monkeypatch):
    batch = _batch(ZERO)
    assert zero_gradient_rows(batch, _algorithm(), kl_loss=False).nonzero().flatten().tolist() == ZERO
    assert zero_gradient_rows(batch, _algorithm(policyLoss="gspo"), kl_loss=False) is not None
    assert zero_gradient_rows(batch, _algorithm(entropyCoef=0.01), kl_loss=False) is None  # the bonus has a gradient
    assert zero_gradient_rows(batch, _algorithm(), kl_loss=True) is None  # so has a KL term in the loss
    monkeypatch.setitem(POLICY_LOSSES.info("ppo"), "advantage_weighted", False)
    assert zero_gradient_rows(batch, _algorithm(), kl_loss=False) is None
    # a row is inert only where every response token's advantage is 0; padding positions do not count
    nearly = batch["advantages"].clone()
    nearly[1, 0] = 1e-30
    assert zero_gradient_rows(batch.with_columns(advantages=nearly), _algorithm(policyLoss="gspo"),
                              kl_loss=False).nonzero().flatten().tolist() == [3, 4]


# --- two FSDP ranks, one with nothing to compute ---------------------------------------------------------------------

def _full_and_skipped(model_dir: str) -> dict:
    """On one of two gloo ranks: rank 0's rows all inert, rank 1's first one. Rank 0 runs one row weighing nothing,
    padded to rank 1's count of micro-batches (every forward gathers over both ranks), with the CPU pool's switches
    on (gathered weights kept for backward, one reduction per step). Float64; the gradients the optimizer stepped
    on, whole."""
    rank = torch.distributed.get_rank()
    batch = ragged_batch()
    batch = batch.with_columns(advantages=batch["advantages"].double()).index(torch.arange(rank, len(batch), 2))
    inert = torch.tensor([True] * 4) if rank == 0 else torch.tensor([True, False, False, False])
    batch = batch.with_columns(advantages=batch["advantages"] * (~inert)[:, None])
    runs = {}
    for name, rows in (("full", None), ("skipped", inert)):
        engine = FSDPEngine(load_hf_model(model_dir, "float64"), 1e-2, 1e9, "cpu", compute_dtype=torch.float64,
                            keep_gathered=True, reduce_per_step=True)
        with gradients_at_step(engine.optimizer, engine.module.named_parameters, lambda g: g.full_tensor()) as grads:
            inert = None if rows is None else InertRows(rows, frozenset({"loss"}))  # 0 where the advantage is
            stats = engine.train_mini_batch(batch, 1, token_mean_policy_loss(engine), "tokens", inert)
        runs[name] = {"stats": stats, "grads": grads}
    return runs


def test_two_fsdp_ranks_one_with_only_zero_advantages_take_the_same_step(tiny_dir, tmp_path):
    ranks = gloo_ranks(_full_and_skipped, tmp_path, str(tiny_dir))
    for runs in ranks:
        full, skipped = runs["full"], runs["skipped"]
        assert full["stats"]["grad_norm"] > 0
        torch.testing.assert_close(skipped["stats"]["grad_norm"], full["stats"]["grad_norm"], rtol=1e-5, atol=0)
        for name, g in full["grads"].items():  # reduced in fp32 (FSDP's reduce dtype), in another order
            torch.testing.assert_close(skipped["grads"][name], g, rtol=0, atol=1e-6 * float(g.abs().max()), msg=name)
    for runs in ranks:  # each rank's loss: its whole batch's, inert rows counted as 0
        assert runs["skipped"]["stats"]["loss"] == pytest.approx(runs["full"]["stats"]["loss"], rel=1e-9, abs=1e-12)
