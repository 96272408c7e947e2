"""The multi-turn rollout as the controller reports it: each step's episode metrics, one console line for a step whose
episodes failed (how many, of which kinds, the first with its sample), one for a step whose tool calls all timed out,
and the bound that stops the job, spec.rollout.agent.maxFailedFraction, like the reward's maxErrorFraction: an
environment or tool that fails most episodes would only train the model on zeros, step after step, with nothing on
the console. The bound counts the user's code's failures only (hybridflow.agents.loop.USER_CODE); an episode the
sandbox pool failed (a replica lost, a sandbox that did not start, an HTTP error) is reported, never counted: one pod
restart must not stop the job."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridflow.agents.loop import PROGRAM, USER_CODE
from hybridflow.roles.episodes import EPISODE_FIRST
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.rows import is_padding

log = logging.getLogger("hybridflow.trainer.episodes")
CHECKED = "agent_failures_counted"  # a batch's meta: its episodes are counted already (it flows through stages)


class AgentFailure(RuntimeError):
    """More of a step's episodes failed than spec.rollout.agent.maxFailedFraction."""


def _sample(batch: Batch, i: int) -> str:
    """Row `i` as a user finds it in the data: its data source and ground truth (and extra info without one)."""
    parts = []
    for column, name in (("data_source", "data source"), ("truth", "ground truth"), ("extra_info", "extra info")):
        if column in batch and (column != "extra_info" or "truth" not in batch or batch["truth"][i] is None):
            parts.append(f"{name} {batch[column][i]!r:.80}")
    return f"sample {i}" + (f" ({', '.join(parts)})" if parts else "")


def _advice(kind: str) -> str:
    """What to do about failures whose first is of `kind`: an agent program's, or an environment's or tools'."""
    if kind == PROGRAM:
        return ("Fix spec.rollout.agent.program (run it on that sample), raise spec.rollout.agent."
                "programTimeoutSeconds if its runs time out, or raise maxFailedFraction")
    return "Fix the environment or tools file (run its reset and step on that sample), or raise maxFailedFraction"


def _by_kind(kinds: Counter) -> str:
    return ", ".join(f"{kind}: {n}" for kind, n in kinds.most_common())


@dataclass
class EpisodeFailures:
    """The failed episodes of the batches a step (or an evaluation) generated, counted once per batch."""

    max_fraction: float
    what: str = "this step"
    tool_timeout: float | None = None  # spec.rollout.agent.toolTimeoutSeconds, for the line on calls all timed out
    episodes: int = 0
    kinds: Counter = field(default_factory=Counter)
    first: str | None = None  # the first failure of the user's code, else the first of the pool's
    first_is_the_pools: bool = False
    tool_calls: int = 0
    tool_timeouts: int = 0

    @property
    def failed(self) -> int:
        return sum(self.kinds.values())

    @property
    def not_counted(self) -> int:
        """Failures of the sandbox pool, not of the user's code: out of the bound."""
        return sum(n for kind, n in self.kinds.items() if kind not in USER_CODE)

    def add(self, batch: Batch) -> None:
        """Count `batch`'s episodes (a batch already counted, or without episodes, is skipped); raises AgentFailure
        when more than the bound of its episodes failed in the user's code."""
        if "agent_error" not in batch or batch.meta.get(CHECKED):
            return
        batch.meta[CHECKED] = True
        batch = batch.index(~is_padding(batch))  # the rows added to divide among the ranks hold no episode
        errors, kinds = batch["agent_error"], batch["agent_failure"]
        if "agent_tool_calls" in batch:
            self.tool_calls += int(batch["agent_tool_calls"].sum())
            self.tool_timeouts += int(batch["agent_tool_timeouts"].sum())
        first = first_rows(batch)  # an agent program's episode may be several rows: count each once
        failed = [i for i, e in enumerate(errors) if e and first[i]]
        episodes = int(first.sum())
        self.episodes += episodes
        if not failed:
            return
        self.kinds.update(str(kinds[i]) for i in failed)
        ours = [i for i in failed if str(kinds[i]) in USER_CODE]
        if ours and (self.first is None or self.first_is_the_pools):
            self.first, self.first_is_the_pools = self._describe(batch, ours[0]), False
        elif self.first is None:
            self.first, self.first_is_the_pools = self._describe(batch, failed[0]), True
        if len(ours) / max(episodes, 1) > self.max_fraction:
            pool = Counter(str(kinds[i]) for i in failed if str(kinds[i]) not in USER_CODE)
            raise AgentFailure(
                f"{len(ours)} of {episodes} episodes failed in {self.what} "
                f"({_by_kind(Counter(str(kinds[i]) for i in ours))}), more than spec.rollout.agent.maxFailedFraction"
                f" = {self.max_fraction:g}; first: {self._describe(batch, ours[0])}. {_advice(str(kinds[ours[0]]))}"
                + (f" ({sum(pool.values())} more failed in the sandbox pool, not counted: {_by_kind(pool)})"
                   if pool else ""))

    @staticmethod
    def _describe(batch: Batch, i: int) -> str:
        return f"{_sample(batch, i)}: {batch['agent_failure'][i]}: {batch['agent_error'][i]}"

    def line(self) -> str | None:
        """The console line for failures under the bound, or None without any."""
        if not self.failed:
            return None
        pool = self.not_counted
        return (f"agent: {self.failed} of {self.episodes} episodes failed in {self.what} ({_by_kind(self.kinds)})"
                + (f", {pool} of them in the sandbox pool, not the user's code (not counted against spec.rollout."
                   "agent.maxFailedFraction)" if pool else "") + f"; first: {self.first}")

    def timeout_line(self) -> str | None:
        """The console line for a step whose tool calls all timed out (each answered the model nothing else), or
        None."""
        if not self.tool_calls or self.tool_timeouts < self.tool_calls:
            return None
        limit = f" (spec.rollout.agent.toolTimeoutSeconds = {self.tool_timeout:g} s)" if self.tool_timeout else ""
        return (f"agent: all {self.tool_calls} tool calls in {self.what} timed out{limit}: a call loads the tools file"
                " and runs the tool within it; make the file's top level or the tool faster, or raise "
                "toolTimeoutSeconds")

    def report(self) -> None:
        for text in (self.line(), self.timeout_line()):
            if text is not None:
                log.warning("%s", text)


