"""Trajectories as asynchronous rollout builds them, and the staleness rule: pure functions over token ids, the
engine's log-probs and the policy version of every token, so the bound the trainer keeps is testable alone.

A trajectory's staleness, when it is trained, is the trainer's policy version minus the version of its OLDEST
token (a partial rollout mixes versions: its first tokens came from older weights than its last). A trajectory is
trained only if that is at most spec.rollout.maxStaleness; otherwise it is dropped and counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from hybridflow.data.packing import pack_rollout, pad_log_probs
from hybridflow.single_controller.batch import Batch


def staleness(trainer_version: int, oldest_token_version: int) -> int:
    return trainer_version - oldest_token_version


def too_stale(trainer_version: int, oldest_token_version: int, max_staleness: int) -> bool:
    return staleness(trainer_version, oldest_token_version) > max_staleness


@dataclass
class Trajectory:
    """One response in the making: its prompt row's columns (prompt_ids, uid, truth...), the tokens so far, the
    engine's log-prob of each and the policy version that produced each."""

    row: dict[str, Any]
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False

    def advance(self, tokens: Sequence[int], log_probs: Sequence[float], version: int, asked: int, max_len: int,
                stop_ids: Sequence[int]) -> None:
        """Append one engine call's tokens (it was asked for at most `asked`): the response is done when the
        engine stopped early (a stop token, or fewer tokens than asked) or it reached `max_len`."""
        self.tokens += list(tokens)
        self.log_probs += list(log_probs) if log_probs else [0.0] * len(tokens)
        self.versions += [version] * len(tokens)
        stopped = len(tokens) < asked or (len(tokens) > 0 and tokens[-1] in stop_ids)
        self.done = stopped or len(self.tokens) >= max_len

    @property
    def oldest_version(self) -> int | None:
        return min(self.versions) if self.versions else None


def token_versions(batch: Batch, versions: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """(B, width) int64, each response token's policy version, -1 past the response (aligned with `responses`)."""
    out = torch.full((len(batch), width), -1, dtype=torch.int64)
    for i, v in enumerate(versions):
        out[i, : len(v)] = torch.as_tensor(list(v), dtype=torch.int64)
    return out


def oldest_versions(batch: Batch) -> torch.Tensor:
    """Each row's oldest token version (rows without a response token: the newest version there is)."""
    v = batch["token_versions"]
    big = torch.iinfo(torch.int64).max
    oldest = torch.where(v >= 0, v, torch.full_like(v, big)).min(1).values
    return torch.where(oldest == big, v.max(1).values.clamp(min=0), oldest)


def pack_trajectories(trajectories: Sequence[Trajectory], prompt_width: int, response_width: int) -> Batch:
    """Finished trajectories as the batch a generate call returns: packed tensors, the engine's log-probs, each
    token's version, and the prompt rows' other columns."""
    prompts = [list(t.row["prompt_ids"]) for t in trajectories]
    packed = pack_rollout(prompts, [t.tokens for t in trajectories], prompt_width, response_width)
    packed["rollout_log_probs"] = pad_log_probs([t.log_probs for t in trajectories], response_width)
    keys = list(trajectories[0].row)
    non_tensors = {k: [t.row[k] for t in trajectories] for k in keys}
    batch = Batch(packed, non_tensors)
    batch.tensors["token_versions"] = token_versions(batch, [t.versions for t in trajectories], response_width)
    return batch

