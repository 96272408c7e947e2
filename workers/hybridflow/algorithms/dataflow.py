"""What an algorithm's program may ask of one iteration: the operations of HybridFlow's single controller over the
worker groups (section 4). Programs type against this Protocol, defined beside them, so the algorithms depend on no
controller module; `hybridflow.trainer.step.Step` implements it (tests/trainer/test_step.py checks it does), over the
controller's own batches (hybridflow.single_controller.batch.Batch, a `Columns`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from torch import Tensor


C = TypeVar("C", bound="Columns")


class Columns(Protocol):
    """What a program does with a batch itself: read a column (e.g. "scores", "costs") and add columns. The rest it
    hands back to the Dataflow that made it."""

    def __getitem__(self, name: str) -> Tensor: ...

    def with_columns(self: C, **columns: Tensor) -> C: ...


Batch = TypeVar("Batch", bound=Columns)  # the batches of one Dataflow: a program works with any kind


class Dataflow(Protocol[Batch]):
    @property
    def responses_per_prompt(self) -> int: ...

    @property
    def prompts_per_step(self) -> int: ...

    @property
    def max_sampling_rounds(self) -> int: ...

    def carried(self, name: str) -> Any:
        """The algorithm's own state across steps, made by its `Algorithm.carried` (e.g. safe_rlhf's Lagrangian)."""

    def next_prompts(self) -> Batch: ...

    def generate(self, prompts: Batch, greedy_baseline: bool = False) -> Any: ...

    def compute(self, batch: Any, *stages: str) -> Batch: ...

    def advantages(self, batch: Batch, scores: str = "scores", values: str = "values", kl_weight: float = 1.0,
                   baseline: Tensor | None = None, whiten: bool = True) -> tuple[Tensor, Tensor]: ...

    def groups_with_varied_scores(self, batch: Batch) -> list[Batch]: ...

    def fill_batch(self, groups: list[Batch], spare: Batch) -> Batch: ...

    def update_critic(self, batch: Batch, role: str = "critic") -> None: ...

    def update_actor(self, batch: Batch) -> None: ...

    def sync_weights(self) -> None: ...


class Carried(Protocol):
    """State an algorithm keeps from step to step: saved in checkpoints, exported as metrics."""

    def state(self) -> dict[str, Any]: ...

    def load(self, state: dict[str, Any]) -> None: ...

    def metrics(self) -> dict[str, float]: ...
