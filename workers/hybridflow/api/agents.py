"""What a job's spec says of its user code and its sandbox pool: whether it runs code of the user's, the files of
that code, and the pool's replicas (each serving what). The spec's multi-turn sections themselves (`rollout.agent`,
`environments`, `sandbox`) are api.agent_sections, re-exported here."""
from __future__ import annotations

from hybridflow.api.agent_sections import Agent, EnvironmentPool, Sandbox
from hybridflow.api.sections import JobFields
from hybridflow.sandbox_pool import (
    ENDPOINT_PORTS_ENV, POD_IP_ENV, REWARD_URLS_ENV, SERVES_AGENTS, SERVES_ALL, SERVES_REWARDS,
)
from hybridflow.sandbox_pool import URLS_ENV as ENVIRONMENT_URLS_ENV

# the sandbox pool's names the operator reads here (it may import hybridflow.api only, not hybridflow.sandbox_pool)
REEXPORTED = (ENVIRONMENT_URLS_ENV, REWARD_URLS_ENV, ENDPOINT_PORTS_ENV, POD_IP_ENV)
__all__ = ["REEXPORTED", "Agent", "EnvironmentPool", "Sandbox", "ENVIRONMENT_URLS_ENV", "REWARD_URLS_ENV",
           "SERVES_AGENTS", "SERVES_ALL", "SERVES_REWARDS", "ENDPOINT_PORTS_ENV", "POD_IP_ENV", "code_files",
           "rewards_apart", "runs_user_code", "sandbox_pool", "sandbox_replicas"]


def runs_user_code(spec: JobFields) -> bool:
    """A reward function of the user's, or an agent (its tools, environments, and the built-in `python` tool run
    what the model wrote): code the job must not run beside its credentials."""
    return spec.models.reward.function is not None or spec.rollout.agent is not None


def code_files(spec: JobFields) -> dict[str, str]:
    """The files of the user's code the spec names, by field (as messages name them): the reward function's, the
    agent's tools file, environment file and program. On Kubernetes they are keys of kubernetes.rewardConfigMap (the
    job's code ConfigMap), copied into the job's own immutable ConfigMap at acceptance."""
    out: dict[str, str] = {}
    if (fn := spec.models.reward.function) is not None:
        out["spec.models.reward.function.path"] = fn.path
    if (agent := spec.rollout.agent) is not None:
        if agent.tools_file:
            out["spec.rollout.agent.toolsFile"] = agent.tools_file
        if agent.environment_file:
            out["spec.rollout.agent.environmentFile"] = agent.environment_file
        if agent.program:
            out["spec.rollout.agent.program"] = agent.program
    return out


def rewards_apart(spec: JobFields) -> bool:
    """Whether the job's reward functions are scored by sandbox pods of their own, apart from its tools and
    environments: when the job has both and spec.sandbox.allowPartial lets the pods run without the sandbox's user
    and process namespaces. There the model's code (the `python` tool, a tool or environment fed the model's
    actions) would run as the same user in the same pod as the reward workers, free to signal them or write where
    they write: a model could then forge its own reward. With every layer (allowPartial false) each sandbox has
    namespaces of its own, and one pod serves both."""
    return (spec.sandbox.allow_partial and spec.models.reward.function is not None
            and spec.rollout.agent is not None)


def sandbox_replicas(spec: JobFields) -> list[str]:
    """What each replica of the job's sandbox pool serves, by index ([] without a pool): spec.environments.replicas
    replicas serving everything, or, with rewards_apart, those serving tools and environments and, after them, half
    as many again (at least one) scoring reward functions."""
    pool = sandbox_pool(spec)
    if pool is None:
        return []
    if rewards_apart(spec):  # as many again for rewards, half as many (at least one): a batch spreads over them
        return [SERVES_AGENTS] * pool.replicas + [SERVES_REWARDS] * max(1, pool.replicas // 2)
    return [SERVES_ALL] * pool.replicas


def sandbox_pool(spec: JobFields) -> EnvironmentPool | None:
    """The sandbox pool a Kubernetes job runs: spec.environments, or one default replica when the job runs user
    code and the spec leaves it unset; None without user code."""
    if spec.environments is not None:
        return spec.environments
    return EnvironmentPool() if runs_user_code(spec) else None
