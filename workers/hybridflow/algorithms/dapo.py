"""DAPO (Yu et al. 2025): GRPO's dataflow plus dynamic sampling - a group whose responses all score the same has
zero advantage and teaches nothing, so it is dropped and more prompts are sampled until the batch is full (at most
maxSamplingRounds generations). Clip-higher and token-level aggregation come as its defaults; overlong shaping is
algorithm.overlongBuffer (off unless set, since it depends on the response budget)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms.base import Algorithm, register_algorithm

if TYPE_CHECKING:
    from hybridflow.algorithms.dataflow import Batch, Dataflow


def dapo_iteration(c: Dataflow[Batch], prompts: Batch) -> None:
    informative: list[Batch] = []
    for round_ in range(c.max_sampling_rounds):
        if round_:
            prompts = c.next_prompts()
        batch = c.compute(c.generate(prompts), "reward")
        informative += c.groups_with_varied_scores(batch)
        if len(informative) >= c.prompts_per_step:
            break
    batch = c.fill_batch(informative, spare=batch)  # short after the last round: topped up with uniform groups
    batch = c.compute(batch, "old_log_prob", "reference")
    advantages, _ = c.advantages(batch)
    batch = batch.with_columns(advantages=advantages)
    c.update_actor(batch)
    c.sync_weights()


register_algorithm(Algorithm(
    "dapo", dapo_iteration, "GRPO with dynamic sampling, clip-higher, token-mean loss and overlong shaping",
    min_group=2, defaults={"advantage_estimator": "grpo", "policy_loss": "ppo", "loss_agg": "token-mean",
                           "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "max_sampling_rounds": 3}))
