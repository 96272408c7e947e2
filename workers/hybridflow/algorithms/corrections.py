"""Off-policy corrections, registered by name: per-token weights on the policy loss for tokens the rollout engine
sampled from a policy other than the trainer's (`spec.algorithm.offPolicyCorrection`).

Two log-probs meet here: the proximal policy's (the trainer's old log-probs, the PPO ratio's denominator) and the
behaviour policy's (what the rollout engine reported when it sampled). They differ because the engine's sampler is
not the trainer's forward pass (precision, kernels), and, with asynchronous rollout, because the engine ran
weights one or more versions older. A correction turns their ratio pi_prox / pi_behaviour into a weight per token
(0 drops the token's loss; the aggregation's denominator keeps it, as AReaL does) and reports the ratio's spread,
which becomes the update's statistics.

Torch-free like the other registries (tensor methods only), so the spec can list and check the names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, get_args

from hybridflow.algorithms.core import masked_mean
from hybridflow.algorithms.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

Level = Literal["token", "sequence"]  # masked_is: what one ratio belongs to
LEVELS: tuple[str, ...] = get_args(Level)


@dataclass(frozen=True)
class CorrectionSettings:
    """The spec's settings, resolved: each correction reads only the ones its entry lists (`defaults`)."""

    cap: float | None = None
    low: float | None = None
    high: float | None = None
    level: Level | None = None


@dataclass(frozen=True)
class Corrected:
    weights: Tensor  # (B, R), no gradient; 0 drops a token's loss
    stats: dict[str, float]


CorrectionFn = Callable[["Tensor", "Tensor", "Tensor", CorrectionSettings], Corrected]


@dataclass(frozen=True)
class OffPolicyCorrection:
    fn: CorrectionFn
    summary: str
    # The PPO ratio must be taken against the trainer's own old log-probs from the separate old_log_prob pass (a
    # proximal policy), so the update may not take them from its own first forward pass.
    needs_proximal: bool
    # The settings it reads and their defaults (None: unset means off); the spec refuses the others.
    defaults: Mapping[str, Any] = field(default_factory=dict)


OFF_POLICY_CORRECTIONS: Registry[OffPolicyCorrection] = Registry("off-policy correction")


@dataclass(frozen=True)
class JobCorrection:
    """The job's correction: a registered entry and its resolved settings (see roles.config.off_policy_correction)."""

    name: str
    settings: CorrectionSettings

    @property
    def entry(self) -> OffPolicyCorrection:
        return OFF_POLICY_CORRECTIONS[self.name]

    @property
    def needs_proximal(self) -> bool:
        return self.entry.needs_proximal

    def __call__(self, proximal_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> Corrected:
        return self.entry.fn(proximal_logp, behaviour_logp, mask, self.settings)


def _log_ratio(proximal_logp: Tensor, behaviour_logp: Tensor) -> Tensor:
    """log pi_prox / pi_behaviour, bounded so that exp() stays finite on a token either policy finds impossible."""
    return (proximal_logp - behaviour_logp).detach().clamp(-20.0, 20.0)


def ratio_stats(log_ratio: Tensor, mask: Tensor, dropped: Tensor | None = None) -> dict[str, float]:
    """The ratio's spread over response tokens, and the fraction of them whose loss the weights drop.

    Per micro-batch: the update averages them over micro-batches and ranks, so `is_ratio_max` is the mean of the
    micro-batches' maxima."""
    ratio, real = log_ratio.exp(), mask.bool()
    mean = masked_mean(ratio, mask)
    std = masked_mean((ratio - mean) ** 2, mask).sqrt()
    any_real = bool(real.any())
    return {
        "is_ratio_mean": mean.item(), "is_ratio_std": std.item(),
        "is_ratio_max": ratio[real].max().item() if any_real else 0.0,
        "is_ratio_min": ratio[real].min().item() if any_real else 0.0,
        "is_masked_fraction": 0.0 if dropped is None else masked_mean(dropped.to(ratio.dtype), mask).item(),
    }


def truncated_is_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """min(pi_old / pi_rollout, cap) per token, without gradient."""
    return (old_logp - rollout_logp).clamp(max=20.0).exp().clamp(max=cap).detach()


def truncated_is(proximal_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, s: CorrectionSettings) -> Corrected:
    """Truncated IS (verl's rollout_is "token" mode; what tisCap does): every token kept, weight
    min(pi_prox / pi_behaviour, cap)."""
    assert s.cap is not None, "tis needs a cap (the spec fills its default)"
    return Corrected(truncated_is_weights(proximal_logp, behaviour_logp, s.cap),
                     ratio_stats(_log_ratio(proximal_logp, behaviour_logp), mask))


def masked_is(proximal_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, s: CorrectionSettings) -> Corrected:
    """Masked IS (verl's rollout_is "mask" mode, MIS): a token (level token) or a whole response (level sequence,
    ratio = exp(mean over its tokens of the log-ratio), the geometric mean) whose ratio leaves [low, high] is dropped;
    the rest keep weight 1, so the kept tokens' gradient is unweighted and unbiased by large ratios."""
    assert s.low is not None and s.high is not None and s.level in LEVELS, "masked_is needs low, high and a level"
    log_ratio = _log_ratio(proximal_logp, behaviour_logp)
    judged = log_ratio if s.level == "token" else masked_mean(log_ratio, mask, dim=1)[:, None].expand_as(log_ratio)
    ratio = judged.exp()
    dropped = (ratio < s.low) | (ratio > s.high)
    return Corrected((~dropped).to(proximal_logp.dtype), ratio_stats(log_ratio, mask, dropped))


def decoupled(proximal_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, s: CorrectionSettings) -> Corrected:
    """The decoupled PPO loss (Hilton et al., "Batch size-invariance for policy optimization"; AReaL, Fu et al.
    2025): the PPO ratio is pi / pi_prox (the policy loss gets the proximal log-probs as its old ones) and each
    token's loss is weighted by pi_prox / pi_behaviour. With `cap`, a token whose weight exceeds it is dropped
    (weight 0, as AReaL's behav_imp_weight_cap), not clipped: a token that stale is not trusted at any weight."""
    log_ratio = _log_ratio(proximal_logp, behaviour_logp)
    weights = log_ratio.exp()
    if s.cap is None:
        return Corrected(weights, ratio_stats(log_ratio, mask))
    dropped = weights > s.cap
    return Corrected(weights.masked_fill(dropped, 0.0), ratio_stats(log_ratio, mask, dropped))


OFF_POLICY_CORRECTIONS.add("tis", OffPolicyCorrection(
    truncated_is, "truncated IS: each token's loss weighted by min(pi_old/pi_rollout, cap)", needs_proximal=False,
    defaults={"cap": 2.0}))
OFF_POLICY_CORRECTIONS.add("masked_is", OffPolicyCorrection(
    masked_is, "masked IS: tokens or sequences whose ratio leaves [low, high] are dropped, the rest weigh 1",
    needs_proximal=False, defaults={"low": 0.5, "high": 2.0, "level": "token"}))
OFF_POLICY_CORRECTIONS.add("decoupled", OffPolicyCorrection(
    decoupled, "decoupled PPO: ratio against the recomputed proximal policy, loss weighted by pi_prox/pi_behaviour",
    needs_proximal=True, defaults={"cap": None}))
