"""The sections of an RLHFJob's spec (algorithm, data, rollout, resource pools, trainer, metrics, the elastic rollout
pool), and `JobFields`: all of the spec's fields, each valid alone. The spec itself, JobSpec (api.schema), adds the
checks across fields (api.rules), which read a JobFields; so the rules, and whatever reads a whole spec below them
(api.agents, api.scaling), import this module, never api.schema.

Torch-free on purpose: the operator and `hybridflow crd` import this package and must stay light. Field names are
camelCase in YAML (Kubernetes style) and snake_case in Python. Names of algorithms and their pieces and of engines
are those registered (hybridflow.algorithms, hybridflow.api.engines); the CRD's enums come from the same tables.
"""
from __future__ import annotations

from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from hybridflow.algorithms import ALGORITHMS
from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS
from hybridflow.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS
from hybridflow.algorithms.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
from hybridflow.api.fields import (
    MAX_COUNT, MAX_DEVICES_PER_NODE, MAX_NODES, MAX_POOLS, MAX_ROLE_KEY, MAX_SEED, MAX_STEPS,
    MAX_TEXT, FilePath, LabelValue, PathOrPaths, PoolName, Quantity, SpecModel, registered,
    short_keys,
)
from hybridflow.api.agent_sections import Agent, EnvironmentPool, Sandbox
from hybridflow.api.allocators import allocator_choices, allocator_setting
from hybridflow.api.corrections import OffPolicyCorrection
from hybridflow.api.engines import ROLLOUT_ENGINES
from hybridflow.api.devices import ACCELERATOR_PATTERN, GPU_PROFILES, accelerator_problem
from hybridflow.api.names import ROLES
from hybridflow.api.pods import Kubernetes
from hybridflow.api.roles import ROLE_KINDS
from hybridflow.api.run_policy import RunPolicy
from hybridflow.api.sources import Models
from hybridflow.api.storage import is_url, location_problem
from hybridflow.api.tracking import Tracking
from hybridflow.api.training import Training


