"""PPO (the paper's Figure 4 listing): a critic's values, per-token rewards with the KL penalty, GAE."""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms.base import Algorithm, register_algorithm

if TYPE_CHECKING:
    from hybridflow.algorithms.dataflow import Batch, Dataflow


def ppo_iteration(c: Dataflow[Batch], prompts: Batch) -> None:
    batch = c.generate(prompts)
    batch = c.compute(batch, "old_log_prob", "reference", "values", "reward")
    advantages, returns = c.advantages(batch)  # GAE over score-at-the-end rewards minus the per-token KL penalty
    batch = batch.with_columns(advantages=advantages, returns=returns)
    c.update_critic(batch)
    c.update_actor(batch)
    c.sync_weights()  # train -> generate: the 3D-HybridEngine transition


register_algorithm(Algorithm(
    "ppo", ppo_iteration, "GAE with a critic; KL against the reference as a reward penalty or a loss",
    critic=True, defaults={"advantage_estimator": "gae", "policy_loss": "ppo", "loss_agg": "token-mean"}))
