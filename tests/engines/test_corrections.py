"""Off-policy corrections (issue 26, item 4): each registered correction's weights and statistics on hand-made
log-probs, the spec's offPolicyCorrection (names, defaults, the tisCap shorthand, the rules), the one accessor the
roles share, and the actor's real update (FSDP2 on a one-rank gloo group, a tiny HF model) taking the PPO ratio
against the proximal log-probs and the behaviour log-probs only in the weights."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybridflow.algorithms.corrections import OFF_POLICY_CORRECTIONS, CorrectionSettings, JobCorrection
from hybridflow.api import SpecError, Training, parse_job
from hybridflow.roles.config import off_policy_correction, old_log_probs_from_update, wants_rollout_log_probs
from support.tiny_actor import one_rank_actor, ragged_batch_with_uids

D = torch.float64
LOG = math.log


def _job(algorithm: dict, **spec) -> object:
    return parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                      "spec": {"algorithm": algorithm, **spec}})


def _pair(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Proximal and behaviour log-probs whose ratio per token is `ratios`."""
    behaviour = torch.full((len(ratios), len(ratios[0])), -2.0, dtype=D)
    return behaviour + torch.tensor([[LOG(r) for r in row] for row in ratios], dtype=D), behaviour


# --- each correction's math ------------------------------------------------------------------------------------------

