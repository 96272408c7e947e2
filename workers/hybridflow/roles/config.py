"""Each role's own section of the job spec: a worker is handed what it reads and nothing else, so what can change
a role's behaviour is visible in one place. Built by pure functions from the resolved JobSpec; torch-free."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from hybridflow.spec import Algorithm, JobSpec, ModelSource, Rollout, Training


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ActorConfig(_Section):
    """The policy: trains with the algorithm's loss on `training`, generates with `rollout`."""

    model: ModelSource
    algorithm: Algorithm
    rollout: Rollout
    training: Training
    prompts_per_step: int  # mini-batches are a fraction of the step's prompts
    seed: int


class CriticConfig(_Section):
    model: ModelSource  # spec.models.critic, else the actor's architecture with a fresh value head
    dtype: str
    training: Training
    prompts_per_step: int
    seed: int


class ScoringConfig(_Section):
    """A frozen model that scores batches: the reference policy, or a reward or cost model."""

    model: ModelSource
    temperature: float  # the reference's log-probs are of the same tempered distribution the actor samples from
    micro_batch_size: int
    seed: int


def actor_config(spec: JobSpec) -> ActorConfig:
    return ActorConfig(model=spec.models.actor, algorithm=spec.algorithm, rollout=spec.rollout,
                       training=spec.training, prompts_per_step=spec.trainer.prompts_per_step, seed=spec.trainer.seed)


def critic_config(spec: JobSpec) -> CriticConfig:
    return CriticConfig(model=spec.models.critic or spec.models.actor, dtype=spec.models.actor.dtype,
                        training=spec.training, prompts_per_step=spec.trainer.prompts_per_step, seed=spec.trainer.seed)


def reference_config(spec: JobSpec) -> ScoringConfig:
    return ScoringConfig(model=spec.models.actor, temperature=spec.rollout.temperature,
                         micro_batch_size=spec.training.micro_batch_size, seed=spec.trainer.seed)


def judge_config(spec: JobSpec, judges: str) -> ScoringConfig:
    """The reward model (`judges="reward"`) or the cost model (`"cost"`)."""
    judged = spec.models.reward if judges == "reward" else spec.models.cost
    if judged is None or judged.model is None:
        raise ValueError(f"spec.models.{judges}.model is not set: there is no {judges} model to run")
    return ScoringConfig(model=judged.model, temperature=1.0, micro_batch_size=spec.training.micro_batch_size,
                         seed=spec.trainer.seed)
