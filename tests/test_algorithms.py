"""Each numeric piece against a float64 reference written plainly (loops, no shared helpers)."""
import math

import pytest
import torch

from hybridflow.algorithms import core


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])


def test_masked_mean_ignores_padding():
    x = _rand(3, 5)
    ref = sum(float(x[i, j]) for i in range(3) for j in range(5) if MASK[i, j]) / int(MASK.sum())
    assert core.masked_mean(x, MASK).item() == pytest.approx(ref, rel=1e-6)


def test_grpo_advantages_match_reference():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 1.0, 3.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(8, 3)
    mask[1, 2] = 0
    adv = core.grpo_advantages(scores, group, mask, norm_by_std=True, eps=1e-6)
    for g in (0, 1):
        members = [i for i in range(8) if group[i] == g]
        vals = [float(scores[i]) for i in members]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in members:
            expect = (float(scores[i]) - mean) / (std + 1e-6)
            for t in range(3):
                assert adv[i, t].item() == pytest.approx(expect * float(mask[i, t]), abs=1e-5)


def test_grpo_without_std_is_centred_only():
    scores = torch.tensor([1.0, 3.0])
    adv = core.grpo_advantages(scores, torch.tensor([0, 0]), torch.ones(2, 1), norm_by_std=False)
    assert adv[:, 0].tolist() == [-1.0, 1.0]


def test_gae_matches_reference():
    gamma, lam = 0.99, 0.9
    rewards, values = _rand(3, 5, seed=1), _rand(3, 5, seed=2)
    adv, ret = core.gae(rewards, values, MASK, gamma, lam)
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
    out = core.ppo_policy_loss(logp, old, adv, MASK, eps)
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
    out = core.ppo_policy_loss(logp, torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.2)
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


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_estimators(kind):
    logp, ref = _rand(2, 4, seed=9), _rand(2, 4, seed=10)
    out = core.kl_estimate(logp, ref, kind)
    for i in range(2):
        for t in range(4):
            lr = float(logp[i, t]) - float(ref[i, t])
            expect = lr if kind == "k1" else math.exp(-lr) - 1 + lr
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
        est = core.kl_estimate(p.log()[idx], q.log()[idx], kind).mean().item()
        assert est == pytest.approx(exact, abs=0.01)


def test_unknown_kl_estimator():
    with pytest.raises(ValueError, match="k2"):
        core.kl_estimate(torch.zeros(1), torch.zeros(1), "k2")


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
