"""What an RLHF algorithm is here: the roles it needs, its constraints, the spec defaults it brings, and its dataflow
as a short controller program (HybridFlow section 4: a new algorithm is a few lines over existing worker groups).

A program gets a `Dataflow` (algorithms/dataflow.py): the worker groups' operations for one iteration - generate,
compute (stages run concurrently where their pools differ), advantages, update_critic, update_actor, sync_weights.
What an algorithm carries between steps beyond the KL coefficient (safe_rlhf's multiplier) it makes itself
(`carried`), so the controller knows no algorithm by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from hybridflow.algorithms.registry import Registry

if TYPE_CHECKING:
    from hybridflow.algorithms.dataflow import Batch, Carried, Dataflow


class Program(Protocol):
    """An algorithm's dataflow for one iteration, from the step's prompts: over any Dataflow's batches."""

    def __call__(self, c: Dataflow[Batch], prompts: Batch, /) -> None: ...


def _nothing_carried(settings: Any) -> dict[str, Carried]:
    return {}


@dataclass(frozen=True)
class Algorithm:
    name: str
    program: Program
    summary: str
    critic: bool = False  # a value model (GAE)
    cost: bool = False  # Safe-RLHF: a cost (rule or model, spec.models.cost) and a cost critic
    min_group: int = 1  # responses per prompt it needs (group baselines need 2)
    # one greedy response per prompt made in the same engine call as the samples (remax's baseline): a step
    # generates promptsPerStep more rows, and the baseline is only the trained policy's when generated with it
    greedy_baseline: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)  # spec.algorithm fields the user left unset
    # spec.algorithm -> its state across steps by name (checkpointed under that name, read by `Dataflow.carried`)
    carried: Callable[[Any], Mapping[str, Carried]] = _nothing_carried


ALGORITHMS: Registry[Algorithm] = Registry("algorithm")


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    ALGORITHMS.add(algorithm.name, algorithm)
    return algorithm
