"""What one RLHF step asks of each role, read off the spec: how many sequences are generated, how many tokens each
pass runs over, how many optimizer steps the update takes, and which stage each role works in. The stage-time model
prices this; nothing here depends on devices."""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.algorithms import ALGORITHMS
from hybridflow.api import JobSpec
from hybridflow.api.engines import TRAIN_ENGINES
from hybridflow.api.roles import trained_roles

# The stages of a step, in the paper's order: generation, preparation (log-probs, values, rewards: every scoring
# pass), training (the updates); the transition (train -> generate resharding) and the cross-pool weight stream
# are priced apart (stage_time.step_seconds).
GENERATE, PREPARE, UPDATE = "generate", "prepare", "update"
TRAINED = trained_roles()  # hold optimizer state; share spec.training's layout (api.roles)
FROZEN = ("reference", "reward", "cost")  # scoring only, FSDP over their pool (memory.terms.frozen_terms)


@dataclass(frozen=True)
class Workload:
    """One step's work, independent of placement."""

    prompts: int  # trainer.promptsPerStep
    responses: int  # rows generated per prompt: responsesPerPrompt (+1 greedy baseline: remax)
    prompt_len: int  # rollout.maxPromptLength (the model prices full lengths, as the memory model does)
    response_len: int  # rollout.maxResponseLength
    epochs: int  # training.ppoEpochs
    optimizer_steps: int  # mini-batches per epoch: promptsPerStep / miniBatchSize
    old_log_probs_from_update: bool  # the actor's update gives the old log-probs: no separate actor forward
    shared_prompt: bool  # training.sharedPrompt: the FSDP engine runs a group's prompt once
    prefix_caching: bool  # rollout.prefixCaching: a prompt is prefilled once for its responses
    async_waste: float = 0.0  # mode async: batches generated and dropped as too stale per batch trained (async_waste)

    @property
    def sequences(self) -> int:
        return self.prompts * self.responses

    @property
    def step_tokens(self) -> int:
        """The paper's throughput numerator: prompt and response tokens of the global batch."""
        return self.sequences * (self.prompt_len + self.response_len)

    def pass_tokens(self, engine: str) -> int:
        """Tokens one pass over the batch runs: with sharedPrompt, FSDP runs each group's prompt once; megatron
        runs rows unshared (training.sharedPrompt's description)."""
        if self.shared_prompt and self.responses > 1 and not TRAIN_ENGINES[engine].model_parallel:
            return self.prompts * (self.prompt_len + self.responses * self.response_len)
        return self.step_tokens


def workload(spec: JobSpec) -> Workload:
    """The spec's step. old_log_probs_from_update follows roles/config.py's rule (one epoch over one mini-batch, no
    KL in the reward, no off-policy correction that needs a proximal policy); a correction of any kind is taken to
    need the separate forward here, which can only overprice the step."""
    a, t, r = spec.algorithm, spec.training, spec.rollout
    algorithm = ALGORITHMS[a.name]
    mini = t.mini_batch_size or spec.trainer.prompts_per_step
    one_step = t.ppo_epochs == 1 and mini == spec.trainer.prompts_per_step
    kl_before = a.kl_in == "reward" and a.kl_coef > 0
    corrected = a.tis_cap is not None or a.off_policy_correction is not None
    return Workload(
        prompts=spec.trainer.prompts_per_step, responses=r.responses_per_prompt + int(algorithm.greedy_baseline),
        prompt_len=r.max_prompt_length, response_len=r.max_response_length, epochs=t.ppo_epochs,
        optimizer_steps=max(1, spec.trainer.prompts_per_step // mini),
        old_log_probs_from_update=t.on_policy_old_log_probs and one_step and not kl_before and not corrected,
        shared_prompt=t.shared_prompt, prefix_caching=r.prefix_caching, async_waste=async_waste(spec))


def async_waste(spec: JobSpec) -> float:
    """Mode async with whole responses, when generation outpaces training: the producer keeps the trajectory queue
    full (rollout.queuePrompts, Q batches with those in flight), so a batch waits about Q steps in it, and with Q
    above maxStaleness s it is dropped as too stale; the batches generated after a drop are fresh. In steady state
    (Q - s) / (s + 1) batches are dropped per batch trained: the default queue of 2 batches at s = 1 drops every
    other batch, as the step log's dropped_stale shows on CPU (bench/plan.py). A discrete simulation of the queue
    (producer, staleness bound, syncs between engine calls) gives the same rate for Q <= 4, s <= 2. Partial
    rollouts re-tag tokens with newer weights: taken as no waste."""
    r = spec.rollout
    if r.partial_rollout_tokens:
        return 0.0
    prompts = spec.trainer.prompts_per_step
    queue = (r.queue_prompts or 2 * prompts) / prompts
    return max(0.0, queue - r.max_staleness) / (r.max_staleness + 1)


def on_policy_update(work: Workload, mode: str) -> bool:
    """Whether the actor's update gives the old log-probs (no separate forward): only in mode sync; one_step_off and
    async train on a batch older than the policy, so the trainer runs its own old-log-prob pass (trainer/step.py)."""
    return work.old_log_probs_from_update and mode == "sync"


def role_passes(role: str, work: Workload, mode: str = "sync") -> dict[str, str]:
    """Stage -> the kind of pass a role runs in it ("train", "forward" or "generate") in rollout mode `mode`."""
    if role == "rollout":
        return {GENERATE: "generate"}
    if role == "actor":
        return {UPDATE: "train"} if on_policy_update(work, mode) else {PREPARE: "forward", UPDATE: "train"}
    if role in TRAINED:
        return {PREPARE: "forward", UPDATE: "train"}
    return {PREPARE: "forward"}
