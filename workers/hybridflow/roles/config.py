"""Each role's own section of the job spec: a worker is handed what it reads and nothing else, so what can change
a role's behaviour is visible in one place. Built by pure functions from the resolved JobSpec; torch-free."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from hybridflow.algorithms.corrections import CorrectionSettings, JobCorrection
from hybridflow.api import Algorithm, JobSpec, ModelSource, Rollout, Training
from hybridflow.api.engines import ROLLOUT_ENGINES, TRAIN_ENGINES, RolloutEngineKind, TrainEngineKind
from hybridflow.data.files import job_private_paths

# Critics, the reference and reward/cost models run on this training engine whatever the actor's is: they hold HF
# heads (values, scores) that only it builds.
SCORING_TRAIN_ENGINE = "fsdp"


class _Section(BaseModel):
    """Engine kinds travel resolved (name, factory path and facts), so a worker builds what the driver's registry
    named, including an engine registered only in the driver's process (its module importable on the workers)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ActorConfig(_Section):
    """The policy: trains with the algorithm's loss on `training`, generates with `rollout`."""

    model: ModelSource
    algorithm: Algorithm
    rollout: Rollout
    training: Training
    prompts_per_step: int  # mini-batches are a fraction of the step's prompts
    generation_batch: int  # the most sequences one generation call holds job-wide (sizes the KV cache)
    seed: int
    train_engine: TrainEngineKind  # spec.training.engine, resolved
    rollout_engine: RolloutEngineKind  # spec.rollout.engine, resolved
    chat_template: str | None = None  # spec.data.chatTemplate: multi-turn rollouts render answers as prompts are
    private_paths: tuple[str, ...] = ()  # the job's data and checkpoints: out of its tools' and environments' sight

    @property
    def old_log_probs_from_update(self) -> bool:
        return old_log_probs_from_update(self.training, self.algorithm, self.prompts_per_step)


def old_log_probs_from_update(training: Training, algorithm: Algorithm, prompts_per_step: int) -> bool:
    """Whether the actor's update is on-policy, so that its own first forward pass gives the old log-probs: one
    epoch over one mini-batch (the weights never move before a token's loss is taken) and nothing needs them
    before the update (KL in the reward is computed from them when advantages are), and the off-policy correction
    does not ask for a proximal policy of its own (the decoupled loss)."""
    one_step = training.ppo_epochs == 1 and training.mini_batch_size in (0, prompts_per_step)
    kl_before_update = algorithm.kl_in == "reward" and algorithm.kl_coef > 0
    correction = off_policy_correction(algorithm)
    needs_proximal = correction is not None and correction.needs_proximal
    return training.on_policy_old_log_probs and one_step and not kl_before_update and not needs_proximal


def off_policy_correction(algorithm: Algorithm) -> JobCorrection | None:
    """The job's off-policy correction, or None: `spec.algorithm.offPolicyCorrection`, or `tisCap: c`, shorthand for
    {name: tis, cap: c}. The one place the spec becomes a correction, so the actor's loss, the rollout's request for
    the engine's log-probs and the old-log-prob stage all agree."""
    if algorithm.tis_cap is not None:
        return JobCorrection("tis", CorrectionSettings(cap=algorithm.tis_cap))
    c = algorithm.off_policy_correction
    if c is None:
        return None
    return JobCorrection(c.name, CorrectionSettings(cap=c.cap, low=c.low, high=c.high, level=c.level))


def wants_rollout_log_probs(algorithm: Algorithm) -> bool:
    """Whether sampled generations must carry the engine's own log-probs (the behaviour policy's): every correction
    reads them."""
    return off_policy_correction(algorithm) is not None


class CriticConfig(_Section):
    model: ModelSource  # spec.models.critic, else the actor's architecture with a fresh value head
    dtype: str
    training: Training
    prompts_per_step: int
    seed: int
    train_engine: TrainEngineKind


