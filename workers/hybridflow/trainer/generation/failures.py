"""The replicas' failure policy: a lost rollout replica is replaced alone (issue 29, item 1, for a rollout pool of
its own).

When a replica's process or pod is lost, the controller drops it from the replicas that take work, hands what it
was generating back to the queue, and rebuilds it in the background (WorkerGroup.replace: on Kubernetes, in the
pod the operator created in place of the lost one). The rebuilt replica joins as any replica built while the job
runs does (trainer.generation.replicas). Training goes on meanwhile: the other replicas keep generating, and with
none left the trainer waits on the queue; the actor is never rebuilt and no step runs twice.

Only rollout mode async does this (sync and one_step_off wait on the very generation a lost replica was making:
they recover as before, by rebuilding the workers and resuming from the last checkpoint), and only under
runPolicy.restartPolicy failedPod. Replacements count against runPolicy.replacementLimit; past it, a loss fails
the step as before (counted per set of workers: the operator counts the pods it replaces against the same limit).
A replica lost in the middle of a weight sync breaks that sync for every replica; the sync is made again to the
others (the actor's rank 0 closes the broken group, so they stop waiting at once)."""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import ray

from hybridflow.api.run_policy import RunPolicy
from hybridflow.single_controller.failures import is_worker_loss
from hybridflow.trainer.generation.replicas import Replacement, RolloutReplicas

log = logging.getLogger("hybridflow.trainer.replicas")


class ReplaceLost:
    """Rebuild a lost replica alone, up to runPolicy.replacementLimit (`policy` None: never; the whole job
    recovers instead)."""

    def __init__(self, replicas: RolloutReplicas, policy: RunPolicy | None) -> None:
        self.replicas = replicas
        self.replaceable = (policy is not None and policy.restart_policy == "failedPod"
                            and replicas.group.independent)
        self.limit = policy.replacement_limit if policy is not None else 0
        self.replacements: list[Replacement] = []

    def lost_in(self, err: BaseException, refs: Sequence[Any], timeout_s: float) -> list[int]:
        """A call of ours failed with `err`: the replicas lost, which leave and are rebuilt (the call can be made
        again on the others); none when the error stands (not a worker loss, not replaceable, past the limit).
        The call's other ranks finish their part first (`refs`, at most `timeout_s`), so a replica still working
        is never taken for a lost one."""
        if not self.replaceable or not is_worker_loss(err):
            return []
        ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s, fetch_local=False)
        return self.check(str(err))

    def check(self, reason: str = "did not answer between generations") -> list[int]:
        """With no call of ours in flight: a member that does not answer is lost (it died idle, or during a call
        that failed), and is rebuilt. Returns the ranks lost; none past runPolicy.replacementLimit (the caller's
        error then stands: the whole job recovers, or fails)."""
        r = self.replicas
        members = r.members()
        if not self.replaceable or not members:
            return []
        lost = [rank for rank, ok in zip(members, r.group.alive(members)) if not ok]
        if not lost:
            return []
        with r.cond:
            if len(self.replacements) + len(lost) > self.limit:
                log.warning("rollout replica(s) %s lost, past runPolicy.replacementLimit %d: not rebuilt alone",
                            lost, self.limit)
                return []
            for rank in lost:
                self._replace(rank, reason)
        return lost

    def _replace(self, rank: int, reason: str) -> None:
        """Holding the replicas' lock: `rank` leaves the replicas and is rebuilt in the background."""
        event = Replacement(rank, reason.splitlines()[0][:300], time.perf_counter())
        self.replacements.append(event)
        self.replicas.building(event)
        log.warning("rollout replica %d lost (%s): rebuilding it while the other replicas (%s) go on",
                    rank, event.reason, self.replicas.live or "none")
        self.replicas.start(self._rebuild, (event,), f"rebuild-rollout-{rank}")

    def _rebuild(self, event: Replacement) -> None:
        r = self.replicas
        try:
            event.built = r.group.replace(event.rank, r.build_timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to the producer, which raises it
            error = RuntimeError(f"rollout replica {event.rank} could not be rebuilt (the limit is "
                                 f"{r.build_timeout_s:.0f} s): {e}")
            error.__cause__ = e  # a lost node stays a worker loss: the driver recovers the whole job in place
            r.failed(error)
            return
        with r.cond:
            r.built([event.rank])
        log.warning("rollout replica %d rebuilt on %s: it takes the current weights at the next sync",
                    event.rank, event.built)

    def stats(self) -> dict[str, float]:
        return {"rollout_replicas_replaced_total": float(len(self.replacements))}
