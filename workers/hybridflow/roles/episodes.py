"""The rollout's multi-turn side (spec.rollout.agent): one episode per row through hybridflow.agents.loop over
this rank's generation engine, packed as the single-turn rollout packs its responses plus the loss mask and the
episodes' own columns, so that every later stage (log-probs, advantages, every algorithm's loss) reads the same
batch layout with the model's tokens marked.

With spec.rollout.agent.program the user's program drives each episode instead (hybridflow.agents.program_loop);
its row's prompt is the prompt of the program's trained chain (its first call's), not the data set's. A prompt
longer than spec.rollout.maxPromptLength is not refused (the program, not the data set, made it): its first
maxPromptLength tokens are the row's prompt and the rest opens the response, loss mask 0 (fit_prompt). The endpoint
refuses a prompt of maxPromptLength + maxResponseLength tokens or more (the engine's context) and ends each completion
within that context, so that the model's tokens fit the row."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hybridflow.agents.codec import ObservationCodec
from hybridflow.agents.loop import PROGRAM, Episode, EpisodeSettings, run_episodes
from hybridflow.agents.program_loop import run_program_episodes
from hybridflow.agents.places import job_places
from hybridflow.agents.protocol import Places
from hybridflow.api.agents import Agent
from hybridflow.data.packing import pack_rollout, pad_log_probs
from hybridflow.engines.rollout.base import RolloutEngine, SamplingConfig

log = logging.getLogger("hybridflow.roles.episodes")

# Per-episode columns of the batch (float, one value per row); the step's summary turns them into metrics.
EPISODE_COLUMNS = ("agent_turns", "agent_tool_calls", "agent_tool_errors", "agent_tool_timeouts",
                   "agent_tool_seconds", "env_reward", "agent_env_steps", "agent_retries", "agent_truncated",
                   "agent_failed", "agent_trajectory_breaks")
# Non-tensor columns: what failed each episode and its kind (str, "" for none), for the controller's report and its
# bound, spec.rollout.agent.maxFailedFraction (hybridflow.trainer.episodes); an agent program's own metrics (a dict)
NON_TENSOR_COLUMNS = ("agent_error", "agent_failure", "agent_metrics")
# What `EpisodeRunner.run` returns beside its columns: each row's input row. An agent program's episode can be
# several rows (spec.rollout.agent.trajectory: hybridflow.agents.trajectory), so the rollout repeats each input
# row's columns (uid, truth, ...) over its rows: they share its group and its sample.
ROW_SOURCE = "agent_row_source"
# (B,) float: 1 on the first row of its episode, 0 on its others (and on the controller's padding rows,
# hybridflow.trainer.rows): what counts episodes, not rows (hybridflow.trainer.episodes)
EPISODE_FIRST = "agent_episode_first"


@dataclass
class EpisodeRunner:
    """What a rollout rank runs episodes with: the tokenizer's codec, and where tools and sessions run."""

    agent: Agent
    codec: ObservationCodec
    places: Places
    max_tokens: int

    @classmethod
    def build(cls, agent: Agent, model_dir: Path, chat_template: str | None, stop_token_ids: Sequence[int],
              max_tokens: int, private: Sequence[str] = ()) -> "EpisodeRunner":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        codec = ObservationCodec(tok, chat_template or getattr(tok, "chat_template", None), stop_token_ids)
        return cls(agent, codec, job_places(agent, private), max_tokens)

    def run(self, generator: RolloutEngine, sampling: Callable[[bool, bool, int], SamplingConfig], batch: Any,
            flags: Sequence[bool], want_log_probs: bool, prompt_width: int) -> dict[str, Any]:
        """The episodes of `batch`'s rows (non-tensor prompt_ids, truth, data_source, extra_info), packed: tensors,
        the NON_TENSOR_COLUMNS as arrays of str, and ROW_SOURCE (each row's input row: an agent program's episode
        may be several rows, adjacent, in order)."""
        prompts = [list(p) for p in batch["prompt_ids"]]
        # numpy values (a Parquet row's) stay as they are: hybridflow.wire encodes them for every place
        samples = [{"prompt": self.codec.decode(p), "ground_truth": t, "data_source": str(s), "extra_info": dict(x)}
                   for p, t, s, x in zip(prompts, batch["truth"], batch["data_source"], batch["extra_info"])]

        class Turns:
            @staticmethod
            def generate(rows: Sequence[int], contexts: Sequence[list[int]],
                         max_tokens: Sequence[int]) -> list[tuple[list[int], list[float]]]:
                cfgs = [sampling(bool(flags[r]), want_log_probs and not flags[r], m) for r, m in zip(rows, max_tokens)]
                return [(g.tokens, g.log_probs) for g in generator.generate(list(contexts), cfgs)]

        a = self.agent
        settings = EpisodeSettings(self.max_tokens, a.max_turns, a.max_tokens_per_turn, a.has_environment,
                                   a.concurrent_episodes)
        sent = sum(self.places.request_counts().values())
        if a.program is not None:
            if self.places.programs is None:
                raise RuntimeError("spec.rollout.agent.program is set but this rank has no place to run programs")
            # a program reads the prompt as the data gives it (chat messages or text) and renders it in its calls
            raw = batch["raw_prompt"] if "raw_prompt" in batch else [None] * len(samples)
            given = [{**x, "prompt": r} if r is not None else x for x, r in zip(samples, raw)]
            per_sample = run_program_episodes(given, Turns(), self.codec, self.places.programs, settings,
                                              a.program_timeout_seconds, max_context=prompt_width + self.max_tokens,
                                              trajectory=a.trajectory, listen=self.places.listen)
            source = [i for i, rows in enumerate(per_sample) for _ in rows]  # each row's input row
            fitted = [fit_prompt(e.prompt_ids if e.prompt_ids is not None else prompts[i], e, prompt_width,
                                 self.max_tokens) for i, e in zip(source, (e for rows in per_sample for e in rows))]
            prompts, episodes = [p for p, _ in fitted], [e for _, e in fitted]
        else:
            episodes = run_episodes(prompts, samples, Turns(), self.codec, settings, self.places.tools,
                                    self.places.sessions)
            source = list(range(len(episodes)))
        failed = [(i, e) for i, e in enumerate(episodes) if e.error]
        if failed:  # this rank's log; the controller reports the step's on the console and bounds them
            i, e = failed[0]
            log.info("%d of %d episodes failed; first: sample %d (ground truth %r): %s: %s", len(failed),
                     len(episodes), source[i], samples[source[i]]["ground_truth"], e.failure, e.error)
        packed = pack_rollout(prompts, [e.tokens for e in episodes], prompt_width, self.max_tokens,
                              loss_masks=[e.loss_mask for e in episodes])
        if want_log_probs:
            packed["rollout_log_probs"] = pad_log_probs([e.log_probs for e in episodes], self.max_tokens)
        packed.update(episode_columns(episodes))
        packed["env_turn_rewards"] = placed_rewards(episodes, self.max_tokens)
        # this call's requests to the environment pool, on its first row (the step's summary sums the column)
        packed["agent_environment_requests"] = torch.zeros(len(episodes))
        if episodes:
            packed["agent_environment_requests"][0] = sum(self.places.request_counts().values()) - sent
        packed[ROW_SOURCE] = np.asarray(source, dtype=np.int64)
        packed[EPISODE_FIRST] = torch.tensor([float(i == 0 or source[i] != source[i - 1]) for i in range(len(source))])
        return {**packed, **non_tensor_columns(episodes)}

    def close(self) -> None:
        if self.places.programs is not None:
            self.places.programs.close()
        if self.places.sessions is not None:
            self.places.sessions.shutdown()
        if self.places.tools is not None:
            self.places.tools.close()


