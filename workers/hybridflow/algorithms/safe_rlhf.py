"""Safe-RLHF (Dai et al. 2023; the paper's third dataflow): maximise reward subject to E[cost] <= costLimit.

A reward critic and a cost critic give two GAE advantages, left unwhitened so that lambda prices cost in its own
units; the Lagrangian multiplier lambda weighs them and rises while the batch's mean cost exceeds the limit
(projected gradient ascent on the dual; the paper's code uses Adam on log lambda). With KL in the reward, half the
penalty goes on the reward and half on the cost, so its weight in (A_r - lambda A_c) / (1 + lambda) does not shrink
as lambda grows. lambda is saved in checkpoints and exported as a metric.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridflow.algorithms.base import Algorithm, register_algorithm

if TYPE_CHECKING:
    from hybridflow.algorithms.dataflow import Batch, Dataflow


class Lagrangian:
    """lambda <- max(0, lambda + lr * (mean cost - limit))."""

    def __init__(self, init: float, lr: float, limit: float) -> None:
        self.value, self.lr, self.limit = init, lr, limit

    def update(self, mean_cost: float) -> float:
        self.value = max(0.0, self.value + self.lr * (mean_cost - self.limit))
        return self.value

    def state(self) -> dict[str, Any]:
        return {"value": self.value}

    def load(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])

    def metrics(self) -> dict[str, float]:
        return {"lagrange_multiplier": self.value}


def safe_rlhf_iteration(c: Dataflow[Batch], prompts: Batch) -> None:
    batch = c.generate(prompts)
    batch = c.compute(batch, "old_log_prob", "reference", "values", "cost_values", "reward", "cost")
    reward_adv, returns = c.advantages(batch, "scores", "values", kl_weight=0.5, whiten=False)
    cost_adv, cost_returns = c.advantages(batch, "costs", "cost_values", kl_weight=-0.5, whiten=False)
    lam = c.carried("lagrangian").update(float(batch["costs"].mean()))  # before the update, from this batch's cost
    batch = batch.with_columns(advantages=(reward_adv - lam * cost_adv) / (1 + lam), returns=returns,
                               cost_returns=cost_returns)
    c.update_critic(batch, "critic")
    c.update_critic(batch, "cost_critic")
    c.update_actor(batch)
    c.sync_weights()


register_algorithm(Algorithm(
    "safe_rlhf", safe_rlhf_iteration, "reward minus lambda * cost, lambda the Lagrangian multiplier of E[cost] <= "
    "costLimit; reward and cost critics", critic=True, cost=True,
    carried=lambda a: {"lagrangian": Lagrangian(a.lambda_init, a.lambda_lr, a.cost_limit)},
    defaults={"advantage_estimator": "gae", "policy_loss": "ppo", "loss_agg": "token-mean"}))
