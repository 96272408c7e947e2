"""In-place recovery (runPolicy.restartPolicy failedPod): when a worker process or its node is lost, the controller
goes on. It drops its worker groups (the surviving workers are ended; their pods, and the Ray nodes in them, stay),
builds them again once the pools have their devices back (on Kubernetes: once the operator has replaced the failed
pod alone; locally: at once), and `fit` resumes from the newest sealed checkpoint, so every step runs exactly once
in the step log. Anything else that fails the job (its own code, bad input) is not retried here.

`Recoveries` decides and counts; `execute` (trainer.loop) carries it out. The limit is runPolicy.replacementLimit,
the one the operator counts its pod replacements against: past it, the driver exits and the operator restarts the
gang (or, with `hybridflow run`, the job fails with its checkpoints kept).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hybridflow.api.run_policy import RunPolicy
from hybridflow.single_controller.failures import is_worker_loss


@dataclass
class Recoveries:
    """The in-place recoveries of one driver: whether another is allowed, and how long the last one took (from the
    loss, as the controller saw it, to the next step logged)."""

    policy: RunPolicy
    done: int = 0
    lost_at: float | None = None  # perf_counter when the loss being recovered from was seen
    seconds: list[float] = field(default_factory=list)  # each finished recovery's duration

    def recoverable(self, err: BaseException) -> bool:
        """Whether the controller rebuilds its workers after `err` (and counts it), or lets the job fail."""
        if self.policy.restart_policy != "failedPod" or not is_worker_loss(err):
            return False
        if self.done >= self.policy.replacement_limit:
            return False
        self.done += 1
        self.lost_at = time.perf_counter()
        return True

    def step_logged(self) -> float | None:
        """A step was logged: the seconds since the loss when it is the first step after a recovery, else None."""
        if self.lost_at is None:
            return None
        took = time.perf_counter() - self.lost_at
        self.lost_at = None
        self.seconds.append(took)
        return took
