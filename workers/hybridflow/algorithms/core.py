"""The numeric heart of PPO and GRPO: advantages, losses, KL estimators. Pure tensor functions, no state.

Shapes: (B, R) per-token tensors over the response, `mask` is 1 on real response tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    var = var * n / (n - 1).clamp_min(1)  # unbiased, as PPO implementations do
    return (x - mean) * torch.rsqrt(var + eps)


def grpo_advantages(
    scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Outcome advantage (score - group mean) / group std, broadcast over the response tokens.

    `scores` (B,) is one scalar per response; `group` (B,) says which prompt each response answers.
    """
    adv = torch.zeros_like(scores, dtype=torch.float32)
    for g in torch.unique(group):
        idx = group == g
        s = scores[idx].float()
        centred = s - s.mean()
        if norm_by_std:
            std = s.std() if s.numel() > 1 else torch.tensor(1.0)
            centred = centred / (std + eps)
        adv[idx] = centred
    return adv[:, None] * mask.float()


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens; returns (whitened advantages, returns).

    Positions beyond the response (mask 0) are skipped, so a right-padded response ends at its last real token.
    """
    B, R = rewards.shape
    mask_f = mask.float()
    adv_rev = []
    last = torch.zeros(B, dtype=torch.float32)
    next_value = torch.zeros(B, dtype=torch.float32)
    for t in reversed(range(R)):
        m = mask_f[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_new = delta + gamma * lam * last
        last = torch.where(m > 0, last_new, last)
        next_value = torch.where(m > 0, values[:, t], next_value)
        adv_rev.append(last)
    advantages = torch.stack(adv_rev[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask) * mask_f, returns * mask_f


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from samples of pi. k1: log ratio; k3: exp(-r) - 1 + r, always >= 0."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k3":
        r = (-log_ratio).clamp(-20, 20)
        return (torch.exp(r) - 1 - r).clamp(max=10)
    raise ValueError(f"unknown KL estimator '{kind}' (use k1 or k3)")


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    clip_frac: torch.Tensor
    approx_kl: torch.Tensor


def ppo_policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: float
) -> PolicyLoss:
    """PPO-clip: mean over tokens of max(-A*ratio, -A*clip(ratio, 1-eps, 1+eps))."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    clip_frac = masked_mean((clipped > unclipped).float(), mask)
    approx_kl = masked_mean(old_logp - logp, mask)
    return PolicyLoss(loss, clip_frac.detach(), approx_kl.detach())


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2); returns (loss, clip fraction)."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    l1 = (values - returns) ** 2
    l2 = (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(l1, l2), mask)
    # Counted only where clipping changed v (float rounding makes l2 > l1 by an ulp where it did not).
    used_clipped = (l2 > l1) & ((values - old_values).abs() > clip)
    return loss, masked_mean(used_clipped.float(), mask).detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float) -> torch.Tensor:
    """Per-token rewards for PPO: -kl_coef*KL on every token, the sequence score on the last real token."""
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    last = mask.long().sum(1).clamp_min(1) - 1
    rewards[torch.arange(len(scores)), last] += scores.float()
    return rewards
