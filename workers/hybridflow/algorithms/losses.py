"""Policy losses and loss aggregations, one registered function each.

A policy loss returns per-token losses (B, R) plus statistics; an aggregation reduces them to the scalar the
optimizer sees. Off-policy corrections (truncated IS and the others) weight the token losses between the two; they
are registered in hybridflow.algorithms.corrections.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hybridflow.algorithms.core import masked_mean
from hybridflow.algorithms.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class ClipConfig:
    low: float = 0.2  # ratio clipped to [1 - low, 1 + high]; DAPO's clip-higher raises `high` only
    high: float = 0.2
    dual: float | None = None  # dual-clip PPO: a negative advantage's loss is capped at -A * dual (dual > 1)


@dataclass
class TokenLosses:
    loss: Tensor  # (B, R), before aggregation
    clipped: Tensor  # (B, R) bool: the clipped branch was taken
    dual_clipped: Tensor | None = None


PolicyLoss = Callable[["Tensor", "Tensor", "Tensor", "Tensor", ClipConfig], TokenLosses]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
# (token losses, response mask, the job's maximum response length) -> the loss. Micro-batches may be cut to their own
# longest response (training.dynamicBatchSize), so a constant that depends on the width must come from the job.
Aggregation = Callable[..., "Tensor"]
LOSS_AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


def _clipped_objective(ratio: Tensor, adv: Tensor, clip: ClipConfig) -> TokenLosses:
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip.low, 1 + clip.high)
    loss = unclipped.maximum(clipped)
    if clip.dual is None:
        return TokenLosses(loss, clipped > unclipped)
    capped = loss.minimum(-adv * clip.dual)
    negative = adv < 0
    return TokenLosses(capped.where(negative, loss), clipped > unclipped, negative & (capped < loss))


# advantage_weighted: every token's loss (and gradient) is a multiple of its advantage, so a row whose advantages
# are all zero adds nothing to the update (training.skipZeroAdvantageRows leaves it out)
@POLICY_LOSSES.register("ppo", clip=None, advantage_weighted=True)  # None: training.clipRatio
def ppo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, clip: ClipConfig) -> TokenLosses:
    """PPO-clip per token: max(-A*r, -A*clip(r, 1-low, 1+high)), r = pi/pi_old; dual-clip when `clip.dual`."""
    return _clipped_objective((logp - old_logp).clamp(-20, 20).exp(), adv, clip)


# a sequence's ratio moves far less than a token's
@POLICY_LOSSES.register("gspo", clip=(3e-4, 4e-4), advantage_weighted=True)
def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, clip: ClipConfig) -> TokenLosses:
    """GSPO: one importance ratio per sequence, exp(mean over its tokens of log pi/pi_old), clipped as a whole.

    Each token's term carries that ratio's value and its own log-prob's gradient (the paper's token-level form)."""
    seq_log_ratio = masked_mean(logp - old_logp, mask, dim=1)
    log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]
    return _clipped_objective(log_ratio.clamp(max=10.0).exp(), adv, clip)


# `per`: what the mean runs over, so the engine weighs each micro-batch by its share of it (tokens or rows) and the
# accumulated gradient is the mini-batch's own aggregate, however the rows were grouped into micro-batches.
@LOSS_AGGREGATIONS.register("token-mean", per="tokens")
def token_mean(loss: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Every token weighs the same (DAPO): long responses count for more. Exactly so over a rank's mini-batch
    (micro-batches weigh by their tokens); across ranks each rank's mean counts equally (as verl did before its
    global token normalisation)."""
    return masked_mean(loss, mask)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum", per="rows")
def seq_mean_token_sum(loss: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Each response's summed token losses, averaged over responses."""
    return (loss * mask).sum(1).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-mean", per="rows")
def seq_mean_token_mean(loss: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Each response's mean token loss, averaged over responses (GRPO's original form, GSPO)."""
    return masked_mean(loss, mask, dim=1).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm", per="rows")
def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Summed token losses over a constant (the job's maximum response length), averaged over responses
    (Dr. GRPO): no length bias either way."""
    return (loss * mask).sum(1).mean() / (max_len or loss.shape[1])