class Algorithm(SpecModel):
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
    kl_horizon: int = Field(10000, gt=0, le=1_000_000_000, description="klController adaptive: responses over "
                            "which the coefficient may change by 20%.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight in the actor loss.")
    clip_ratio_low: float | None = Field(None, gt=0, description="Ratio clipped below at 1 - this; default "
                                         "training.clipRatio (policyLoss gspo: 3e-4).")
    clip_ratio_high: float | None = Field(None, gt=0, description="Ratio clipped above at 1 + this; default "
                                          "training.clipRatio (dapo: 0.28; policyLoss gspo: 4e-4).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip PPO: a negative advantage's loss is capped at "
                                    "-A * dualClip (e.g. 3); unset: off.")
    tis_cap: float | None = Field(None, gt=0, description="Truncated importance sampling against the rollout "
                                  "engine's own log-probs: each token's loss weighted by min(pi_train/pi_rollout, "
                                  "tisCap) (e.g. 2); unset: off. Needs rollout.topP 1. Shorthand for "
                                  "offPolicyCorrection: {name: tis, cap: <tisCap>}.")
    off_policy_correction: OffPolicyCorrection | None = Field(
        None, description="How the policy loss corrects for tokens sampled by a policy other than the trainer's "
        "(the rollout engine's sampler; older weights under asynchronous rollout); unset: none (tisCap aside). "
        "Needs rollout.topP 1.")
    max_sampling_rounds: int | None = Field(None, ge=1, le=1024, description="dapo: generations per step to fill "
                                            "the batch with groups whose rewards differ (default 3).")
    overlong_buffer: int = Field(0, ge=0, le=MAX_COUNT, description="Overlong shaping: responses within this many "
                                 "tokens of rollout.maxResponseLength lose up to overlongPenalty, linearly; 0: off.")
    overlong_penalty: float = Field(1.0, ge=0, description="The overlong shaping's largest penalty.")
    cost_limit: float = Field(0.0, description="safe_rlhf: the bound on the mean cost per response.")
    lambda_init: float = Field(1.0, ge=0, description="safe_rlhf: the Lagrangian multiplier's start value.")
    lambda_lr: float = Field(0.5, gt=0, description="safe_rlhf: the multiplier's step size per unit of excess cost.")

    @field_validator("name", "advantage_estimator", "policy_loss", "loss_agg", "kl_estimator", "kl_controller")
    @classmethod
    def _registered(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else registered(_ALGORITHM_REGISTRIES[info.field_name], value)

    @model_validator(mode="after")
    def _algorithm_defaults(self) -> "Algorithm":
        """Unset fields take the named algorithm's defaults, so every role reads one resolved section."""
        for key, value in {**_ALGORITHM_BASE_DEFAULTS, **ALGORITHMS[self.name].defaults}.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        loss_clip = POLICY_LOSSES.info(self.policy_loss or "")["clip"]  # e.g. gspo's, whichever algorithm uses it
        if loss_clip is not None and self.clip_ratio_low is None and self.clip_ratio_high is None:
            self.clip_ratio_low, self.clip_ratio_high = loss_clip
        if self.tis_cap is not None and self.off_policy_correction is not None:
            raise ValueError("tisCap and offPolicyCorrection are both set: tisCap: c is shorthand for "
                             "offPolicyCorrection: {name: tis, cap: c}; keep one")
        if self.kl_controller == "adaptive" and (self.target_kl is None or self.kl_coef <= 0):
            raise ValueError("klController adaptive needs targetKl (the KL per token to track, e.g. 0.05) and "
                             "klCoef > 0 (its starting value)")
        return self


_ALGORITHM_REGISTRIES: dict[str, Any] = {
    "name": ALGORITHMS, "advantage_estimator": ADVANTAGE_ESTIMATORS, "policy_loss": POLICY_LOSSES,
    "loss_agg": LOSS_AGGREGATIONS, "kl_estimator": KL_ESTIMATORS, "kl_controller": KL_CONTROLLERS}
_ALGORITHM_BASE_DEFAULTS = {"kl_in": "loss", "norm_adv_by_std": True, "max_sampling_rounds": 1}


class Data(SpecModel):
    """Where prompts come from: a generated task, or the user's files (verl's Parquet layout loads unchanged)."""

    source: Literal["generated", "files"] = Field(
        "generated", description="generated: a seeded synthetic task (task); files: the user's prompt files (train).")
    task: Literal["increment", "arithmetic", "products"] = Field(
        "increment",
        description="For source=generated. increment: continue a sequence of token ids counting up (synthetic, tiny "
        "models); arithmetic: 'a+b=' with an exact-answer reward (real tokenizer); products: 'a * b' of 3 by 2 "
        "digits, after one worked example of a calculator tool call, with an exact reward on the final number (for "
        "rollout.agent with tools).",
    )
    train_prompts: int = Field(
        1024, gt=0, le=16 * MAX_COUNT, description="For source=generated: number of generated training prompts."
    )
    eval_prompts: int = Field(
        64, gt=0, le=MAX_COUNT,
        description="Held-out prompts for the before/after evaluation: generated, "
                    "split off the training files (rows never used for training) or, with `eval`, the "
                    "first ones of the eval set."
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed for generated data, the held-out split and the "
                      "shuffling.")
    train: PathOrPaths = Field(
        default_factory=list,
        description="For source=files: one path or a list of files, globs or directories of JSONL, JSON or Parquet, "
                    "or one datasets.save_to_disk directory. With kubernetes.dataPvc: relative paths inside that "
                    "volume."
    )
    eval: PathOrPaths = Field(default_factory=list, description="Optional held-out set, like train (one path or a "
                              "list).")
    prompt_key: str = Field(
        "prompt", min_length=1, max_length=1024,
        description="Column of the prompt: a string, or a list of chat "
                    "messages {role, content}. Dotted paths reach into nested columns."
    )
    answer_key: str | None = Field(
        "reward_model.ground_truth", max_length=1024,
        description="Column of the ground truth handed to "
                    "the reward (dotted paths reach into nested columns); null: none."
    )
    system_prompt: str | None = Field(
        None, max_length=MAX_TEXT,
        description="A system message put before (or in place of) the prompt's "
                    "own."
    )
    chat_template: str | None = Field(
        None, max_length=MAX_TEXT,
        description="A Jinja chat template used instead of the model's; without "
                    "either, prompts are plain text."
    )
    cache_dir: FilePath | None = Field(None, description="Where tokenized prompts are cached (default: "
                                  "<trainer.checkpointDir>/data-cache; a local temporary directory when "
                                  "checkpointDir is on object storage).")


class Rollout(SpecModel):
    engine: str = Field(
        "vllm",
        description="vllm: in-process vLLM; hf: plain torch generation; megatron: tensor-parallel generation with "
        "megatron-core layers on the 3D-HybridEngine's generation groups (needs training.engine megatron).",
        json_schema_extra={"enum": ROLLOUT_ENGINES.names()},
    )
    tensor_parallel: int = Field(
        1, gt=0, le=1024,
        description="Generation TP size t_g; must divide training.tensorParallel (megatron engine only)."
    )
    # Not `n`: YAML 1.1 (kubectl's parser) reads a bare `n` key as the boolean false.
    responses_per_prompt: int = Field(4, gt=0, le=1024, description="Responses sampled per prompt (GRPO's group size).")
    temperature: float = Field(1.0, gt=0, le=100, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_prompt_length: int = Field(
        16, gt=0, le=MAX_COUNT, description="Prompts are left-padded or rejected beyond this."
    )
    max_response_length: int = Field(8, gt=0, le=MAX_COUNT, description="New tokens per response.")
    kv_cache_gib: float = Field(
        0.0, ge=0, le=4096, description="vLLM KV cache size on CPU in GiB (0: sized from the job: every sequence of "
        "one generation call, prompt + response, at once); freed during each update beside the actor."
    )
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM GPU memory fraction (GPU only).")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="vLLM's CUDA graphs (GPU decode 2-4x faster; weight syncs keep them): auto: on a GPU at "
        "tensorParallel 1, eager elsewhere (vLLM's CPU build has none); on: also at tensorParallel > 1 (GPU only); "
        "off: eager everywhere. Quote \"on\" and \"off\" (YAML reads them bare as booleans).")
    prefix_caching: bool = Field(True, description="vLLM reuses the KV cache of a prompt across its responses "
                                 "(and of an agent's earlier turns), in blocks of 32 tokens on CPU; new weights "
                                 "clear it.")
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync", description="sync: generate, then train, then sync the weights (colocated or not). one_step_off: "
        "batch k+1 is generated while batch k trains (one policy version old). async: rollout generates "
        "continuously into a trajectory queue and the trainer takes a batch when enough are ready, none older than "
        "maxStaleness versions. Both need spec.placement.rollout on a pool of its own.")
    max_staleness: int = Field(
        1, ge=0, le=1024, description="async: how many policy versions older than the trainer a trajectory's oldest "
        "token may be when it is trained; older ones are dropped (and counted).")
    partial_rollout_tokens: int = Field(
        0, ge=0, le=MAX_COUNT, description="async: generations advance this many tokens per engine call, and new "
        "weights that arrive in between are used for the rest of a response (partial rollout; each token is tagged "
        "with the policy version that produced it). 0: a response finishes with the weights it began with.")
    agent: Agent | None = Field(
        None, description="Multi-turn rollouts with tools and environments (agentic RL); unset: one response per "
        "prompt.")
    queue_prompts: int = Field(
        0, ge=0, le=MAX_COUNT, description="async: prompt groups the trajectory queue holds ahead of the trainer "
        "(generated or in flight); 0: twice trainer.promptsPerStep.")
    weight_sync_timeout_seconds: float = Field(
        120.0, gt=0, le=86400, description="A rollout pool of its own: the longest any one wait of a weight "
        "transfer may take (a bucket, an ack; the generation in flight is waited for before it starts) before the "
        "job fails naming the rank that did not answer.")

    @field_validator("engine")
    @classmethod
    def _engine_registered(cls, value: str) -> str:
        return registered(ROLLOUT_ENGINES, value)

    @field_validator("cuda_graphs", mode="before")
    @classmethod
    def _on_off_quoted(cls, value: Any) -> Any:
        """YAML 1.1 (PyYAML here, kubectl's parser) reads a bare on/off as a boolean, which the CRD refuses too:
        say what to write instead of "not one of auto, on, off"."""
        if isinstance(value, bool):
            word = "on" if value else "off"
            raise ValueError(f'write "{word}" in quotes: YAML reads a bare {word} as the boolean {str(value).lower()}')
        return value


