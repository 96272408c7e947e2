"""The remote stages of a step: which role computes each one and through which method of its Protocol, typed, so
that a batch can be followed from the controller's `Step.compute(batch, "values")` into the critic's worker.

A stage's `launch` calls the role's handle as its Protocol (hybridflow.roles.protocols): a type checker holds it to
the Protocol and tests/roles/test_role_protocols.py holds the Protocol to the worker class. Adding a stage is one
`register_stage` here (and the algorithms' dataflow programs naming it); a new role's stage names its Protocol."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

from hybridflow.registry import Registry
from hybridflow.roles.protocols import ActorRole, BatchIn, CriticRole, ReferenceRole, RewardModelRole

if TYPE_CHECKING:
    from hybridflow.single_controller.batch import Batch
    from hybridflow.single_controller.worker_group import PendingResult, RoleHandle

P = TypeVar("P")


@dataclass(frozen=True)
class Stage(Generic[P]):
    """One remote stage. `scores`: the column of the role's output that is the stage's scores (a reward or cost
    model's), which the controller takes apart from the batch; None: the output's columns join the batch.
    `optional`: skipped when the job has no such role (the reference policy, without a KL term)."""

    name: str
    role: str  # a registered role (hybridflow.api.roles)
    protocol: type[P]
    method: str  # the Protocol's method `launch` calls (for messages and the step's timings)
    launch: Callable[[P, BatchIn], "PendingResult[Batch]"]
    scores: str | None = None
    optional: bool = False

    def run(self, handle: "RoleHandle[Any]", batch: BatchIn) -> "PendingResult[Batch]":
        """Start the stage on `batch` through the role's handle (dispatched as `handle.<method>(batch)` is)."""
        return self.launch(handle.typed(self.protocol).call, batch)

    @property
    def pair(self) -> tuple[str, str]:
        """(role, worker method): the stage as the step's table wrote it."""
        return self.role, self.method


STAGES: Registry[Stage[Any]] = Registry("stage", plural="stages")


def register_stage(stage: Stage[Any]) -> Stage[Any]:
    STAGES.add(stage.name, stage)
    return stage


def _old_log_prob(actor: ActorRole, batch: BatchIn) -> "PendingResult[Batch]":
    return actor.compute_log_prob(batch)


def _reference(ref: ReferenceRole, batch: BatchIn) -> "PendingResult[Batch]":
    return ref.compute_ref_log_prob(batch)


def _values(critic: CriticRole, batch: BatchIn) -> "PendingResult[Batch]":
    return critic.compute_values(batch)


def _scores(model: RewardModelRole, batch: BatchIn) -> "PendingResult[Batch]":
    return model.compute_rm_scores(batch)


register_stage(Stage("old_log_prob", "actor", ActorRole, "compute_log_prob", _old_log_prob))
register_stage(Stage("reference", "reference", ReferenceRole, "compute_ref_log_prob", _reference, optional=True))
register_stage(Stage("values", "critic", CriticRole, "compute_values", _values))
register_stage(Stage("cost_values", "cost_critic", CriticRole, "compute_values", _values))
# "reward" and "cost" run on the controller instead when they are rules or functions (the step's scorers).
register_stage(Stage("reward", "reward", RewardModelRole, "compute_rm_scores", _scores, scores="rm_scores"))
register_stage(Stage("cost", "cost", RewardModelRole, "compute_rm_scores", _scores, scores="rm_scores"))


def remote_stages() -> dict[str, tuple[str, str]]:
    """stage -> (role, worker method): the step's REMOTE_STAGES table, derived from STAGES."""
    return {name: stage.pair for name, stage in STAGES.items()}


def optional_stages() -> set[str]:
    """The stages skipped when the job lacks their role (the step's OPTIONAL_STAGES)."""
    return {name for name, stage in STAGES.items() if stage.optional}
