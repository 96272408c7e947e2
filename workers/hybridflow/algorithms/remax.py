"""ReMax (Li et al. 2023; the paper's second dataflow): REINFORCE with the reward of a greedy response as the
baseline - no critic, one extra greedy generation per prompt, made in the same engine call as the samples."""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms.base import Algorithm, register_algorithm

if TYPE_CHECKING:
    from hybridflow.algorithms.dataflow import Batch, Dataflow


def remax_iteration(c: Dataflow[Batch], prompts: Batch) -> None:
    sampled, greedy = c.generate(prompts, greedy_baseline=True)  # one call: n samples + 1 greedy per prompt
    greedy = c.compute(greedy, "reward")  # the baseline: what the policy's best guess scores
    batch = c.compute(sampled, "old_log_prob", "reference", "reward")
    advantages, _ = c.advantages(batch, baseline=greedy["scores"].repeat_interleave(c.responses_per_prompt))
    batch = batch.with_columns(advantages=advantages)
    c.update_actor(batch)
    c.sync_weights()


register_algorithm(Algorithm(
    "remax", remax_iteration, "REINFORCE with a greedy response's reward as baseline (no critic)",
    greedy_baseline=True, defaults={"advantage_estimator": "remax", "policy_loss": "ppo", "loss_agg": "token-mean"}))
