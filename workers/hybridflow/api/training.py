"""The spec's training section (`spec.training`): the training engine, batch sizes, learning rates, clipping,
parallelism, LoRA (`spec.training.lora`: adapters trained on a frozen base), and the throughput switches (compute
dtype, padding-free and shared-prompt micro-batches, on-policy old log-probs), each of which changes how the work is
done and never its result."""
from __future__ import annotations

from typing import Collection, Literal

from pydantic import Field, field_validator

from hybridflow.api.engines import TRAIN_ENGINES
from hybridflow.api.fields import MAX_COUNT, ModuleName, SpecModel, registered

LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# megatron-core's linears of a decoder layer -> the HF projections each one is (q/k/v and gate/up fused): its LoRA
# engine puts one adapter on each linear (engines/train/megatron_lora.py), so a target set takes all of a fused
# group or none of it (api.rules). Here, torch-free, because both read it.
MEGATRON_LINEAR_PARTS: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
# HF config.model_type -> the linear modules that get adapters when spec.training.lora.targetModules is empty: every
# attention and MLP projection (what the LoRA-for-RL results train; PEFT's own default is q_proj and v_proj only).
# Here, torch-free, because both the engine (models/lora.py) and the memory model (memory/) read it.
# HF model families (config.model_type) whose decoder is the Llama pattern: q/k/v/o and gate/up/down projections, HF's
# registered attention functions. LoRA's default targets and the CPU attention (engines.train.cpu_attention) know them.
LLAMA_PATTERN_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "olmo2")
LORA_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {family: LORA_PROJECTIONS for family in LLAMA_PATTERN_FAMILIES}


