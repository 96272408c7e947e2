"""Advantage estimators, one registered function each: (AdvantageInputs) -> (advantages, returns), both (B, R).

`needs` says what an estimator reads beyond per-token rewards: `values` (a critic), `groups` (several responses per
prompt) or `baseline` (ReMax's greedy score); the spec checks an algorithm provides it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hybridflow.algorithms.core import broadcast, masked_whiten
from hybridflow.algorithms.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class AdvantageInputs:
    token_rewards: Tensor  # (B, R): the score on the last real token, minus the KL penalty when it is in the reward
    mask: Tensor  # (B, R)
    group: Tensor  # (B,) which prompt each response answers
    values: Tensor | None = None  # (B, R) critic values
    baseline: Tensor | None = None  # (B,) ReMax: the score of the prompt's greedy response
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    whiten: bool = True  # gae: whiten over the batch (Safe-RLHF combines raw reward and cost advantages instead)
    eps: float = 1e-6

    @property
    def scores(self) -> Tensor:
        """Outcome reward of each response: its per-token rewards summed."""
        return (self.token_rewards * self.mask).sum(1)


Estimator = Callable[[AdvantageInputs], "tuple[Tensor, Tensor]"]
ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def _within_groups(scores: Tensor, group: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """fn applied to the scores of each prompt's responses, back in the batch's order."""
    out = scores.new_zeros(scores.shape)
    for g in group.unique():
        idx = group == g
        out[idx] = fn(scores[idx])
    return out


def _discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """sum_{k>=t} gamma^(k-t) r_k over each response's real tokens: positions outside the mask (padding, and the
    answers of tools between a multi-turn response's turns) are skipped, neither discounted nor a reset."""
    out = rewards.new_zeros(rewards.shape)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        real = mask[:, t] > 0
        running = (rewards[:, t] + gamma * running).where(real, running)
        out[:, t] = running * mask[:, t]
    return out


@ADVANTAGE_ESTIMATORS.register("gae", needs={"values"})
def gae(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (whitened over the batch unless `whiten` is off) and returns = advantages +
    values.

    Positions beyond the response (mask 0) are skipped, so a right-padded response ends at its last real token.
    """
    assert x.values is not None, "gae needs critic values"
    rewards, values, mask = x.token_rewards, x.values.to(x.token_rewards.dtype), x.mask.to(x.token_rewards.dtype)
    adv = rewards.new_zeros(rewards.shape)
    last = rewards.new_zeros(rewards.shape[0])
    next_value = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        real = mask[:, t] > 0
        delta = rewards[:, t] + x.gamma * next_value - values[:, t]
        last = (delta + x.gamma * x.lam * last).where(real, last)
        next_value = values[:, t].where(real, next_value)
        adv[:, t] = last
    returns = adv + values
    return (masked_whiten(adv, mask) if x.whiten else adv) * mask, returns * mask


@ADVANTAGE_ESTIMATORS.register("grpo", needs={"groups"})
def grpo(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """(score - group mean) / group std (std dropped with normAdvByStd false: Dr. GRPO), on every token."""
    def normalised(s: Tensor) -> Tensor:
        if bool((s == s[0]).all()):  # exactly 0, not the one-ulp gap of a float mean over its std (~1e-8 / 1e-6)
            return s.new_zeros(s.shape)
        if not x.norm_by_std:
            return s - s.mean()
        return (s - s.mean()) / ((s.std() if s.numel() > 1 else s.new_ones(())) + x.eps)

    out = broadcast(_within_groups(x.scores, x.group, normalised), x.mask)
    return out, out


@ADVANTAGE_ESTIMATORS.register("rloo", needs={"groups"})
def rloo(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out: each score minus the mean of the other responses to the same prompt."""
    def leave_one_out(s: Tensor) -> Tensor:
        if bool((s == s[0]).all()):  # exactly 0 where every response scored alike (a float mean may miss by an ulp)
            return s.new_zeros(s.shape)
        return s - (s.sum() - s) / (s.numel() - 1)

    out = broadcast(_within_groups(x.scores, x.group, leave_one_out), x.mask)
    return out, out


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus", needs=set())
def reinforce_plus_plus(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted token returns (KL penalty included), whitened over the whole batch."""
    returns = _discounted_returns(x.token_rewards, x.mask, x.gamma)
    return masked_whiten(returns, x.mask) * x.mask, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline", needs={"groups"})
def reinforce_plus_plus_baseline(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a baseline: score minus its group mean, then whitened over the whole batch."""
    out = broadcast(_within_groups(x.scores, x.group, lambda s: s - s.mean()), x.mask)
    return masked_whiten(out, x.mask) * x.mask, out


@ADVANTAGE_ESTIMATORS.register("remax", needs={"baseline"})
def remax(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """ReMax: token returns minus the reward of the prompt's greedy response (no critic, no whitening)."""
    assert x.baseline is not None, "remax needs the greedy responses' scores"
    returns = _discounted_returns(x.token_rewards, x.mask, 1.0)
    return (returns - broadcast(x.baseline.to(returns.dtype), x.mask)) * x.mask, returns
