"""What an RLHF algorithm is here: the roles it needs, its constraints, the spec defaults it brings, and its dataflow
as a short controller program (HybridFlow section 4: a new algorithm is a few lines over existing worker groups).

A program gets a `Step` (hybridflow.controller.step): the worker groups' operations for one iteration - generate,
compute (stages run concurrently where their pools differ), advantages, update_critic, update_actor, sync_weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from hybridflow.algorithms.registry import Registry

if TYPE_CHECKING:
    from hybridflow.controller.batch import Batch
    from hybridflow.controller.step import Step

Program = Callable[["Step", "Batch"], None]


@dataclass(frozen=True)
class Algorithm:
    name: str
    program: Program
    summary: str
    critic: bool = False  # a value model (GAE)
    cost: bool = False  # Safe-RLHF: a cost (rule or model, spec.models.cost) and a cost critic
    min_group: int = 1  # responses per prompt it needs (group baselines need 2)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # spec.algorithm fields the user left unset


ALGORITHMS: Registry[Algorithm] = Registry("algorithm")


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    ALGORITHMS.add(algorithm.name, algorithm)
    return algorithm
