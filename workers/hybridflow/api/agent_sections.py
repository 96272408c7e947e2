"""The spec's multi-turn sections: `rollout.agent` (what an episode is: its environment, tools, turns and
deadlines), `environments` (where on Kubernetes tools, environments and programs run: a pool of sandbox pods) and
`sandbox` (how those pods contain the job's code). Names are checked against the registries in
hybridflow.agents.registry. What a whole spec says about them (its user code, its sandbox pool) is api.agents, above
the spec's fields."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from hybridflow.agents.registry import ENVIRONMENTS, TOOLS
from hybridflow.api.fields import MAX_COUNT, FilePath, PythonName, Quantity, SpecModel, registered

# What an episode's score is made of: the job's reward (spec.models.reward) over the model's own text, the
# environment's rewards (summed over its steps), or both added.
EPISODE_SCORES = ("reward", "environment", "both")
MAX_NAME = 128  # a registered tool's or environment's name


class Agent(SpecModel):
    """Multi-turn rollouts: the model's turn, then a tool's or the environment's answer appended as tokens, up to
    maxTurns turns or maxResponseLength tokens in all (model and observation tokens together); only the model's
    own tokens are trained."""

    environment: Annotated[str, Field(max_length=MAX_NAME)] | None = Field(
        None, description="A registered environment (hybridflow.agents.registry.ENVIRONMENTS, e.g. guess_number); "
        "unset with environmentFile unset: none, the episode ends at the first turn that calls no tool and the "
        "job's reward scores it.")
    environment_file: FilePath | None = Field(
        None, description="A user's environment: a Python file with a class (environmentClass) whose reset(sample) "
        "returns the first observation ('' for none) and step(action_text) returns (observation, reward, done, "
        "info). Runs in the sandbox. On Kubernetes a key of kubernetes.rewardConfigMap (the job's code ConfigMap).")
    environment_class: PythonName = Field("Environment", description="The class in environmentFile.")
    tools: list[Annotated[str, Field(max_length=MAX_NAME)]] = Field(default_factory=list, max_length=64, description="Built-in tools offered to the model "
                             "(registered: calculator, python).")
    tools_file: FilePath | None = Field(
        None, description="A user's tools: a Python file whose top-level functions with a docstring become tools "
        "(their parameters' annotations str, int, float, bool, list, dict give the JSON schema). Each call runs in a "
        "fresh sandbox. On Kubernetes a key of kubernetes.rewardConfigMap (the job's code ConfigMap).")
    program: FilePath | None = Field(
        None, description="Bring your own agent: a Python file defining `async def run(client, sample)`, run once per "
        "episode in the sandbox. `client` is an openai.AsyncOpenAI pointed at the job's OpenAI-compatible endpoint "
        "(the policy being trained, over a Unix socket: the sandbox has no other way out); `sample` is {prompt, "
        "ground_truth, data_source, extra_info}. It returns the episode's reward (a finite number), or a dict with "
        "'reward' and other numeric metrics. Every call it makes to the endpoint is trained (see trajectory). The "
        "program runs its own tools: tools, toolsFile, environment and environmentFile are unset with it, and its "
        "reward is the episode's score (score environment). On Kubernetes a key of kubernetes.rewardConfigMap (the "
        "job's code ConfigMap), run in the job's sandbox pool, whose pods relay the socket to the rollout's endpoint.")
    program_timeout_seconds: float = Field(300.0, gt=0, le=86400, description="Deadline of one run of program (one "
                                           "episode, all its calls); past it the run is killed and the episode "
                                           "fails, reported with its sample.")
    trajectory: Literal["merged", "per_call"] = Field(
        "merged", description="How a program's calls to the endpoint become trained sequences (rows of the batch). "
        "merged: calls whose prompts continue each other (each call's messages are the previous call's, the model's "
        "answer as it wrote it, then new ones: tool results, user turns) are one sequence, the model's own tokens "
        "trained and the tokens between them masked; a call that does not continue the previous one (the program "
        "edited or dropped earlier messages, or changed its tools) starts a new chain, and every chain is a sequence "
        "of its own (the breaks are counted: agent_trajectory_breaks). per_call: every call is a sequence, its "
        "prompt then its completion (all trained). Every sequence of an episode carries the episode's reward and its "
        "prompt's group: group advantages (grpo, rloo) count each sequence as a response, so an episode of more "
        "sequences weighs more in its group's mean and std. The batch is padded with untrained rows to divide "
        "among the training ranks. ReMax (a greedy baseline per response) needs one sequence per episode.")
    max_turns: int = Field(4, ge=1, le=1024, description="Model turns per episode at most.")
    max_tokens_per_turn: int | None = Field(None, gt=0, le=MAX_COUNT, description="New tokens of one model turn at "
                                            "most (default: what is left of maxResponseLength).")
    step_timeout_seconds: float = Field(10.0, gt=0, le=3600, description="Deadline of one environment step (and of "
                                        "its reset); past it the episode ends, reported with its sample.")
    tool_timeout_seconds: float = Field(10.0, gt=0, le=3600, description="Deadline of one tool call; past it the "
                                        "model reads that the tool timed out, and the episode goes on.")
    score: Literal["reward", "environment", "both"] | None = Field(
        None, description="What an episode's score is: reward (the job's reward over the model's own text), "
        "environment (its rewards summed; with program, the reward the program returns) or both, added. Default: "
        "environment when there is one or a program, else reward.")
    concurrent_episodes: int = Field(64, ge=1, le=4096, description="Episodes one rollout rank runs at once (their "
                                     "turns share the engine's batches).")
    max_failed_fraction: float = Field(
        0.5, ge=0, le=1, description="More failed episodes than this fraction of a step's (or an evaluation's) stop "
        "the job, naming the first failure and its sample. An episode fails when its environment's reset or a step "
        "raises, times out or returns a non-finite reward, or when one of its tools crashes (its code does not "
        "load, its sandbox does not start or dies). A step with fewer failures prints one line saying so.")

    @field_validator("environment")
    @classmethod
    def _environment_registered(cls, value: str | None) -> str | None:
        return None if value is None else registered(ENVIRONMENTS, value)

    @field_validator("tools")
    @classmethod
    def _tools_registered(cls, value: list[str]) -> list[str]:
        for name in value:
            registered(TOOLS, name)
        if len(set(value)) != len(value):
            raise ValueError(f"a tool is named twice in {value}")
        return value

    @model_validator(mode="after")
    def _program_alone(self) -> "Agent":
        """A program runs its own tools and scores its own episodes: what the built-in loop would offer the model
        beside it would never be called."""
        if self.program is None:
            return self
        for field, value in (("tools", self.tools), ("toolsFile", self.tools_file),
                             ("environment", self.environment), ("environmentFile", self.environment_file)):
            if value:
                raise ValueError(f"spec.rollout.agent.program and spec.rollout.agent.{field} are both set: a program "
                                 f"runs its own tools and environment in its code; drop {field}, or drop program")
        if self.score not in (None, "environment"):
            raise ValueError(f"spec.rollout.agent.score: {self.score} with program; a program's episode is scored by "
                             "the reward it returns (score environment, the default with a program)")
        return self

    @property
    def has_environment(self) -> bool:
        return self.environment is not None or self.environment_file is not None

    @property
    def episode_score(self) -> str:
        return self.score or ("environment" if self.has_environment or self.program is not None else "reward")


class EnvironmentPool(SpecModel):
    """On Kubernetes: the job's sandbox pool, the pods that run its untrusted code (its reward function, its agent's
    tools and environment sessions or program runs, each in a sandbox of its own) apart from every pod that holds one
    of the job's credentials, serving them over HTTP authenticated with a sandbox token of the job's own; a
    NetworkPolicy denies them all egress (but, for a program, the rollout endpoint's ports on the job's other pods)
    and admits only the job's own pods. The operator runs one replica with these defaults for a
    job with such code when the spec leaves this unset. `hybridflow run` runs them on the machine instead."""

    replicas: int = Field(1, ge=1, le=1024, description="Sandbox pods; sessions spread over them and stay on "
                          "theirs, reward batches are split over them.")
    cpu: Quantity = Field("1", description="CPU request and limit of each sandbox pod.")
    memory: Quantity = Field("2Gi", description="Memory request and limit of each sandbox pod.")
    image: str | None = Field(None, min_length=1, max_length=1024, description="Their image (default: "
                              "kubernetes.image).")


class Sandbox(SpecModel):
    """How the sandbox pool's pods (spec.environments) contain the job's untrusted code on Kubernetes. Each
    sandbox's own layers (bubblewrap's namespaces, a seccomp filter) need user namespaces, which the default seccomp
    profile of containerd and CRI-O refuses to a pod; a runtime class with a kernel of its own (gVisor, Kata)
    contains the whole pod instead. Without every layer the pods refuse to start, unless `allowPartial` says that
    the pod's own containment (no credentials, no egress, non-root, no capabilities, rlimits) is enough."""

    runtime_class_name: str | None = Field(
        None, min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="RuntimeClass of the sandbox pods (gVisor's `gvisor`/`runsc`, Kata's `kata`; a RuntimeClass the "
        "cluster defines), one the cluster's job policy allows (chart value jobPolicy.allowedRuntimeClasses); unset: "
        "the chart's jobPolicy.sandboxRuntimeClassName, or the cluster's default runtime when that is empty.")
    allow_partial: bool = Field(
        False, description="Run the sandbox pods where the node refuses some of the sandbox's layers (a default "
        "cluster: user namespaces refused); the job records which in its SandboxPartial condition, and a job with both a "
        "reward function and an agent gets one more sandbox pod, scoring its rewards apart from the model's code. "
        "Default false: "
        "HYBRIDFLOW_SANDBOX=require, and the job fails, naming the layers, instead.")
