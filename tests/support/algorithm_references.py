"""Plain float64 references (loops, no shared helpers) for every registered advantage estimator, policy loss, loss
aggregation and KL estimator, over a batch layout (`Rows`): tests/algorithms/test_algorithms.py checks the registered pieces
against them on SIX, its six responses; tests/algorithms/test_algorithm_examples.py on the examples' real runs."""
import math
from dataclasses import dataclass

import torch

D = torch.float64
GROUP = torch.tensor([0, 0, 0, 1, 1, 1])
MASK6 = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])


@dataclass(frozen=True)
class Rows:
    """The batch layout a reference runs over: each response's real-token count (its tokens come first) and group,
    the padded width (the job's maximum response length, which seq-mean-token-sum-norm divides by), gamma and
    lambda. SIX is tests/algorithms/test_algorithms.py's six responses; tests/algorithms/test_algorithm_examples.py gives a real run's."""
    lengths: tuple
    groups: tuple
    width: int
    gamma: float = 0.9
    lam: float = 0.8

    def __len__(self):
        return len(self.lengths)

    def real(self, i):
        return self.lengths[i]

    def members(self, i):
        return [j for j in range(len(self)) if self.groups[j] == self.groups[i]]


SIX = Rows(tuple(int(n) for n in MASK6.sum(1)), tuple(int(g) for g in GROUP), 4)


def _plain_whiten(vals):
    """(x - mean) / sqrt(unbiased var + 1e-8) over a flat list."""
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in vals]


def _ref_whitened_tokens(per_token, rows=SIX):
    """`_plain_whiten` over the real tokens of all responses, put back in place (0 on padding)."""
    n = len(rows)
    flat = _plain_whiten([per_token[i][t] for i in range(n) for t in range(rows.real(i))])
    out, k = [[0.0] * rows.width for _ in range(n)], 0
    for i in range(n):
        for t in range(rows.real(i)):
            out[i][t], k = flat[k], k + 1
    return out


def ref_scores(r, rows=SIX):
    return [sum(r[i][:rows.real(i)]) for i in range(len(rows))]


def _ref_returns(r, gamma, rows=SIX):
    out = [[0.0] * rows.width for _ in range(len(rows))]
    for i in range(len(rows)):
        running = 0.0
        for t in reversed(range(rows.real(i))):
            running = r[i][t] + gamma * running
            out[i][t] = running
    return out


def ref_grpo(r, values, baseline, rows=SIX, norm_by_std=True):
    """(score - group mean) / (group std + 1e-6); without norm_by_std (Dr. GRPO) the centred score only."""
    s = ref_scores(r, rows)
    out = []
    for i in range(len(rows)):
        g = [s[j] for j in rows.members(i)]
        mean = sum(g) / len(g)
        std = math.sqrt(sum((v - mean) ** 2 for v in g) / (len(g) - 1))
        out.append([(s[i] - mean) / (std + 1e-6) if norm_by_std else s[i] - mean] * rows.width)
    return out


def ref_rloo(r, values, baseline, rows=SIX):
    s = ref_scores(r, rows)
    out = []
    for i in range(len(rows)):
        others = [s[j] for j in rows.members(i) if j != i]
        out.append([s[i] - sum(others) / len(others)] * rows.width)
    return out


def ref_reinforce_plus_plus(r, values, baseline, rows=SIX):
    return _ref_whitened_tokens(_ref_returns(r, rows.gamma, rows), rows)


def ref_reinforce_plus_plus_baseline(r, values, baseline, rows=SIX):
    s = ref_scores(r, rows)
    centred = [s[i] - sum(s[j] for j in rows.members(i)) / len(rows.members(i)) for i in range(len(rows))]
    return _ref_whitened_tokens([[centred[i]] * rows.width for i in range(len(rows))], rows)


def ref_remax(r, values, baseline, rows=SIX):
    ret = _ref_returns(r, 1.0, rows)
    return [[ret[i][t] - baseline[i] if t < rows.real(i) else 0.0 for t in range(rows.width)] for i in range(len(rows))]


def ref_gae(r, values, baseline, rows=SIX, whiten=True):
    """GAE, whitened over the batch (Safe-RLHF's reward and cost advantages: unwhitened, `whiten` False)."""
    raw = [[0.0] * rows.width for _ in range(len(rows))]
    for i in range(len(rows)):
        last = 0.0
        for t in reversed(range(rows.real(i))):
            nv = values[i][t + 1] if t + 1 < rows.real(i) else 0.0
            last = r[i][t] + rows.gamma * nv - values[i][t] + rows.gamma * rows.lam * last
            raw[i][t] = last
    return _ref_whitened_tokens(raw, rows) if whiten else raw


ESTIMATOR_REFERENCES = {"grpo": ref_grpo, "rloo": ref_rloo, "reinforce_plus_plus": ref_reinforce_plus_plus,
                        "reinforce_plus_plus_baseline": ref_reinforce_plus_plus_baseline, "remax": ref_remax,
                        "gae": ref_gae}


def _ref_ratio_terms(logp, old, adv, low, high, dual, seq_ratio=None, rows=SIX):
    out = [[0.0] * rows.width for _ in range(len(rows))]
    for i in range(len(rows)):
        for t in range(rows.real(i)):
            r = seq_ratio[i] if seq_ratio else math.exp(logp[i][t] - old[i][t])
            a = adv[i][t]
            loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            if dual is not None and a < 0:
                loss = min(loss, -a * dual)
            out[i][t] = loss
    return out


def ref_ppo(logp, old, adv, low, high, dual, rows=SIX):
    return _ref_ratio_terms(logp, old, adv, low, high, dual, rows=rows)


def ref_gspo(logp, old, adv, low, high, dual, rows=SIX):
    seq = [math.exp(sum(logp[i][t] - old[i][t] for t in range(rows.real(i))) / rows.real(i))
           for i in range(len(rows))]
    return _ref_ratio_terms(logp, old, adv, low, high, dual, seq, rows)


LOSS_REFERENCES = {"ppo": ref_ppo, "gspo": ref_gspo}


def ref_token_mean(loss, rows=SIX):
    vals = [loss[i][t] for i in range(len(rows)) for t in range(rows.real(i))]
    return sum(vals) / len(vals)


def ref_seq_mean_token_sum(loss, rows=SIX):
    return sum(sum(loss[i][:rows.real(i)]) for i in range(len(rows))) / len(rows)


def ref_seq_mean_token_mean(loss, rows=SIX):
    return sum(sum(loss[i][:rows.real(i)]) / rows.real(i) for i in range(len(rows))) / len(rows)


def ref_seq_mean_token_sum_norm(loss, rows=SIX):
    return sum(sum(loss[i][:rows.real(i)]) / rows.width for i in range(len(rows))) / len(rows)


AGG_REFERENCES = {"token-mean": ref_token_mean, "seq-mean-token-sum": ref_seq_mean_token_sum,
                  "seq-mean-token-mean": ref_seq_mean_token_mean,
                  "seq-mean-token-sum-norm": ref_seq_mean_token_sum_norm}


def ref_kl(kind, logp, ref):
    """One token's KL estimate from its log-probs under the policy and the reference."""
    lr = logp - ref
    return {"k1": lr, "k2": 0.5 * lr * lr, "k3": math.exp(-lr) - 1 + lr}[kind]
