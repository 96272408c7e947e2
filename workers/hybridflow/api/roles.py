"""The roles a job may run: one registered definition each (its name, the spec section that configures it, whether
a job runs it, and the Protocol through which the controller calls it), in the order they are built and listed.

ROLES (api.names), the placement's keys, `JobSpec.roles()`, status.pools, `hybridflow algorithms`' list of roles and
the Protocol checks (tests/roles/test_role_protocols.py) all follow this table. Lazy like the engines' table: the Protocol
and the worker classes are named "module:attribute" and imported only by whoever calls a role, so this stays
torch-free. A new role is more than its `register_role` here: its worker module, its Protocol
(hybridflow.roles.protocols), its section of the spec (hybridflow.roles.config), its stage (hybridflow.roles.stages)
and its wiring in the trainer's setup (hybridflow.trainer.setup); docs/architecture.md's "to add" table, row "a
role", lists them and what follows."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from hybridflow.algorithms import ALGORITHMS
from hybridflow.registry import Registry


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class _Scorer(Protocol):  # a RewardSpec
    @property
    def model(self) -> object: ...  # its reward model, if any

    @property
    def judge(self) -> object: ...  # its generative judge, if any


class _RoleModels(Protocol):  # spec.models (api.sources.Models)
    @property
    def reference(self) -> bool: ...

    @property
    def reward(self) -> _Scorer: ...

    @property
    def cost(self) -> _Scorer | None: ...


class RoleRunsSpec(Protocol):
    """What a role's `runs` reads of a job's spec (a JobSpec): its algorithm's name and its models. A Protocol, since
    the spec is built from this table (its placement's keys are the roles) and sits above it."""

    @property
    def algorithm(self) -> _Named: ...

    @property
    def models(self) -> _RoleModels: ...


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class RoleKind:
    """One role. `protocol` is what every worker class of the role offers the controller; `workers` pairs each
    worker class that may serve it with the Protocol it implements (the rollout role's colocated and pooled workers
    each add methods of their own to the common one)."""

    name: str
    section: str  # the spec's section that configures it, e.g. "models.critic" (`hybridflow algorithms` lists it)
    runs: Callable[[RoleRunsSpec], bool]  # whether a job runs it (JobSpec.roles)
    protocol: str  # "module:Protocol"
    workers: tuple[tuple[str, str], ...]  # ("module:WorkerClass", "module:Protocol") pairs
    summary: str = ""  # what it is, for `hybridflow algorithms`
    trained: bool = False  # holds optimizer state and is checkpointed

    def load_protocol(self) -> type:
        return _load(self.protocol)

    def load_workers(self) -> list[tuple[type, type]]:
        """(worker class, Protocol it implements) pairs."""
        return [(_load(w), _load(p)) for w, p in self.workers]


ROLE_KINDS: Registry[RoleKind] = Registry("role", plural="roles")


def register_role(kind: RoleKind) -> RoleKind:
    ROLE_KINDS.add(kind.name, kind)
    return kind


_P, _R = "hybridflow.roles.protocols:", "hybridflow.roles."

register_role(RoleKind(
    "actor", "models.actor", lambda s: True, _P + "ActorRole", ((_R + "actor:ActorWorker", _P + "ActorRole"),),
    "the policy being trained", trained=True))
register_role(RoleKind(
    "rollout", "rollout", lambda s: True, _P + "RolloutRole",
    ((_R + "rollout:RolloutWorker", _P + "ColocatedRolloutRole"),
     (_R + "rollout:PooledRolloutWorker", _P + "PooledRolloutRole")),
    "generation: beside the actor on its engine, or replicas on a pool of their own"))
register_role(RoleKind(
    "reference", "models.reference", lambda s: s.models.reference, _P + "ReferenceRole",
    ((_R + "reference:ReferenceWorker", _P + "ReferenceRole"), (_R + "actor:ActorWorker", _P + "ActorRole")),
    "the frozen initial policy, for the KL term"))  # the actor serves it with spec.training.lora (trainer.setup)
register_role(RoleKind(
    "critic", "models.critic", lambda s: ALGORITHMS[s.algorithm.name].critic, _P + "CriticRole",
    ((_R + "critic:CriticWorker", _P + "CriticRole"),), "the value model of the reward", trained=True))
register_role(RoleKind(
    "reward", "models.reward", lambda s: s.models.reward.model is not None, _P + "RewardModelRole",
    ((_R + "reward_model:RewardModelWorker", _P + "RewardModelRole"),), "a reward model"))
register_role(RoleKind(
    "judge", "models.reward.judge", lambda s: s.models.reward.judge is not None, _P + "JudgeRole",
    ((_R + "judge:JudgeWorker", _P + "JudgeRole"),), "a generative judge of the responses (its own engine)"))
register_role(RoleKind(
    "cost", "models.cost", lambda s: s.models.cost is not None and s.models.cost.model is not None,
    _P + "RewardModelRole", ((_R + "reward_model:RewardModelWorker", _P + "RewardModelRole"),),
    "a cost model (safe_rlhf)"))
register_role(RoleKind(
    "cost_critic", "models.critic", lambda s: ALGORITHMS[s.algorithm.name].cost, _P + "CriticRole",
    ((_R + "critic:CriticWorker", _P + "CriticRole"),), "the value model of the cost (safe_rlhf)", trained=True))


def trained_roles() -> tuple[str, ...]:
    """The roles that hold optimizer state (and are checkpointed), in ROLE_KINDS' order."""
    return tuple(r for r, kind in ROLE_KINDS.items() if kind.trained)
