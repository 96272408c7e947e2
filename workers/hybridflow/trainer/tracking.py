"""Experiment trackers: after every step the driver hands each tracker the job's metrics as its Prometheus endpoint
serves them (JobMetrics.scalars), so a curve has one name in Grafana and in the tracker.

A tracker is one entry of TRACKERS, named after its field of spec.tracking, built once the job knows the step it
resumed from: a tracker keeps one run per job across restarts, and a resumed job redoes the steps after its
checkpoint, whose earlier points must not stay beside the new ones.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Protocol

from hybridflow.api import RLHFJob
from hybridflow.registry import Registry


class Tracker(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


TrackerFactory = Callable[[RLHFJob, int], Tracker]  # (job, the step it resumed from: 0 for a fresh start)
TRACKERS: Registry[TrackerFactory] = Registry("experiment tracker")


class TensorBoardTracker:
    """Event files in <checkpointDir>/tensorboard, flushed after every step (a killed pod loses no logged step).
    Opened with purge_step = the first step this run logs (0 for a fresh start: the held-out reward before
    training): TensorBoard hides the points an earlier run wrote from that step on (the steps done after the last
    checkpoint, done again now)."""

    def __init__(self, log_dir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_step)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@TRACKERS.register("tensorboard")
def tensorboard(job: RLHFJob, resumed_step: int) -> Tracker:
    return TensorBoardTracker(Path(job.spec.trainer.checkpoint_dir) / "tensorboard",
                              resumed_step + 1 if resumed_step else 0)


def open_trackers(job: RLHFJob, resumed_step: int) -> list[Tracker]:
    """The trackers spec.tracking turns on."""
    wanted = job.spec.tracking.model_dump()
    return [TRACKERS[name](job, resumed_step) for name in TRACKERS.names() if wanted.get(name)]
