"""A job's checkpointDir as one object: the checkpoints in it (`store`), how one is written, sealed and chosen for a
resume (`sealing`), and the step and rollout logs beside them (`steplog`). The controller's checkpointer holds one
`CheckpointRoot` and asks it, rather than handing the directory's path to each of them."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from hybridflow.checkpoint import sealing, steplog
from hybridflow.checkpoint.store import StoragePath, list_checkpoints, open_root


@dataclass(frozen=True)
class CheckpointRoot:
    """One checkpointDir (local, or on object storage)."""

    path: StoragePath

    @classmethod
    def open(cls, location: str) -> "CheckpointRoot":
        """`location` (spec.trainer.checkpointDir), created when missing; object storage checked reachable."""
        return cls(open_root(location))

    def __str__(self) -> str:
        return str(self.path)

    # -- its checkpoints -------------------------------------------------------------------------------------

    def checkpoints(self) -> list[StoragePath]:
        """Its step_* directories, oldest first (sealed or not)."""
        return list_checkpoints(self.path)

    def latest_good(self) -> tuple[Path, dict[str, Any]] | None:
        """Its newest intact checkpoint and that checkpoint's trainer state (corrupt newer ones are skipped)."""
        return sealing.latest_good(self.path)

    def remove_unsealed(self) -> int:
        """Delete what saves that never sealed left behind; how many."""
        return sealing.remove_unsealed(self.path)

    @contextlib.contextmanager
    def writing(self, step: int, ident: dict[str, Any] | None = None,
                staging: Path | None = None) -> Iterator[Path]:
        """The staging directory of checkpoint `step` (sealing.writing)."""
        with sealing.writing(self.path, step, ident, staging) as where:
            yield where

    def seal(self, staging: Path, step: int, trainer_state: dict[str, Any], keep: int,
             ident: dict[str, Any] | None = None, digests: dict[str, str] | None = None) -> Path:
        """Seal checkpoint `step` written into `staging`, and prune (sealing.seal)."""
        return sealing.seal(self.path, staging, step, trainer_state, keep, ident, digests)

    # -- the step and rollout logs beside them -----------------------------------------------------------------

    def step_log(self) -> list[dict[str, Any]]:
        return steplog.read_step_log(self.path)

    def log_step(self, record: dict[str, Any]) -> None:
        steplog.append_step_log(self.path, record)

    def write_rollouts(self, step: int, records: list[dict[str, Any]]) -> None:
        steplog.write_rollouts(self.path, step, records)

    def rewind(self, step: int) -> int:
        """Both logs back to `step` (the checkpoint resumed from; 0: a fresh start): the steps after it are redone
        and log again. Returns how many step records were dropped."""
        dropped = steplog.rewind_step_log(self.path, step)
        steplog.rewind_rollouts(self.path, step)
        return dropped