class ResourcePool(SpecModel):
    name: PoolName = Field("default", description="Pool name: lowercase letters and digits (no '-', so that pod "
                           "names '<job>-<pool>-<index>-g<gen>' of two jobs never collide), at most 63.")
    nodes: int = Field(1, gt=0, le=MAX_NODES, description="Nodes (pods) in the pool.")
    devices_per_node: int = Field(2, gt=0, le=MAX_DEVICES_PER_NODE, description="Devices (GPUs, or CPU ranks on CPU) "
                                  "per node.")
    device: Literal["cpu", "gpu"] = Field("cpu", description="Device type.")
    cpus_per_device: float = Field(1.0, gt=0, le=1024, description="CPU cores reserved per device process; its "
                                   "torch computes on that many threads (at least 1).")
    allocator: str = Field(
        "auto", json_schema_extra={"enum": allocator_choices()}, description="The C heap allocator of the pool's worker processes: auto takes tcmalloc where the node "
        "has it (the worker images do; apt-get install libtcmalloc-minimal4), else the C library's malloc; "
        "tcmalloc fails the job where it is missing.")
    memory_per_node: Quantity = Field("4Gi", description="Memory request and limit of each pool pod (Kubernetes "
                                      "quantity, e.g. 16Gi).")
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, max_length=64, description="Pod nodeSelector "
                                                 "(Kubernetes only).")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, max_length=64, description="Pod tolerations "
                                              "(Kubernetes only).")
    affinity: dict[str, Any] = Field(default_factory=dict, description="Pod affinity (Kubernetes only).")
    accelerator: str | None = Field(
        None, max_length=16, description="device=gpu: the device profile the memory model checks the job against "
        f"(`hybridflow plan`): {', '.join(GPU_PROFILES)}, or a size in GiB such as 96Gi; unset: not checked.",
        json_schema_extra={"pattern": ACCELERATOR_PATTERN})

    @field_validator("allocator")
    @classmethod
    def _allocator_registered(cls, value: str) -> str:
        return allocator_setting(value)

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, value: str | None) -> str | None:
        problem = None if value is None else accelerator_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


