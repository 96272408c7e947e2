"""The rows a generation gives, as the controller fits them to the stages after it: pure functions over a Batch.

A generation's rows are not always its prompts times responsesPerPrompt: an agent program's episode can be several
rows (spec.rollout.agent.trajectory: hybridflow.agents.trajectory), adjacent, each carrying its prompt's `uid`.
So a prompt's group is the rows with its uid (`prompt_groups`), and a batch whose row count does not divide
among the training ranks (every stage after generation splits it by data-parallel rank, equally: the ranks of one
model run their micro-batches in lockstep) is padded with untrained rows (`padded`): copies of its last row with
no token trained (response_mask 0), scored 0 (its env_reward, per-row numbers and placed rewards cleared), no
episode (no failure, not an episode's first row), and a uid of its own below 0, a group of one whose advantage is 0
under every group estimator. The padding rows are spread over the batch, not appended: each rank takes a contiguous
part of it (single_controller.protocol.split_for_dp), and a rank of padding only would train on nothing while its
mean still counts in the step's gradient.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import numpy as np
import torch

from hybridflow.roles.stages import remote_stages
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.worker_group import PendingResult, resolve

# per-row columns cleared on a padding row (the rest are copied from the row it copies: its tokens, log-probs)
_CLEARED_2D = ("response_mask", "env_turn_rewards")
_CLEARED_TEXT = {"agent_error": "", "agent_failure": "", "agent_metrics": None}


def is_padding(batch: Batch) -> np.ndarray:
    """(B,) bool: the rows `padded` added (their uid is below 0)."""
    return batch["uid"].astype(np.int64) < 0 if "uid" in batch else np.zeros(len(batch), dtype=bool)


def prompt_groups(batch: Batch) -> list[Batch]:
    """Each prompt's rows (those of one uid, in their order; the groups in order of first appearance), padding rows
    (uid below 0) left out: a padding row between a group's rows does not split it."""
    if len(batch) == 0:
        return []
    uid = batch["uid"].astype(np.int64)
    rows: dict[int, list[int]] = {}
    for i, u in enumerate(uid.tolist()):
        if u >= 0:
            rows.setdefault(u, []).append(i)
    return [batch.index(slice(g[0], g[-1] + 1)) if g[-1] - g[0] + 1 == len(g) else batch.index(np.asarray(g))
            for g in rows.values()]


def spread(real: int, total: int) -> np.ndarray:
    """(total,) bool: where `real` rows go among `total` so that every contiguous equal part of the batch (any number
    of parts dividing `total`) holds floor or ceil of its share of them: position j is real when floor((j+1) real /
    total) > floor(j real / total) (Bresenham's line), so the first m positions hold floor(m real / total)."""
    j = np.arange(total)
    return (j + 1) * real // total > j * real // total


def padded(batch: Batch, divisor: int) -> Batch:
    """`batch` with untrained rows up to a multiple of `divisor`, spread among its rows (`spread`; its own rows keep
    their order; see the module's docstring)."""
    k = -len(batch) % divisor
    if not k or not len(batch):
        return batch
    pad = batch.index(np.full(k, len(batch) - 1))
    for name, column in pad.tensors.items():
        if name in _CLEARED_2D or (column.dim() == 1 and column.is_floating_point()):
            pad.tensors[name] = torch.zeros_like(column)
    for name, value in _CLEARED_TEXT.items():
        if name in pad.non_tensors:
            pad.non_tensors[name][:] = [{} if value is None else value for _ in range(k)]
    if "uid" in pad.non_tensors:
        low = min(0, int(batch["uid"].astype(np.int64).min()))
        pad.non_tensors["uid"][:] = list(range(low - 1, low - 1 - k, -1))
    real = spread(len(batch), len(batch) + k)
    order = np.empty(len(batch) + k, dtype=np.int64)
    order[real], order[~real] = np.arange(len(batch)), len(batch) + np.arange(k)
    return Batch.concat([batch, pad]).index(order)


def dp_divisor(roles: Mapping[str, Any]) -> int:
    """The least row count every data-parallel layout of the roles that take the generated batch (`roles`: name ->
    RoleHandle; those of a stage in hybridflow.roles.stages.STAGES: the actor, reference, critics, reward models)
    splits equally. The rollout and judge roles never take it: their layouts do not count."""
    taking = {role for role, _ in remote_stages().values()}
    sizes = [int(s) for name, r in roles.items() if name in taking for s in getattr(r, "dp_sizes", {}).values()]
    return math.lcm(*sizes) if sizes else 1


def fitted(out: Any, divisor: int, rows_in: int | None = None) -> Any:
    """A generation's result (a Batch, or the PendingResult of one) padded to a multiple of `divisor`. With
    `rows_in` (a greedy baseline split by position after it) none are added: it must be one row per input row."""
    def fit(batch: Batch) -> Batch:
        if rows_in is None:
            return padded(batch, divisor)
        if len(batch) != rows_in:
            raise RuntimeError(f"a greedy baseline (ReMax) needs one row per response, and this generation gave "
                               f"{len(batch)} rows for {rows_in}: an agent program's episode was several sequences "
                               "(spec.rollout.agent.trajectory per_call, or merged with a call that did not continue "
                               "the previous one); make each episode one chain, or use another algorithm")
        return batch

    if isinstance(out, PendingResult):  # fetched once, on the controller, then split again for the stages after
        once = functools.cache(lambda: fit(resolve(out)))
        return PendingResult(out.refs, lambda _: once(), None, out.method, out.where, out.timeout_s)
    return fit(out)
