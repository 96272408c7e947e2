"""Each numeric piece against a float64 reference written plainly (loops, no shared helpers)."""
import math

import pytest
import torch

from hybridflow.algorithms import core
from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from hybridflow.algorithms.kl import KL_ESTIMATORS
from hybridflow.algorithms.losses import ClipConfig, POLICY_LOSSES, LOSS_AGGREGATIONS
from support.algorithm_references import (AGG_REFERENCES, D, ESTIMATOR_REFERENCES, GROUP, LOSS_REFERENCES, MASK6, SIX, Rows,
                                         ref_gae, ref_grpo, ref_kl, ref_rloo, ref_scores, ref_seq_mean_token_sum_norm,
                                         ref_token_mean)


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])


def _outcome_inputs(scores, group, mask, **kw):
    """Outcome scores as the controller hands them over: on each response's last real token."""
    return AdvantageInputs(core.token_rewards(scores, mask, None, 0.0), mask, group, **kw)


class _Loss:
    def __init__(self, token, mask):
        self.loss = LOSS_AGGREGATIONS["token-mean"](token.loss, mask)
        self.clip_frac = core.masked_mean(token.clipped.float(), mask)


def _ppo_token_mean(logp, old, adv, mask, eps):
    return _Loss(POLICY_LOSSES["ppo"](logp, old, adv, mask, ClipConfig(eps, eps)), mask)


def test_masked_mean_ignores_padding():
    x = _rand(3, 5)
    ref = sum(float(x[i, j]) for i in range(3) for j in range(5) if MASK[i, j]) / int(MASK.sum())
    assert core.masked_mean(x, MASK).item() == pytest.approx(ref, rel=1e-6)


def test_grpo_advantages_match_reference():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 1.0, 3.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(8, 3)
    mask[1, 2] = 0
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](_outcome_inputs(scores, group, mask))
    for g in (0, 1):
        members = [i for i in range(8) if group[i] == g]
        vals = [float(scores[i]) for i in members]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in members:
            expect = (float(scores[i]) - mean) / (std + 1e-6)
            for t in range(3):
                assert adv[i, t].item() == pytest.approx(expect * float(mask[i, t]), abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_group_that_scored_alike_has_exactly_zero_advantage(estimator):
    """Eight responses all scoring 0.7 in float32: their mean misses 0.7 by an ulp (6e-8), and over a std of the same
    size that read as advantages of +-0.056, noise the update trained on (and could not skip: training.
    skipZeroAdvantageRows takes exact zeros). The other group is normalised as before."""
    scores = torch.tensor([0.7] * 8 + [0.0, 1.0], dtype=torch.float32)
    group = torch.tensor([0] * 8 + [1, 1])
    adv, _ = ADVANTAGE_ESTIMATORS[estimator](_outcome_inputs(scores, group, torch.ones(10, 2)))
    assert (adv[:8] == 0).all()
    assert (adv[8:, 0] < 0).tolist() == [True, False]


def test_grpo_without_std_is_centred_only():
    scores = torch.tensor([1.0, 3.0])
    inputs = _outcome_inputs(scores, torch.tensor([0, 0]), torch.ones(2, 1), norm_by_std=False)
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](inputs)
    assert adv[:, 0].tolist() == [-1.0, 1.0]