class Trainer(SpecModel):
    steps: int = Field(20, gt=0, le=MAX_STEPS, description="RLHF iterations.")
    prompts_per_step: int = Field(32, gt=0, le=MAX_COUNT, description="Prompts in one global batch.")
    save_freq: int = Field(0, ge=0, le=MAX_STEPS, description="Checkpoint every N steps (0: only at the end).")
    checkpoint_dir: FilePath = Field("./checkpoints", description="Checkpoints and the step log.")
    resume: Literal["auto", "never"] = Field("auto", description="auto: continue from the latest good checkpoint.")
    resume_from: FilePath | None = Field(
        None, description="A checkpoint (a step_* directory, or another job's checkpointDir: its newest intact one) "
        "to start from while this job's checkpointDir has none: weights, optimizer state, step and data position. "
        "How a job moves to another number of pods or another tensorParallel: a new job names the old one's "
        "checkpoint here (the checkpoint re-shards on load). On Kubernetes, a checkpoint of this namespace only: the "
        "old job's name (its newest intact checkpoint) or <name>/step_<N>, on kubernetes.checkpointPvc (mounted "
        "read-only) or below an object-storage checkpointDir's prefix (also as the URL <prefix>/<namespace>/<name>)."
    )
    async_save: bool = Field(
        False, description="Write checkpoints in the background while training goes on: each rank copies its "
        "shards to host memory and the next steps run while they are written. A checkpoint counts (for resume and "
        "status) only once every rank's write is sealed."
    )
    keep_checkpoints: int = Field(2, gt=0, le=1024, description="Checkpoints kept; older ones are deleted.")
    eval: bool = Field(True, description="Evaluate held-out reward before and after training.")
    rollout_log: bool = Field(
        False, description="Write each step's trained samples as JSON lines to <checkpointDir>/rollouts/"
        "step_<N>.jsonl (N with 8 digits): per sample its group uid, prompt and response token ids (and their text "
        "when the task has a tokenizer), reward (and cost), and per response token its advantage (and log-probs, "
        "values and returns where the algorithm has them). A resumed job deletes the files of the steps it redoes."
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed for sampling and initialisation.")
    profile_steps: list[Annotated[int, Field(gt=0, le=MAX_STEPS)]] = Field(
        default_factory=list, max_length=64, description="Steps profiled with torch's profiler (each once, none "
        "beyond steps): the actor's update, "
        "the step's generation (sync mode: in the async modes a step's batch was generated before it) and the "
        "weight transition (generation beside the actor), each broken down by kind of operation (matmul, "
        "attention, softmax, elementwise, copies and casts, FSDP, communication, optimizer, time outside any op...) "
        "into the step's statistics in steps.jsonl (profile_<stage>_<kind>_s: the update and transition averaged "
        "over ranks, the generation the last rank's) and a table in the log. The profiler keeps a record of every "
        "op of a stage in host memory until the stage ends and slows the stage (an update on CPU: 24.5 s against "
        "17.7 s), so name a few steps. Empty: nothing is profiled."
    )

    @field_validator("profile_steps")
    @classmethod
    def _profiled_steps_run(cls, v: list[int], info: ValidationInfo) -> list[int]:
        problem = profile_steps_problem(v, info.data.get("steps"))  # no steps: invalid itself, said on its own
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("checkpoint_dir", "resume_from")
    @classmethod
    def _storage_location(cls, v: str | None, info: ValidationInfo) -> str | None:
        problem = None if v is None else location_problem(v)
        if problem:
            raise ValueError(problem)
        if info.field_name == "resume_from" and v is not None and not is_url(v) and ".." in PurePosixPath(v).parts:
            raise ValueError(f"'{v}' climbs out of its directory ('..'); name the checkpoint's own path")
        return v


def profile_steps_problem(profiled: list[int], steps: int | None) -> str | None:
    """Why spec.trainer.profileSteps would not profile what it names (None when it would): a step named twice is
    profiled once (a typo for another step?), and one beyond the job's `steps` never runs."""
    twice = sorted({n for n in profiled if profiled.count(n) > 1})
    if twice:
        return f"steps {twice} are named more than once; name each step once"
    beyond = sorted(n for n in profiled if steps is not None and n > steps)
    if beyond:
        return (f"steps {beyond} are beyond spec.trainer.steps = {steps}: the job never runs them; name steps from "
                f"1 to {steps}, or raise spec.trainer.steps")
    return None


DEFAULT_METRICS_PORT = 8000


class Metrics(SpecModel):
    port: int = Field(DEFAULT_METRICS_PORT, ge=0, le=65535, description=(
        "Prometheus port of the driver (0: disabled, for a local run; on Kubernetes the driver always serves, on "
        f"{DEFAULT_METRICS_PORT} for 0: the operator follows the job's steps and deadlines there)."))
    address: str = Field("127.0.0.1", min_length=1, max_length=253, description="Bind address of the metrics server.")
    linger_seconds: int = Field(
        0, ge=0, le=3600, description="Keep serving /metrics this long after the last step, so Prometheus scrapes "
        "the final values (set it to at least the scrape interval)."
    )


class RolloutPool(SpecModel):
    """The bounds of an elastic rollout pool and its size now."""

    replicas: int | None = Field(
        None, ge=1, le=MAX_NODES, description="Pods (nodes) of the rollout pool now; may change on a live job "
        "within minReplicas..maxReplicas (`kubectl scale rlhfjob/NAME --replicas=N`, or an HPA through the scale "
        "subresource, which needs it set). New pods join and take the current weights before they take work; "
        "removed ones finish the generation they are in first. Unset: the rollout pool's resourcePools[].nodes.")
    min_replicas: int = Field(1, ge=1, le=MAX_NODES, description="The fewest rollout pods: losing capacity down to "
                              "this never fails the job.")
    max_replicas: int = Field(..., ge=1, le=MAX_NODES, description="The most rollout pods.")


# A job's spec as its fields give it: every section, each valid alone. JobSpec (api.schema) is these fields with the
# rules across them (api.rules), which read a JobFields. No docstring, as JobSpec has none (the CRD's descriptions).
class JobFields(SpecModel):
    algorithm: Algorithm = Field(default_factory=Algorithm, description="RL algorithm and its hyper-parameters.")
    models: Models = Field(default_factory=Models, description="Actor, critic, reference and reward.")
    data: Data = Field(default_factory=Data, description="Prompt source.")
    rollout: Rollout = Field(default_factory=Rollout, description="Generation settings.")
    training: Training = Field(default_factory=Training, description="Training settings.")
    resource_pools: list[ResourcePool] = Field(
        default_factory=lambda: [ResourcePool()], min_length=1, max_length=MAX_POOLS, description="Device pools."
    )
    rollout_pool: RolloutPool | None = Field(
        None, description="An elastic rollout pool (async, rollout on a pool of its own): its size may change while "
        "the job runs, within bounds. The one field besides runPolicy that a live job's spec may change (its "
        "replicas, minReplicas, maxReplicas; not whether it is there).")
    # ROLES is fixed once api.roles has registered every role (api.names), before this class is built.
    placement: Annotated[
        Annotated[Annotated[dict[Annotated[str, Field(max_length=MAX_ROLE_KEY)], Annotated[str, Field(max_length=63)]],
                            Field(max_length=len(ROLES)), short_keys(MAX_ROLE_KEY, f"role names ({', '.join(ROLES)})")],
                  Tag("union-roles")] | Annotated[Literal["auto"], Tag("union-auto")],
        Discriminator(lambda v: "union-auto" if isinstance(v, str) else "union-roles")] = Field(
        default_factory=dict,
        description="Role -> pool name (roles: actor, rollout, reference, critic, reward); unset roles go to the "
        "first pool. `auto`: the device-mapping planner (`hybridflow plan`) places the models onto the devices of "
        "spec.resourcePools, sizes the pools and picks each model's parallel layout and micro-batch size at start; "
        "the job runs the plan it records (status.plan). Until resolved, every role counts as on the first pool."
    )
    trainer: Trainer = Field(default_factory=Trainer, description="Loop, checkpoints, resume.")
    metrics: Metrics = Field(default_factory=Metrics, description="Prometheus exporter.")
    tracking: Tracking = Field(default_factory=Tracking, description="Experiment tracking (TensorBoard, MLflow).")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Restarts, deadlines, suspension, scheduling.")
    kubernetes: Kubernetes = Field(default_factory=Kubernetes, description="Image, volumes and pod settings.")
    environments: EnvironmentPool | None = Field(
        None, description="On Kubernetes: the sandbox pool, pods without credentials that run the job's reward "
        "function and agent (unset: one default replica for either). Needs models.reward.function or rollout.agent.")
    sandbox: Sandbox = Field(default_factory=Sandbox, description="How the sandbox pool's pods contain user code.")

    @property
    def placed(self) -> dict[str, str]:
        """Role -> pool name as written ({} for `placement: auto` before the planner resolved it)."""
        return {} if self.placement == "auto" else self.placement

    def pool(self, role: str) -> ResourcePool:
        name = self.placed.get(role, self.resource_pools[0].name)
        return next(p for p in self.resource_pools if p.name == name)

    def roles(self) -> list[str]:
        """The roles this job runs, in ROLE_KINDS' order (api.roles: each role says whether a job runs it): the
        workers build_workers creates and status.pools lists."""
        return [r for r, kind in ROLE_KINDS.items() if kind.runs(self)]

    def replica_pool(self, pool: str) -> bool:
        """Whether `pool` holds async rollout replicas alone: a pod of it that is lost is rebuilt in its replacement
        while training goes on (trainer/generation/), with no recovery from a checkpoint."""
        rollout = self.pool("rollout").name
        return (self.rollout.mode == "async" and pool == rollout and rollout != self.pool("actor").name
                and all(self.pool(r).name != pool for r in self.roles() if r != "rollout"))
