"""KL(pi || ref) estimators from samples of pi, and controllers of the KL coefficient, registered by name.

Estimators (Schulman, "Approximating KL divergence"): k1 = log r, k2 = (log r)^2 / 2, k3 = r' - 1 - log r' with
r' = ref/pi (unbiased and never negative). Controllers: `fixed`, and `adaptive` (Ziegler et al. 2019), which moves
the coefficient so that the measured KL tracks `targetKl`; its value is saved in checkpoints.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from hybridflow.algorithms.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

KLEstimator = Callable[["Tensor", "Tensor"], "Tensor"]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
KL_CONTROLLERS: Registry[type] = Registry("KL controller")


@KL_ESTIMATORS.register("k1")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    r = (ref_logp - logp).clamp(-20, 20)
    return (r.exp() - 1 - r).clamp(max=10)


@KL_CONTROLLERS.register("fixed")
class FixedKL:
    """The coefficient stays `klCoef`."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 0) -> None:
        self.value = coef

    def update(self, measured_kl: float, n_steps: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"value": self.value}

    def load(self, state: dict[str, Any]) -> None:
        """Nothing to restore: a fixed coefficient is the spec's, so a resumed job with a new klCoef uses it."""


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKL(FixedKL):
    """value *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon after each iteration."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000) -> None:
        super().__init__(coef)
        if target is None or target <= 0 or horizon <= 0:
            raise ValueError("an adaptive KL controller needs targetKl > 0 and klHorizon > 0")
        self.target, self.horizon = target, horizon

    def update(self, measured_kl: float, n_steps: int) -> None:
        error = min(max(measured_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon

    def load(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