def test_gae_matches_reference():
    gamma, lam = 0.99, 0.9
    rewards, values = _rand(3, 5, seed=1), _rand(3, 5, seed=2)
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](AdvantageInputs(rewards, MASK, torch.zeros(3), values, None, gamma, lam))
    raw = [[0.0] * 5 for _ in range(3)]
    for i in range(3):
        n = int(MASK[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = float(values[i, t + 1]) if t + 1 < n else 0.0
            delta = float(rewards[i, t]) + gamma * nv - float(values[i, t])
            last = delta + gamma * lam * last
            raw[i][t] = last
    flat = [raw[i][t] for i in range(3) for t in range(5) if MASK[i, t]]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    for i in range(3):
        for t in range(5):
            if MASK[i, t]:
                assert ret[i, t].item() == pytest.approx(raw[i][t] + float(values[i, t]), abs=1e-5)
                assert adv[i, t].item() == pytest.approx((raw[i][t] - mean) / math.sqrt(var + 1e-8), abs=1e-4)
            else:
                assert adv[i, t].item() == 0 and ret[i, t].item() == 0


def test_ppo_policy_loss_and_clip_fraction():
    logp, old = _rand(3, 5, seed=3) * 0.5, _rand(3, 5, seed=4) * 0.5
    adv = _rand(3, 5, seed=5)
    eps = 0.2
    out = _ppo_token_mean(logp, old, adv, MASK, eps)
    total, clipped, n = 0.0, 0, 0
    for i in range(3):
        for t in range(5):
            if not MASK[i, t]:
                continue
            r = math.exp(float(logp[i, t]) - float(old[i, t]))
            a = float(adv[i, t])
            l1, l2 = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
            total += max(l1, l2)
            clipped += l2 > l1
            n += 1
    assert out.loss.item() == pytest.approx(total / n, rel=1e-5)
    assert out.clip_frac.item() == pytest.approx(clipped / n)
    assert 0 < out.clip_frac.item() < 1  # the data exercises both branches


def test_ppo_policy_loss_gradient_zero_when_clipped():
    logp = torch.tensor([[1.0]], requires_grad=True)
    out = _ppo_token_mean(logp, torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.2)
    out.loss.backward()
    assert logp.grad.item() == 0.0  # ratio e > 1.2 with positive advantage: clipped, no gradient


def test_value_loss_matches_reference():
    v, old, ret = _rand(3, 5, seed=6), _rand(3, 5, seed=7), _rand(3, 5, seed=8)
    clip = 0.3
    loss, frac = core.value_loss(v, old, ret, MASK, clip)
    tot, n, c = 0.0, 0, 0
    for i in range(3):
        for t in range(5):
            if MASK[i, t]:
                vc = float(old[i, t]) + min(max(float(v[i, t]) - float(old[i, t]), -clip), clip)
                l1 = (float(v[i, t]) - float(ret[i, t])) ** 2
                l2 = (vc - float(ret[i, t])) ** 2
                tot += max(l1, l2)
                c += l2 > l1 and abs(float(v[i, t]) - float(old[i, t])) > clip
                n += 1
    assert loss.item() == pytest.approx(0.5 * tot / n, rel=1e-5)
    assert 0 < c < n
    assert frac.item() == pytest.approx(c / n)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators(kind):
    logp, ref = _rand(2, 4, seed=9), _rand(2, 4, seed=10)
    out = KL_ESTIMATORS[kind](logp, ref)
    for i in range(2):
        for t in range(4):
            expect = ref_kl(kind, float(logp[i, t]), float(ref[i, t]))
            assert out[i, t].item() == pytest.approx(expect, rel=1e-5, abs=1e-6)
    if kind == "k3":
        assert (out >= 0).all()


def test_kl_estimators_are_unbiased_on_samples():
    # Sampling from p, E[k1] and E[k3] both equal KL(p||q); compare to the exact value (float64).
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(p, 200_000, replacement=True, generator=g)
    for kind in ("k1", "k3"):
        est = KL_ESTIMATORS[kind](p.log()[idx], q.log()[idx]).mean().item()
        assert est == pytest.approx(exact, abs=0.01)


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(KeyError, match="k1, k2, k3"):
        KL_ESTIMATORS["k4"]


def test_entropy_from_logits():
    logits = _rand(2, 3, 6, seed=11)
    ent = core.entropy_from_logits(logits)
    for i in range(2):
        for t in range(3):
            z = [math.exp(float(x)) for x in logits[i, t]]
            s = sum(z)
            expect = -sum((v / s) * math.log(v / s) for v in z)
            assert ent[i, t].item() == pytest.approx(expect, rel=1e-5)


def test_token_rewards_put_score_on_last_token_and_kl_everywhere():
    scores = torch.tensor([1.0, 2.0, 3.0])
    kl = _rand(3, 5, seed=12)
    r = core.token_rewards(scores, MASK, kl, 0.1)
    for i in range(3):
        last = int(MASK[i].sum()) - 1
        for t in range(5):
            expect = -0.1 * float(kl[i, t]) * float(MASK[i, t]) + (float(scores[i]) if t == last else 0.0)
            assert r[i, t].item() == pytest.approx(expect, abs=1e-6)


def test_per_turn_rewards_stay_on_their_turns_and_the_rest_of_the_score_goes_last():
    """A multi-turn environment's per-turn rewards (`placed`) stay where they were earned; the rest of the score
    (a job reward, the KL) as without them; each row still sums to its score, so outcome estimators see the same
    score, while discounted returns credit the early turn for its early reward."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    placed = torch.zeros(2, 6)
    placed[0, 1], placed[0, 5] = 0.25, 0.5  # two environment steps of row 0 (turn ends at 1 and 5)
    scores = torch.tensor([1.75, 1.0])  # row 0: 0.75 from the environment + 1.0 from the job's reward
    kl = _rand(2, 6, seed=3)
    r = core.token_rewards(scores, mask, kl, 0.1, placed)
    plain = core.token_rewards(scores - placed.sum(1), mask, kl, 0.1)
    torch.testing.assert_close(r, plain + placed)
    assert float(r[0, 5] + 0.1 * kl[0, 5]) == pytest.approx(1.5) and float(r[0, 1] + 0.1 * kl[0, 1]) == pytest.approx(
        0.25)
    torch.testing.assert_close((core.token_rewards(scores, mask, None, 0.0, placed) * mask).sum(1), scores)
    early = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](AdvantageInputs(
        core.token_rewards(scores, mask, None, 0.0, placed), mask, torch.tensor([0, 1]), gamma=0.5, whiten=False))[1]
    late = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](AdvantageInputs(
        core.token_rewards(scores, mask, None, 0.0), mask, torch.tensor([0, 1]), gamma=0.5, whiten=False))[1]
    assert float(early[0, 0]) > float(late[0, 0])  # the first turn's return holds its own reward, less discounted


# ---------------------------------------------------------------------------------------------------------------------
# Every registered estimator, loss and aggregation against a plain float64 reference. A name registered without a
# reference here fails `test_every_registered_piece_has_a_reference`.

def _rewards6(seed=20):
    """Per-token rewards (a KL-like penalty everywhere, a score at the end), zero on padding; float64."""
    r = _rand(6, 4, seed=seed).to(D) * 0.1
    for i in range(6):
        r[i, int(MASK6[i].sum()) - 1] += float(i % 3) - 0.5 * (i // 3)
    return r * MASK6


def _rows(t):
    return [[float(v) for v in row] for row in t]


def _real(i):
    return int(MASK6[i].sum())


def _ref_members(i):
    return SIX.members(i)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_advantage_estimator_matches_float64_reference(name):
    rewards, values = _rewards6(), _rand(6, 4, seed=21).to(D) * MASK6
    baseline = torch.tensor([0.3, -0.2, 0.1, 0.0, 0.5, -0.4], dtype=D)
    x = AdvantageInputs(rewards, MASK6, GROUP, values, baseline, gamma=0.9, lam=0.8)
    adv, _ = ADVANTAGE_ESTIMATORS[name](x)
    assert adv.dtype == D
    expect = ESTIMATOR_REFERENCES[name](_rows(rewards), _rows(values), [float(b) for b in baseline])
    for i in range(6):
        for t in range(4):
            want = expect[i][t] if MASK6[i, t] else 0.0
            assert float(adv[i, t]) == pytest.approx(want, abs=1e-9), (name, i, t)


def test_grpo_without_std_is_dr_grpos_estimator():
    rewards = _rewards6()
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](AdvantageInputs(rewards, MASK6, GROUP, norm_by_std=False))
    s = ref_scores(_rows(rewards))
    for i in range(6):
        mean = sum(s[j] for j in _ref_members(i)) / 3
        assert float(adv[i, 0]) == pytest.approx(s[i] - mean, abs=1e-12)
    expect = ref_grpo(_rows(rewards), None, None, norm_by_std=False)
    for i in range(6):
        for t in range(_real(i)):
            assert float(adv[i, t]) == pytest.approx(expect[i][t], abs=1e-12)


def test_gae_without_whitening_matches_reference():
    rewards, values = _rewards6(), _rand(6, 4, seed=21).to(D) * MASK6
    adv, ret = ADVANTAGE_ESTIMATORS["gae"](AdvantageInputs(rewards, MASK6, GROUP, values, None, 0.9, 0.8,
                                                           whiten=False))
    expect = ref_gae(_rows(rewards), _rows(values), None, whiten=False)
    for i in range(6):
        for t in range(4):
            want = expect[i][t] if MASK6[i, t] else 0.0
            assert float(adv[i, t]) == pytest.approx(want, abs=1e-9)
            assert float(ret[i, t]) == pytest.approx(want + float(values[i, t]) * float(MASK6[i, t]), abs=1e-9)


def test_the_references_take_another_layout():
    """The layout the examples' short runs give them (tests/algorithms/test_algorithm_examples.py): another batch size,
    group size and width, every response full length."""
    rows = Rows((3,) * 4, (7, 7, 9, 9), 3, gamma=1.0)
    r = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.5], [0.0, 0.0, 1.5]]
    assert [a[0] for a in ref_rloo(r, None, None, rows)] == [1.0, -1.0, -1.0, 1.0]
    assert [a[2] for a in ref_grpo(r, None, None, rows, norm_by_std=False)] == [0.5, -0.5, -0.5, 0.5]
    mask = torch.ones(4, 3)
    x = AdvantageInputs(torch.tensor(r, dtype=D), mask, torch.tensor(rows.groups), gamma=1.0)
    for name in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv, _ = ADVANTAGE_ESTIMATORS[name](x)
        expect = ESTIMATOR_REFERENCES[name](r, None, None, rows)
        assert _rows(adv) == [pytest.approx(row, abs=1e-9) for row in expect], name
    assert ref_token_mean(r, rows) == pytest.approx(3.0 / 12)
    assert ref_seq_mean_token_sum_norm(r, rows) == pytest.approx(3.0 / 3 / 4)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("low,high,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)],
                         ids=["symmetric", "clip-higher", "dual-clip"])
def test_policy_loss_matches_float64_reference(name, low, high, dual):
    logp, old = _rand(6, 4, seed=22).to(D) * 0.4, _rand(6, 4, seed=23).to(D) * 0.4
    adv = _rand(6, 4, seed=24).to(D) * 2
    out = POLICY_LOSSES[name](logp, old, adv, MASK6, ClipConfig(low, high, dual))
    expect = LOSS_REFERENCES[name](_rows(logp), _rows(old), _rows(adv), low, high, dual)
    for i in range(6):
        for t in range(_real(i)):
            assert float(out.loss[i, t]) == pytest.approx(expect[i][t], abs=1e-12), (name, i, t)
    if dual is not None and name == "ppo":
        assert out.dual_clipped is not None and bool(out.dual_clipped[MASK6.bool()].any()), "dual clip never bit"


def test_clip_higher_lets_a_positive_advantage_push_further():
    logp = torch.tensor([[math.log(1.25)]], dtype=D, requires_grad=True)
    old, adv, mask = torch.zeros(1, 1, dtype=D), torch.ones(1, 1, dtype=D), torch.ones(1, 1)
    POLICY_LOSSES["ppo"](logp, old, adv, mask, ClipConfig(0.2, 0.28)).loss.sum().backward()
    assert float(logp.grad) == pytest.approx(-1.25)  # ratio 1.25 < 1.28: still learning
    logp.grad = None
    POLICY_LOSSES["ppo"](logp, old, adv, mask, ClipConfig(0.2, 0.2)).loss.sum().backward()
    assert float(logp.grad) == 0.0  # symmetric 0.2: clipped


def test_gspo_gradient_flows_through_every_token_with_the_sequence_ratio():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -0.6]], dtype=D)
    adv = torch.full((1, 3), 0.7, dtype=D)
    out = POLICY_LOSSES["gspo"](logp, old, adv, torch.ones(1, 3), ClipConfig(0.5, 0.5))
    out.loss.sum().backward()
    seq = math.exp((0.1 - 0.1 + 0.1) / 3)
    assert [float(g) for g in logp.grad[0]] == pytest.approx([-0.7 * seq] * 3, abs=1e-12)


@pytest.mark.parametrize("name", LOSS_AGGREGATIONS.names())
def test_loss_aggregation_matches_float64_reference(name):
    loss = _rand(6, 4, seed=25).to(D)
    got = float(LOSS_AGGREGATIONS[name](loss, MASK6))
    assert got == pytest.approx(AGG_REFERENCES[name](_rows(loss)), abs=1e-12)


def test_every_registered_piece_has_a_reference():
    assert set(ADVANTAGE_ESTIMATORS.names()) == set(ESTIMATOR_REFERENCES)
    assert set(POLICY_LOSSES.names()) == set(LOSS_REFERENCES)
    assert set(LOSS_AGGREGATIONS.names()) == set(AGG_REFERENCES)
    assert set(KL_ESTIMATORS.names()) == {"k1", "k2", "k3"}  # each in test_kl_estimators


def test_clip_range_defaults_come_with_the_loss():
    from hybridflow.api import JobSpec

    def clip(**algorithm):
        a = JobSpec.model_validate({"algorithm": algorithm}).algorithm
        return a.clip_ratio_low, a.clip_ratio_high

    assert clip(name="gspo") == clip(name="grpo", policyLoss="gspo") == (3e-4, 4e-4)
    assert clip(name="gspo", policyLoss="ppo") == (None, None)  # training.clipRatio
    assert clip(name="dapo") == (0.2, 0.28)
    assert clip(name="grpo", policyLoss="gspo", clipRatioHigh=0.01) == (None, 0.01)


def test_ppo_loss_stays_finite_for_extreme_ratios():
    logp = torch.tensor([[0.0, -1000.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1000.0, 0.0]], dtype=D)
    out = POLICY_LOSSES["ppo"](logp, old, torch.tensor([[-1.0, 1.0]], dtype=D), torch.ones(1, 2),
                               ClipConfig(0.2, 0.2))
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all() and torch.isfinite(logp.grad).all()


def test_truncated_importance_weights():
    from hybridflow.algorithms.corrections import truncated_is_weights

    old = torch.tensor([[-1.0, -0.5, -3.0]], dtype=D)
    rollout = torch.tensor([[-1.2, -0.4, -0.1]], dtype=D)
    w = truncated_is_weights(old, rollout, 1.1)
    expect = [min(math.exp(o - r), 1.1) for o, r in zip([-1.0, -0.5, -3.0], [-1.2, -0.4, -0.1])]
    assert [float(x) for x in w[0]] == pytest.approx(expect, abs=1e-12)
    assert float(w.max()) <= 1.1


def test_overlong_penalty():
    lengths = torch.tensor([2, 6, 7, 8])
    got = core.overlong_penalty(lengths, max_length=8, buffer=4, penalty=0.5)
    expect = [-0.5 * max(0, min(n - 4, 4)) / 4 for n in (2, 6, 7, 8)]
    assert [float(x) for x in got] == pytest.approx(expect)
    assert float(core.overlong_penalty(lengths, 8, 0, 0.5).abs().sum()) == 0


def test_kl_controllers():
    from hybridflow.algorithms.kl import KL_CONTROLLERS

    fixed = KL_CONTROLLERS["fixed"](0.1)
    fixed.update(5.0, 64)
    assert fixed.value == 0.1
    adaptive = KL_CONTROLLERS["adaptive"](0.1, target=0.05, horizon=1000)
    value = 0.1
    for measured in (0.2, 0.2, 0.06, 0.01):  # far above target: +20% * n/horizon; slightly above; far below
        adaptive.update(measured, 100)
        value *= 1 + min(max(measured / 0.05 - 1, -0.2), 0.2) * 100 / 1000
        assert adaptive.value == pytest.approx(value, rel=1e-12)
    restored = KL_CONTROLLERS["adaptive"](0.1, target=0.05, horizon=1000)
    restored.load(adaptive.state())
    assert restored.value == adaptive.value
    changed = KL_CONTROLLERS["fixed"](0.3)  # a fixed coefficient is the spec's: a resumed job may change it
    changed.load({"value": 0.1})
    assert changed.value == 0.3
    with pytest.raises(ValueError, match="targetKl"):
        KL_CONTROLLERS["adaptive"](0.1, target=None)


def test_lagrangian_rises_with_excess_cost_and_stays_non_negative():
    from hybridflow.algorithms.safe_rlhf import Lagrangian

    lam = Lagrangian(init=0.5, lr=0.1, limit=0.2)
    assert lam.update(0.7) == pytest.approx(0.55)
    assert lam.update(0.2) == pytest.approx(0.55)
    assert lam.update(-10.0) == 0.0


def test_numeric_modules_import_without_torch():
    """The spec (torch-free: the operator image has no torch) imports every registry."""
    import subprocess
    import sys

    code = ("import sys, hybridflow.algorithms, hybridflow.api; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(len(hybridflow.algorithms.ALGORITHMS.names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 9