def episode_failures(agent: Any, what: str = "this step") -> EpisodeFailures | None:
    """The counter for a job with an agent (spec.rollout.agent), else None."""
    return None if agent is None else EpisodeFailures(agent.max_failed_fraction, what, agent.tool_timeout_seconds)


def first_rows(batch: Batch) -> np.ndarray:
    """(B,) bool: the rows that open an episode (EPISODE_FIRST); every row without the column (one row each)."""
    if EPISODE_FIRST not in batch:
        return np.ones(len(batch), dtype=bool)
    return batch[EPISODE_FIRST].numpy() > 0


def _per_episode(batch: Batch, column: str, reduce: str = "sum") -> torch.Tensor:
    """(episodes,) `column` reduced over each episode's rows (adjacent, the first marked by EPISODE_FIRST; a part
    before the batch's first marked row counts as one)."""
    ids = torch.as_tensor(np.maximum(np.cumsum(first_rows(batch)) - 1, 0))
    n = int(ids.max()) + 1 if len(ids) else 0
    out = torch.zeros(n).scatter_reduce_(0, ids, batch[column].float(), "amax", include_self=False) \
        if reduce == "max" else torch.zeros(n).index_add_(0, ids, batch[column].float())
    return out


def program_metrics(batch: Batch) -> dict[str, float]:
    """An agent program's own metrics (what its `run` returned beside `reward`), each the mean over the episodes
    that returned it: `agent_program_<name>_mean`."""
    if "agent_metrics" not in batch:
        return {}
    values: dict[str, list[float]] = {}
    for row in batch["agent_metrics"]:
        for name, value in (row or {}).items():
            values.setdefault(str(name), []).append(float(value))
    return {f"agent_program_{name}_mean": sum(v) / len(v) for name, v in sorted(values.items())}


def episode_stats(batch: Batch) -> dict[str, float]:
    """Multi-turn rollouts' metrics over the trained batch: turns and tool calls per episode, the tool calls' error
    and timeout rates and seconds, the environment's reward, and episodes that failed or were retried."""
    if "agent_turns" not in batch:
        return {}
    batch = batch.index(~is_padding(batch))  # the rows added to divide among the ranks hold no episode
    # per episode, not per row (an agent program's episode may be several rows): its rows' sums (each row counts its
    # own calls and steps), or its first row (every row carries the episode's reward; a failed episode is one row)
    first = torch.as_tensor(first_rows(batch))
    turns, tools = _per_episode(batch, "agent_turns"), _per_episode(batch, "agent_tool_calls")
    calls = float(tools.sum())
    episodes = int(first.sum())
    mean = (lambda x: float(x.sum()) / episodes) if episodes else (lambda x: 0.0)
    return program_metrics(batch) | {"agent_turns_mean": mean(turns),
            "agent_tool_calls_mean": mean(tools),
            "agent_tool_call_rate": mean((tools > 0).float()),
            "agent_tool_error_rate": float(batch["agent_tool_errors"].sum()) / calls if calls else 0.0,
            "agent_tool_timeout_rate": float(batch["agent_tool_timeouts"].sum()) / calls if calls else 0.0,
            "agent_tool_seconds": float(batch["agent_tool_seconds"].sum()),
            "agent_env_reward_mean": mean(batch["env_reward"][first]),
            "agent_env_steps_mean": mean(_per_episode(batch, "agent_env_steps")),
            "agent_episodes_failed": float(batch["agent_failed"][first].sum()),
            "agent_episodes_failed_infrastructure": float(sum(bool(k) and str(k) not in USER_CODE for k, f in
                                                              zip(batch["agent_failure"], first) if f))
            if "agent_failure" in batch else 0.0,
            "agent_episodes_retried": float((_per_episode(batch, "agent_retries", "max") > 0).float().sum()),
            "agent_episodes_truncated": float((_per_episode(batch, "agent_truncated", "max") > 0).float().sum()),
            # an agent program's calls that did not extend the conversation before (hybridflow.agents.trajectory)
            "agent_trajectory_breaks": float(batch["agent_trajectory_breaks"].sum())
            if "agent_trajectory_breaks" in batch else 0.0,
            "agent_environment_requests": float(batch["agent_environment_requests"].sum())}