def test_tis_weights_are_the_ratio_truncated_at_the_cap_and_keep_every_token():
    prox, behav = _pair([[0.5, 1.0, 1.5, 3.0], [1.2, 0.8, 40.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # the 40 is padding: no statistic may see it
    out = JobCorrection("tis", CorrectionSettings(cap=2.0))(prox, behav, mask)
    expect = [[0.5, 1.0, 1.5, 2.0], [1.2, 0.8, 2.0, 1.0]]
    torch.testing.assert_close(out.weights, torch.tensor(expect, dtype=D))
    assert not out.weights.requires_grad
    real = [0.5, 1.0, 1.5, 3.0, 1.2, 0.8]
    assert out.stats["is_ratio_mean"] == pytest.approx(np.mean(real))
    assert out.stats["is_ratio_std"] == pytest.approx(np.std(real))
    assert out.stats["is_ratio_max"] == pytest.approx(3.0) and out.stats["is_ratio_min"] == pytest.approx(0.5)
    assert out.stats["is_masked_fraction"] == 0.0


def test_tis_is_what_tiscap_computed_before():
    """The weights tisCap applied: min(exp(old - rollout), cap), detached (tests/algorithms/test_algorithms.py checks the
    function itself)."""
    old = torch.tensor([[-1.0, -0.5, -3.0]], dtype=D, requires_grad=True)
    rollout = torch.tensor([[-1.2, -0.4, -0.1]], dtype=D)
    w = JobCorrection("tis", CorrectionSettings(cap=1.1))(old, rollout, torch.ones(1, 3)).weights
    assert [float(x) for x in w[0]] == pytest.approx([min(math.exp(o - r), 1.1) for o, r in
                                                      zip([-1.0, -0.5, -3.0], [-1.2, -0.4, -0.1])], abs=1e-12)
    assert not w.requires_grad


def test_masked_is_at_token_level_drops_tokens_outside_the_band_and_keeps_the_rest_at_weight_1():
    prox, behav = _pair([[0.4, 1.0, 1.5, 3.0], [1.9, 0.6, 0.1, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    out = JobCorrection("masked_is", CorrectionSettings(low=0.5, high=2.0, level="token"))(prox, behav, mask)
    torch.testing.assert_close(out.weights, torch.tensor([[0, 1, 1, 0], [1, 1, 0, 1]], dtype=D))
    assert out.stats["is_masked_fraction"] == pytest.approx(3 / 7)  # of the 7 response tokens; padding not counted
    assert out.stats["is_ratio_max"] == pytest.approx(3.0) and out.stats["is_ratio_min"] == pytest.approx(0.1)


def test_masked_is_at_sequence_level_judges_a_response_by_its_geometric_mean_ratio():
    # Row 0: tokens at 3 and 1/3 (both outside the band) but a geometric mean of 1: kept whole.
    # Row 1: 1.9 and 2.5, geometric mean sqrt(4.75) = 2.18 > 2: dropped whole, the in-band 1.9 too.
    # Row 2: padding with an absurd ratio must not enter its mean (1.2 alone: kept).
    prox, behav = _pair([[3.0, 1 / 3], [1.9, 2.5], [1.2, 1e6]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    seq = JobCorrection("masked_is", CorrectionSettings(low=0.5, high=2.0, level="sequence"))(prox, behav, mask)
    torch.testing.assert_close(seq.weights, torch.tensor([[1, 1], [0, 0], [1, 1]], dtype=D))
    assert seq.stats["is_masked_fraction"] == pytest.approx(2 / 5)
    tok = JobCorrection("masked_is", CorrectionSettings(low=0.5, high=2.0, level="token"))(prox, behav, mask)
    torch.testing.assert_close(tok.weights[:2], torch.tensor([[0, 0], [1, 0]], dtype=D))  # the levels differ


def test_decoupled_weights_are_the_full_ratio_and_a_cap_drops_tokens_above_it():
    prox, behav = _pair([[0.5, 1.0, 1.5, 3.0], [8.0, 0.2, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    free = JobCorrection("decoupled", CorrectionSettings())(prox, behav, mask)
    torch.testing.assert_close(free.weights, torch.tensor([[0.5, 1.0, 1.5, 3.0], [8.0, 0.2, 1.0, 1.0]], dtype=D))
    assert free.stats["is_masked_fraction"] == 0.0
    capped = JobCorrection("decoupled", CorrectionSettings(cap=2.5))(prox, behav, mask)
    torch.testing.assert_close(capped.weights, torch.tensor([[0.5, 1.0, 1.5, 0.0], [0.0, 0.2, 1.0, 1.0]], dtype=D))
    assert capped.stats["is_masked_fraction"] == pytest.approx(2 / 7)
    assert capped.stats["is_ratio_max"] == pytest.approx(8.0)  # the spread is of the ratio, before any drop


def test_extreme_log_prob_gaps_stay_finite():
    prox = torch.tensor([[0.0, -1000.0]], dtype=D)
    behav = torch.tensor([[-1000.0, 0.0]], dtype=D)
    for name, s in [("tis", CorrectionSettings(cap=2.0)), ("decoupled", CorrectionSettings()),
                    ("masked_is", CorrectionSettings(low=0.5, high=2.0, level="sequence"))]:
        out = JobCorrection(name, s)(prox, behav, torch.ones(1, 2))
        assert torch.isfinite(out.weights).all() and all(math.isfinite(v) for v in out.stats.values()), name


def test_the_registry_holds_the_three_with_their_facts():
    assert OFF_POLICY_CORRECTIONS.names() == ["decoupled", "masked_is", "tis"]
    assert [OFF_POLICY_CORRECTIONS[n].needs_proximal for n in ("decoupled", "masked_is", "tis")] == [True, False,
                                                                                                    False]
    with pytest.raises(KeyError, match="unknown off-policy correction 'mis'; registered: decoupled, masked_is, tis"):
        OFF_POLICY_CORRECTIONS["mis"]


# --- the spec ---------------------------------------------------------------------------------------------------------

def test_tiscap_is_shorthand_for_name_tis():
    short, long = _job({"tisCap": 2}).spec.algorithm, _job({"offPolicyCorrection": {"name": "tis", "cap": 2}}).spec.algorithm
    assert off_policy_correction(short) == off_policy_correction(long) == JobCorrection("tis", CorrectionSettings(cap=2.0))
    assert short.off_policy_correction is None  # not rewritten: the resolved spec reads back as written


def test_unset_settings_take_the_corrections_defaults_and_none_means_no_correction():
    a = _job({"offPolicyCorrection": {"name": "masked_is"}}).spec.algorithm
    assert off_policy_correction(a) == JobCorrection("masked_is", CorrectionSettings(low=0.5, high=2.0, level="token"))
    assert off_policy_correction(_job({"offPolicyCorrection": {"name": "tis"}}).spec.algorithm).settings.cap == 2.0
    assert off_policy_correction(_job({}).spec.algorithm) is None
    assert not wants_rollout_log_probs(_job({}).spec.algorithm)
    assert all(wants_rollout_log_probs(_job(a).spec.algorithm) for a in (
        {"tisCap": 2}, {"offPolicyCorrection": {"name": "decoupled"}}, {"offPolicyCorrection": {"name": "masked_is"}}))


def test_a_resolved_correction_reads_back_the_same():
    a = _job({"offPolicyCorrection": {"name": "masked_is", "level": "sequence"}}).spec.algorithm
    again = _job(a.model_dump(by_alias=True, mode="json", exclude_none=True)).spec.algorithm
    assert again == a and again.off_policy_correction.low == 0.5


@pytest.mark.parametrize("algorithm,spec,expected", [
    ({"offPolicyCorrection": {"name": "mis"}}, {},
     "spec.algorithm.offPolicyCorrection.name: unknown off-policy correction 'mis'; registered: decoupled, masked_is, "
     "tis"),
    ({"tisCap": 2, "offPolicyCorrection": {"name": "tis", "cap": 2}}, {},
     "tisCap and offPolicyCorrection are both set"),
    ({"tisCap": 2}, {"rollout": {"topP": 0.9}}, "spec.algorithm.tisCap: the generation engines report"),
    ({"offPolicyCorrection": {"name": "decoupled"}}, {"rollout": {"topP": 0.9}},
     "spec.algorithm.offPolicyCorrection: the generation engines report log-probs over the top-p nucleus"),
    ({"offPolicyCorrection": {"name": "masked_is", "low": 1.1}}, {},
     "spec.algorithm.offPolicyCorrection: masked_is keeps ratios in [low, high], which must hold the on-policy ratio 1 "
     "(low < 1 < high); got low 1.1, high 2.0"),
    ({"offPolicyCorrection": {"name": "masked_is", "high": 0.9}}, {}, "got low 0.5, high 0.9"),
    ({"offPolicyCorrection": {"name": "tis", "low": 0.5}}, {},
     "spec.algorithm.offPolicyCorrection.low: tis does not read it (it reads cap); remove it"),
    ({"offPolicyCorrection": {"name": "masked_is", "cap": 3}}, {},
     "spec.algorithm.offPolicyCorrection.cap: masked_is does not read it (it reads low, high, level)"),
    ({"offPolicyCorrection": {"name": "decoupled", "cap": 0.5}}, {},
     "spec.algorithm.offPolicyCorrection.cap = 0.5: below 1 even an on-policy token (ratio 1) would lose its weight"),
    ({"offPolicyCorrection": {"name": "masked_is", "level": "seq"}}, {},
     "spec.algorithm.offPolicyCorrection.level: Input should be 'token' or 'sequence'"),
    ({"offPolicyCorrection": {"cap": 2}}, {}, "spec.algorithm.offPolicyCorrection.name: Field required"),
])
def test_bad_corrections_name_the_field_and_what_to_do(algorithm, spec, expected):
    with pytest.raises(SpecError) as err:
        _job(algorithm, **spec)
    assert expected in str(err.value), str(err.value)


def test_the_crd_lists_the_registered_names():
    from hybridflow.api.crd import spec_schema

    correction = spec_schema()["properties"]["algorithm"]["properties"]["offPolicyCorrection"]
    assert correction["properties"]["name"]["enum"] == OFF_POLICY_CORRECTIONS.names()


# --- the roles' accessor and the old-log-prob stage ------------------------------------------------------------------

def test_only_a_correction_that_needs_a_proximal_policy_forces_the_old_log_prob_pass():
    t = Training()
    for algorithm, on_policy in [({}, True), ({"tisCap": 2}, True), ({"offPolicyCorrection": {"name": "masked_is"}}, True),
                                 ({"offPolicyCorrection": {"name": "decoupled"}}, False),
                                 ({"offPolicyCorrection": {"name": "decoupled", "cap": 5}}, False)]:
        a = _job(algorithm).spec.algorithm
        assert old_log_probs_from_update(t, a, 16) is on_policy, algorithm


# --- the actor's real update -----------------------------------------------------------------------------------------

# support.tiny_actor's ragged batch (prompts of 1-7 tokens, responses of 1-6) and one-rank actor; `tiny_dir`
# (tests/conftest.py) is its tiny model

def test_the_decoupled_update_takes_its_ratio_against_the_proximal_policy_and_weights_by_the_behaviour(
        one_rank, tiny_dir):
    """Behaviour log-probs far from the proximal ones (a stale rollout): if they entered the PPO ratio, approx_kl
    would be their gap and most tokens would clip; in the weights they scale each token's -A by pi_prox/pi_behaviour."""
    actor = one_rank_actor(tiny_dir, {"offPolicyCorrection": {"name": "decoupled"}})
    batch = ragged_batch_with_uids()
    with pytest.raises(ValueError, match="old_log_prob stage must run first"):  # needs_proximal: no shortcut
        actor.update_actor(batch)
    proximal = batch.union(actor.compute_log_prob(batch))
    mask = proximal["response_mask"]
    gap = torch.linspace(-0.6, 0.6, mask.numel()).reshape(mask.shape)  # log pi_prox - log pi_behaviour
    trained = proximal.with_columns(rollout_log_probs=proximal["old_log_probs"] - gap)
    stats = actor.update_actor(trained)
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-6) and stats["clip_frac"] == 0.0
    weights, real = gap.exp(), mask.bool()
    expected = float((-trained["advantages"] * weights)[real].mean())  # ratio 1 at the first forward pass
    assert stats["pg_loss"] == pytest.approx(expected, abs=1e-5)
    assert abs(expected - float(-trained["advantages"][real].mean())) > 1e-2  # the weights changed the loss
    assert stats["is_ratio_mean"] == pytest.approx(float(weights[real].mean()), rel=1e-5)  # token shares
    assert stats["is_masked_fraction"] == 0.0


def test_the_tiscap_shorthand_and_name_tis_make_the_same_update(one_rank, tiny_dir):
    batch = ragged_batch_with_uids()
    gap = torch.linspace(-1.0, 1.0, batch["response_mask"].numel()).reshape(batch["response_mask"].shape)
    outs = []
    for algorithm in ({"tisCap": 1.5}, {"offPolicyCorrection": {"name": "tis", "cap": 1.5}}):
        actor = one_rank_actor(tiny_dir, algorithm)
        with_old = batch.union(actor.compute_log_prob(batch))
        outs.append(actor.update_actor(with_old.with_columns(rollout_log_probs=with_old["old_log_probs"] - gap)))
    assert outs[0]["pg_loss"] == pytest.approx(outs[1]["pg_loss"], abs=1e-7)
    assert outs[0]["is_ratio_max"] == pytest.approx(outs[1]["is_ratio_max"]) and outs[0]["is_ratio_max"] > 1.5
    real = batch["response_mask"].bool()
    capped = gap.exp().clamp(max=1.5)
    assert outs[0]["pg_loss"] == pytest.approx(float((-batch["advantages"] * capped)[real].mean()), abs=1e-5)
