"""Tensor helpers every estimator and loss shares. Pure functions, no state.

Shapes: (B, R) per-token tensors over the response; `mask` is 1 on real response tokens. Written with tensor
methods only (no `import torch`), so the registries stay importable where torch is not installed (see registry.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the real tokens of the whole batch; the std unbiased, as PPO implementations do."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    var = var * n / (n - 1).clamp_min(1)
    return (x - mean) * (var + eps).rsqrt()


def broadcast(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """One value per response spread over its tokens (0 on padding)."""
    return per_sequence[:, None] * mask.to(per_sequence.dtype)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float
) -> tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2); returns (loss, clip fraction)."""
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    l1 = (values - returns) ** 2
    l2 = (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(l1.maximum(l2), mask)
    # Counted only where clipping changed v (float rounding makes l2 > l1 by an ulp where it did not).
    used_clipped = (l2 > l1) & ((values - old_values).abs() > clip)
    return loss, masked_mean(used_clipped.float(), mask).detach()


def entropy_from_logits(logits: Tensor) -> Tensor:
    logp = logits.float().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_rewards(scores: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float,
                  placed: Tensor | None = None) -> Tensor:
    """Per-token rewards: -kl_coef*KL on every token (KL in the reward), the sequence score on the last model token.
    `placed` (B, R): the part of each score already on its tokens (a multi-turn environment's per-turn rewards, on
    the turns that earned them); only the rest of the score goes on the last token, so each row still sums to it."""
    rewards = mask.new_zeros(mask.shape).to(scores.dtype if scores.is_floating_point() else mask.float().dtype)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    rest = scores.to(rewards.dtype)
    if placed is not None:
        placed = placed.to(rewards.dtype)
        rewards = rewards + placed
        rest = rest - placed.sum(1)
    return rewards.scatter_add(1, last_token(mask)[:, None], rest[:, None])


def last_token(mask: Tensor) -> Tensor:
    """Each row's last position where `mask` is 1 (0 for an empty row): the end of a response, or of a multi-turn
    response's last model turn (its loss mask has holes where tools answered)."""
    positions = mask.new_ones(mask.shape).long().cumsum(1) - 1
    return (positions * mask.bool().long()).max(1).values


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer tokens, then falling linearly to -penalty at
    max_length (responses are cut there)."""
    if buffer <= 0:
        return lengths.float() * 0
    over = (lengths.float() - (max_length - buffer)).clamp(min=0, max=buffer)
    return -penalty * over / buffer


def trained_batch_stats(columns: Mapping[str, Tensor], kl: Tensor | None) -> dict[str, float]:
    """The statistics of the batch the actor trained on, from its tensor columns: mean reward (and cost), response
    length and token counts, and where it has them the mean entropy, KL (`kl`: per token, None when not measured)
    and gap between the trainer's old log-probs and the rollout engine's."""
    mask = columns["response_mask"]
    lengths = mask.sum(1).float()
    out = {"reward_mean": float(columns["scores"].mean()), "response_length_mean": float(lengths.mean()),
           "tokens": float(columns["attention_mask"].sum()), "response_tokens": float(lengths.sum())}
    if "entropy" in columns:
        out["entropy_mean"] = float(masked_mean(columns["entropy"], mask))
    if kl is not None:
        out["kl_mean"] = float(masked_mean(kl, mask))
    if "costs" in columns:
        out["cost_mean"] = float(columns["costs"].mean())
    if "rollout_log_probs" in columns and "old_log_probs" in columns:
        gap = (columns["old_log_probs"] - columns["rollout_log_probs"]).abs()
        out["rollout_log_prob_gap"] = float(masked_mean(gap, mask))
    return out
