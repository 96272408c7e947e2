"""GRPO and the critic-free family that shares its dataflow: several responses per prompt, an outcome score each,
advantages from the scores alone. They differ only in the estimator, the loss and its aggregation (their defaults).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms.base import Algorithm, register_algorithm

if TYPE_CHECKING:
    from hybridflow.algorithms.dataflow import Batch, Dataflow


def outcome_iteration(c: Dataflow[Batch], prompts: Batch) -> None:
    batch = c.generate(prompts)  # responsesPerPrompt samples per prompt, groups adjacent
    batch = c.compute(batch, "old_log_prob", "reference", "reward")
    advantages, _ = c.advantages(batch)
    batch = batch.with_columns(advantages=advantages)
    c.update_actor(batch)
    c.sync_weights()


def _outcome(name: str, summary: str, min_group: int = 2, **defaults: object) -> None:
    base = {"advantage_estimator": "grpo", "policy_loss": "ppo", "loss_agg": "token-mean"}
    register_algorithm(Algorithm(name, outcome_iteration, summary, min_group=min_group, defaults={**base, **defaults}))


_outcome("grpo", "group-normalised outcome advantages (score - group mean) / group std")
_outcome("dr_grpo", "GRPO done right: no std normalisation, losses summed over a constant length",
         norm_adv_by_std=False, loss_agg="seq-mean-token-sum-norm")
_outcome("rloo", "REINFORCE leave-one-out: each score minus the mean of the prompt's other responses",
         advantage_estimator="rloo", loss_agg="seq-mean-token-mean")
_outcome("reinforce_plus_plus", "REINFORCE++: discounted token returns with the KL penalty, whitened over the batch",
         min_group=1, advantage_estimator="reinforce_plus_plus", kl_in="reward")
_outcome("reinforce_plus_plus_baseline", "REINFORCE++ with the group mean as baseline, whitened over the batch",
         advantage_estimator="reinforce_plus_plus_baseline")
_outcome("gspo", "group advantages with a sequence-level importance ratio (GSPO), clipped as a whole",
         policy_loss="gspo", loss_agg="seq-mean-token-mean")