def fit_prompt(prompt: list[int], episode: Episode, width: int, response_width: int) -> tuple[list[int], Episode]:
    """A program's prompt within the row's prompt width: its first `width` tokens, the rest moved to the front of
    the response (loss mask 0, log-prob 0), the rewards' positions moved with it. The endpoint keeps each call
    within width + response_width tokens (its max_context), so the model's tokens fit the row; an episode pushed
    past the response width is cut there when packed (truncated). One whose row would hold no trained token (a
    prompt that filled it) fails, with no reward, rather than train a reward on a masked position."""
    fitted, length = episode, len(prompt)
    if length > width:
        extra = prompt[width:]
        prompt, fitted = prompt[:width], replace(
            episode, tokens=extra + episode.tokens,
            truncated=episode.truncated or len(extra) + len(episode.tokens) > response_width,
            loss_mask=[0] * len(extra) + episode.loss_mask, log_probs=[0.0] * len(extra) + episode.log_probs,
            turn_rewards=[(p + len(extra), r) for p, r in episode.turn_rewards])
    if fitted.error is None and not any(fitted.loss_mask[:response_width]):
        fitted = replace(fitted, error=f"no token of the model's fits the row ({width} + {response_width} tokens): "
                                       f"the program's prompt is {length} tokens", failure=PROGRAM, env_reward=0.0,
                         turn_rewards=[])
    return prompt, fitted


def placed_rewards(episodes: Sequence[Episode], width: int) -> torch.Tensor:
    """(B, width): each environment step's reward on the response position of the turn it answered (0 elsewhere);
    a row sums to its episode's env_reward."""
    out = torch.zeros(len(episodes), width)
    for i, e in enumerate(episodes):
        for position, reward in e.turn_rewards:
            out[i, min(position, width - 1)] += reward
    return out


def non_tensor_columns(episodes: Sequence[Episode]) -> dict[str, np.ndarray]:
    out = {k: np.empty(len(episodes), dtype=object) for k in NON_TENSOR_COLUMNS}
    out["agent_error"][:] = [e.error or "" for e in episodes]
    out["agent_failure"][:] = [e.failure or ("" if e.error is None else "failed") for e in episodes]
    out["agent_metrics"][:] = [dict(e.metrics) for e in episodes]
    return out


def episode_columns(episodes: Sequence[Episode]) -> dict[str, torch.Tensor]:
    values = {
        "agent_turns": [e.turns for e in episodes], "agent_tool_calls": [e.tool_calls for e in episodes],
        "agent_tool_errors": [e.tool_errors for e in episodes],
        "agent_tool_timeouts": [e.tool_timeouts for e in episodes],
        "agent_tool_seconds": [e.tool_seconds for e in episodes], "env_reward": [e.env_reward for e in episodes],
        "agent_env_steps": [e.env_steps for e in episodes], "agent_retries": [e.retries for e in episodes],
        "agent_truncated": [float(e.truncated) for e in episodes],
        "agent_failed": [float(e.error is not None) for e in episodes],
        "agent_trajectory_breaks": [e.trajectory_breaks for e in episodes]}
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in values.items()}

