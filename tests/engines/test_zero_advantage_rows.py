"""training.skipZeroAdvantageRows (issue 57: fewer FLOPs for the same step): the actor's update leaves out the rows
whose advantages are all zero and takes the same optimizer step. Real one-rank actor workers (FSDP2's engine, the
job's policy loss and aggregation) on the tiny model; the gradients the optimizer stepped on are compared, with the
rows each update actually computed."""
from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.losses import POLICY_LOSSES
from hybridflow.api import parse_job
from hybridflow.roles.actor import zero_gradient_rows
from support.gradients import gradients_at_step
from support.tiny_actor import one_rank_actor, ragged_batch_with_uids

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
    # the statistics are the computed rows' means: entropy over 5 rows differs from entropy over 8, and the policy
    # loss, zero on the rows left out, is the same sum over fewer tokens (or rows)
    assert skip["entropy_mean"] != pytest.approx(full["entropy_mean"], rel=1e-6)
    mask = batch["response_mask"]
    counted = (lambda rows: float(mask[rows].sum())) if agg == "token-mean" else len  # noqa: E731
    kept = [i for i in range(len(batch)) if i not in ZERO]
    assert skip["pg_loss"] * counted(kept) == pytest.approx(full["pg_loss"] * counted(list(range(len(batch)))),
                                                            rel=1e-5)
    # the FLOP/s count the tokens computed, so the MFU does not read the rows left out as work done
    assert skip["update_flops_per_s"] * skip["update_seconds"] < 0.8 * full["update_flops_per_s"] * full["update_seconds"]


def test_a_batch_of_only_zero_advantages_still_takes_its_optimizer_step(one_rank, tiny_dir):
    """One row runs, weighing nothing: every trained parameter gets a zero gradient and AdamW counts the step (a
    parameter without a gradient would be skipped, and its moments would not decay as the full update's do)."""
    stats, grads, rows, engine = _update(tiny_dir, _batch(list(range(8))), True, {})
    assert stats["update_rows_skipped"] == 1.0 and stats["grad_norm"] == 0.0 and rows == 1
    assert "pg_loss" not in stats and "entropy_mean" not in stats  # no rows, no means: not zeros in the step's mean
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