class ScoringConfig(_Section):
    """A frozen model that scores batches: the reference policy, or a reward or cost model."""

    model: ModelSource
    temperature: float  # the reference's log-probs are of the same tempered distribution the actor samples from
    micro_batch_size: int
    compute_dtype: str
    dynamic_batch_size: bool
    seed: int
    train_engine: TrainEngineKind
    shared_prompt: bool = False  # a reward model scores whole sequences, one per row


class JudgeConfig(_Section):
    """A generative judge (spec.models.reward.judge): its model and engine, and its engine's rollout settings."""

    model: ModelSource
    rollout: Rollout  # the judge's engine's: its context, answer length and engine name (greedy, no agent)
    compute_dtype: str
    seed: int
    rollout_engine: RolloutEngineKind
    sequences: int  # the most requests one engine call holds on a rank (spec.models.reward.judge.batchSize)


def judge_config(spec: JobSpec) -> JudgeConfig:
    j = spec.models.reward.judge
    if j is None:
        raise ValueError("spec.models.reward.judge is not set: there is no judge to run")
    rollout = Rollout(engine=j.engine, max_prompt_length=j.max_prompt_length, max_response_length=j.max_tokens,
                      responses_per_prompt=1, temperature=1.0, gpu_memory_utilization=j.gpu_memory_utilization)
    return JudgeConfig(model=j.model, rollout=rollout, compute_dtype=spec.training.compute_dtype,
                       seed=spec.trainer.seed, rollout_engine=ROLLOUT_ENGINES[j.engine], sequences=j.batch_size)


def actor_config(spec: JobSpec) -> ActorConfig:
    r = spec.rollout
    per_call = max(spec.trainer.prompts_per_step * (r.responses_per_prompt + 1), spec.data.eval_prompts)
    return ActorConfig(model=spec.models.actor, algorithm=spec.algorithm, rollout=r, training=spec.training,
                       prompts_per_step=spec.trainer.prompts_per_step, generation_batch=per_call, seed=spec.trainer.seed,
                       train_engine=TRAIN_ENGINES[spec.training.engine], rollout_engine=ROLLOUT_ENGINES[r.engine],
                       chat_template=spec.data.chat_template,
                       private_paths=job_private_paths(spec) if r.agent is not None else ())


def critic_config(spec: JobSpec) -> CriticConfig:
    return CriticConfig(model=spec.models.critic or spec.models.actor, dtype=spec.models.actor.dtype,
                        training=spec.training, prompts_per_step=spec.trainer.prompts_per_step, seed=spec.trainer.seed,
                        train_engine=TRAIN_ENGINES[SCORING_TRAIN_ENGINE])


def reference_config(spec: JobSpec) -> ScoringConfig:
    t = spec.training
    return ScoringConfig(model=spec.models.actor, temperature=spec.rollout.temperature,
                         micro_batch_size=t.micro_batch_size, compute_dtype=t.compute_dtype,
                         dynamic_batch_size=t.dynamic_batch_size, seed=spec.trainer.seed,
                         train_engine=TRAIN_ENGINES[SCORING_TRAIN_ENGINE], shared_prompt=t.shared_prompt)


def scoring_model_config(spec: JobSpec, judges: str) -> ScoringConfig:
    """The reward model (`judges="reward"`) or the cost model (`"cost"`)."""
    judged = spec.models.reward if judges == "reward" else spec.models.cost
    if judged is None or judged.model is None:
        raise ValueError(f"spec.models.{judges}.model is not set: there is no {judges} model to run")
    t = spec.training
    return ScoringConfig(model=judged.model, temperature=1.0, micro_batch_size=t.micro_batch_size,
                         compute_dtype=t.compute_dtype, dynamic_batch_size=t.dynamic_batch_size, seed=spec.trainer.seed,
                         train_engine=TRAIN_ENGINES[SCORING_TRAIN_ENGINE])