class Lora(SpecModel):
    """Low-rank adapters (HF peft's LoRA) trained on a frozen base model: the optimizer state and gradients are the
    adapters' (a few MB), each weight sync moves only the adapters, and the reference policy is the base with the
    adapters switched off, so no second model is held. PEFT's names for each field."""

    rank: int = Field(16, gt=0, le=4096, description="r: the adapters' rank.")
    alpha: float = Field(32.0, gt=0, description="lora_alpha: the adapters' output is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="lora_dropout, on the adapters' input while training.")
    target_modules: list[ModuleName] = Field(
        default_factory=list, max_length=64,
        description="Names of the linear modules that get adapters (PEFT's target_modules: a module whose name ends "
        "with one of them). Empty: the model family's default (every attention and MLP projection of llama, qwen2, "
        "mistral...: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)."
    )
    critic: bool = Field(
        False, description="The critic trains an adapter of its own too (with its value head trained whole) instead "
        "of every weight."
    )


class Training(SpecModel):
    engine: str = Field("fsdp", description="fsdp: torch FSDP2; megatron: megatron-core 3D.",
                        json_schema_extra={"enum": TRAIN_ENGINES.names()})
    micro_batch_size: int = Field(16, gt=0, le=MAX_COUNT, description="Sequences per forward/backward on one device.")
    mini_batch_size: int = Field(
        0, ge=0, le=MAX_COUNT, description="Prompts per optimizer step (0: the whole batch, one step)."
    )
    ppo_epochs: int = Field(1, gt=0, le=1024, description="Passes over each batch.")
    actor_lr: float = Field(1e-3, gt=0, description="Actor learning rate.")
    critic_lr: float = Field(1e-3, gt=0, description="Critic learning rate.")
    clip_ratio: float = Field(0.2, gt=0, description="PPO-clip epsilon.")
    value_clip: float = Field(0.5, gt=0, description="Clipped value loss range.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    tensor_parallel: int = Field(1, gt=0, le=1024, description="Training TP size (megatron).")
    pipeline_parallel: int = Field(1, gt=0, le=1024, description="Training PP size (megatron).")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Dtype of forward and backward passes and of generation; weights and optimizer state stay "
        "in the model's dtype (fp32 masters). auto: bfloat16 where the device computes it natively (GPUs with bf16, "
        "CPUs with AVX512-BF16 or AMX), else float32. The megatron engine computes in the model's dtype (auto "
        "means that there; set spec.models.actor.dtype to train it in bfloat16)."
    )
    dynamic_batch_size: bool = Field(
        True, description="Micro-batches of length-sorted rows, each cut to its own longest prompt and response and "
        "filled up to microBatchSize x (maxPromptLength + maxResponseLength) tokens, instead of microBatchSize rows "
        "padded to the maximum lengths."
    )
    shared_prompt: bool = Field(
        True, description="Rows of a micro-batch with the same prompt (a group of responsesPerPrompt samples) run "
        "as one sequence, the prompt once and then each response, with an attention mask in which each response sees "
        "the prompt and itself only: the same log-probs, values and gradients for fewer tokens. For the FSDP engine's "
        "update, old log-probs, reference and critic; the megatron engine runs rows unshared."
    )
    on_policy_old_log_probs: bool = Field(
        True, description="When the update is on-policy (one epoch over one mini-batch, no KL in the reward), the old "
        "log-probs are the update's own forward pass, detached, instead of a separate forward over the batch."
    )
    skip_zero_advantage_rows: bool = Field(
        True, description="The actor's update leaves out of its forward and backward the rows whose advantages are "
        "all exactly zero (a GRPO group whose samples all scored the same), still counting them in what the loss "
        "averages over: their policy-loss gradient is zero, so the optimizer step is the same for less compute. "
        "Only where that holds: no entropy bonus (algorithm.entropyCoef 0), no KL term in the loss, and a policy "
        "loss weighted by the advantage (ppo, gspo). pg_loss and clip_frac, 0 on such rows, keep their whole-batch "
        "values; the statistics observed on the rows (entropy and KL where the update gives the old log-probs, "
        "approx_kl, the off-policy correction's) are means over the rows computed, and a step that computed none "
        "reports none. update_rows_skipped says what share was left out."
    )
    keep_gathered_for_backward: Literal["auto", "on", "off"] = Field(
        "auto", description="FSDP: the layer weights gathered from the other ranks for an optimizer step's first "
        "forward stay whole through its last micro-batch's backward (one all-gather of each layer per optimizer "
        "step instead of two per micro-batch), holding the whole model in the compute dtype on each rank through "
        "the update; a forward without backward still reshards each layer after it. auto: on for CPU "
        "pools of more than one rank (there a gather is a copy on the cores that compute, and host memory is ample), "
        "off on one rank (nothing to gather: only memory to lose) and on GPUs (NCCL's gathers overlap compute; "
        "device memory is not ample). Quote \"on\" and \"off\". One rank whose weights are in the compute dtype "
        "(fp32 on an AVX2 CPU) trains a plain module, not an FSDP one: there this switch does nothing."
    )
    reduce_gradients_per_step: Literal["auto", "on", "off"] = Field(
        "auto", description="FSDP: gradients are reduce-scattered once per optimizer step, after the last "
        "micro-batch, instead of after each: the micro-batches accumulate the whole model's fp32 gradients on each "
        "rank (4 bytes a parameter instead of 4 / ranks). auto: on for CPU pools of more than one rank, off on one "
        "rank and on GPUs (as keepGatheredForBackward). Quote \"on\" and \"off\". Nothing on a plain module (as "
        "keepGatheredForBackward)."
    )

    fp32_attention_backward: Literal["auto", "on", "off"] = Field(
        "auto", description="FSDP engine on CPU, computing in bfloat16: the attention's backward runs in fp32 "
        "(torch's CPU flash-attention kernel, forward in bf16 as before, saving what sdpa saves with a mask), "
        "because that kernel's bf16 backward is ~2.4x slower than its fp32 one on AMX Xeons (measured: "
        "docs/performance.md); gradients come out more precise, not different in kind. auto: on for CPU pools "
        "computing in bfloat16, off on GPUs (their kernels are native) and in float32 (where it changes nothing). "
        "Quote \"on\" and \"off\". Llama-pattern model families only (llama, qwen2/3, mistral, gemma/2, olmo2); the "
        "megatron engine has its own attention (\"on\" is refused there)."
    )

    lora: Lora | None = Field(
        None, description="Train LoRA adapters on a frozen base instead of every weight (the FSDP engine; megatron at "
        "tensorParallel 1 and pipelineParallel 1). Absent: full fine-tuning."
    )

    @field_validator("engine")
    @classmethod
    def _engine_registered(cls, value: str) -> str:
        return registered(TRAIN_ENGINES, value)


def fsdp_switch_on(switch: str, device: str, ranks: int) -> bool:
    """An FSDP communication switch (training.keepGatheredForBackward, reduceGradientsPerStep) on a pool of
    `ranks` ranks of `device`: auto is on for CPU pools of more than one rank, where a gather or a reduction is a copy
    through gloo on the very cores that compute (measured: bench/throughput.py --ablate), and off on GPUs, whose
    NCCL collectives overlap compute on their own stream and whose memory the whole model's gathered weights or
    gradients would take. On one rank there is nothing to gather or reduce: a gather is a copy of the rank's own
    weights, so keeping it whole or accumulating unsharded gradients only adds a model's worth of memory (measured
    on SmolLM2, one rank of two threads: 0.6 GB more for the same update seconds; where it computes in bf16 from fp32
    masters a gather is a cast, and keeping it took 15% off the update for 0.28 GB more on an AMX Xeon, past TRL's
    memory: docs/performance.md). The engine (engines.train.fsdp) and the memory model (memory.terms) both read it
    here."""
    return switch == "on" or (switch == "auto" and device != "gpu" and ranks > 1)


def fp32_attention_backward_on(switch: str, device: str, compute_dtype: str) -> bool:
    """training.fp32AttentionBackward on a pool of `device` computing in `compute_dtype`: auto is on for CPUs
    computing in bf16, where torch's flash-attention backward is 2.4x faster in fp32 (one SmolLM2 layer's
    shared-prompt micro-batch on an AMX Xeon: 4.4 ms against 12.0; the bf16 update 13% shorter), and off on GPUs and
    in fp32, where the kernel already runs natively (engines.train.cpu_attention)."""
    return switch == "on" or (switch == "auto" and device != "gpu" and compute_dtype == "bfloat16")


_GATHERS_NOTHING = "shards by tensorParallel x pipelineParallel and gathers nothing"
# The FSDP engine's switches (camelCase) and why a model-parallel engine (megatron) would ignore each
FSDP_ONLY_SWITCHES = {"keepGatheredForBackward": _GATHERS_NOTHING, "reduceGradientsPerStep": _GATHERS_NOTHING,
                      "fp32AttentionBackward": "runs an attention of its own, not HF's"}


def fsdp_switches_forced_on(training: Training) -> list[str]:
    """The FSDP engine's switches the spec sets "on" (camelCase field names, FSDP_ONLY_SWITCHES): what a
    model-parallel engine (megatron) cannot honour. The rules refuse such a pair and the planner offers none."""
    values = {"keepGatheredForBackward": training.keep_gathered_for_backward,
              "reduceGradientsPerStep": training.reduce_gradients_per_step,
              "fp32AttentionBackward": training.fp32_attention_backward}
    return [field for field in FSDP_ONLY_SWITCHES if values[field] == "on"]


def fsdp_unsharded(ranks: int, weight_dtypes: Collection[str], compute_dtype: str) -> bool:
    """Whether the FSDP engine trains a model as a plain module instead of under FSDP2: on one rank whose weights are
    all in the compute dtype (fp32 masters computing in fp32, on an AVX2 CPU) there is nothing to shard, gather,
    reduce or cast, and FSDP2 would still copy every layer into a gathered buffer for each forward and backward
    (measured on SmolLM2, one rank of two threads: about 1 s of a 19-s update, or with the weights kept gathered 0.5
    GB more). Weights in another dtype than the compute's (fp32 masters computing in bf16; LoRA's fp32 adapters on a
    bf16 base) keep FSDP2, whose mixed-precision policy casts each layer for compute. The engine
    (engines.train.fsdp) and the memory model (memory.terms) both read it here."""
    return ranks == 1 and set(weight_dtypes) == {compute_dtype}


def role_lora(role: str, training: Training) -> Lora | None:
    """The adapters `role` trains: the actor's whenever spec.training.lora is set, a critic's (critic, cost_critic)
    only with `lora.critic`; None: the role trains every weight, or nothing. The one place that says which roles
    LoRA reaches (the engines, checkpoints' identity and the memory model read it)."""
    lora = training.lora
    if lora is None or not (role == "actor" or (role.endswith("critic") and lora.critic)):
        return None
    return lora


def actor_is_reference(training: Training) -> bool:
    """Whether the actor serves the reference stage itself: with LoRA the reference policy is its base with the
    adapters switched off, so no reference model is loaded (and none can sit on a pool of its own)."""
    return training.lora is not None
