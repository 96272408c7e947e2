"""Rollout replicas replaced alone (issue 29, item 1, for a rollout pool of its own).

When a replica's process or pod is lost, the controller drops it from the replicas that take work, hands what it
was generating back to the queue, and rebuilds it in the background (WorkerGroup.replace: on Kubernetes, in the
pod the operator created in place of the lost one). The rebuilt replica joins the weight stream at the next sync,
or at once when the trainer is waiting for trajectories (the stream's group is formed again over the replicas then
present); its engine's checksums are compared with the trainer's weights (vLLM and HF: the embedding), and only
then does it take work. Training goes on meanwhile: the other replicas keep generating, and with none left the
trainer waits on the queue; the actor is never rebuilt and no step runs twice.

Only rollout mode async does this (sync and one_step_off wait on the very generation a lost replica was making:
they recover as before, by rebuilding the workers and resuming from the last checkpoint), and only under
runPolicy.restartPolicy failedPod. Replacements count against runPolicy.replacementLimit; past it, a loss fails
the step as before (counted per set of workers: the operator counts the pods it replaces against the same limit).
A replica lost in the middle of a weight sync breaks that sync for every replica; the sync is
made again to the others (the actor's rank 0 closes the broken group, so they stop waiting at once).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray

from hybridflow.api.run_policy import RunPolicy
from hybridflow.single_controller.failures import is_worker_loss
from hybridflow.single_controller.worker_group import RoleHandle, WorkerGroup

log = logging.getLogger("hybridflow.trainer.replicas")

REPLICA_BUILD_TIMEOUT_S = 600.0
"""How long a lost replica's rebuild may take: on Kubernetes the operator's replacement pod must be scheduled, pull
its image, join Ray and build its engine. Past it the rebuild is an error (the job recovers as a whole)."""


@dataclass
class Replacement:
    """One lost replica and its replacement: who, why, and how long until it took work again."""

    rank: int
    reason: str
    lost_at: float  # perf_counter
    built: str = ""  # how the new replica is named (its node) once built
    joined_after: float | None = None  # seconds from the loss until it held the current weights and took work


class RolloutReplicas:
    """The replicas of a rollout pool of its own, as the controller sees them: `live` take work; `joining` were
    rebuilt and take the current weights at the next sync before they take work; the rest are being rebuilt.
    Thread-safe: the async producer loses replicas, the trainer's sync lets them join."""

    def __init__(self, group: WorkerGroup, role: RoleHandle, policy: RunPolicy | None, build_timeout_s: float) -> None:
        self.group, self.role, self.build_timeout_s = group, role, build_timeout_s
        self.replaceable = policy is not None and policy.restart_policy == "failedPod" and group.independent
        self.limit = policy.replacement_limit if policy is not None else 0
        self.live: list[int] = list(range(len(group.hosts)))
        self.joining: list[int] = []
        self.replacements: list[Replacement] = []
        self.error: BaseException | None = None  # a rebuild that failed: the producer raises it
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []

    @property
    def size(self) -> int:
        return len(self.group.hosts)

    def members(self) -> list[int]:
        """The replicas the weight stream serves: those taking work and those about to."""
        with self._cond:
            return sorted(self.live + self.joining)

    def working(self) -> list[int]:
        with self._cond:
            return list(self.live)

    def joining_now(self) -> list[int]:
        with self._cond:
            return list(self.joining)

    def handle(self, ranks: Sequence[int]) -> RoleHandle:
        """The rollout role on `ranks` (all of them: the role as built)."""
        return self.role if list(ranks) == list(range(self.size)) else self.role.on(ranks)

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
        members = self.members()
        if not self.replaceable or not members:
            return []
        lost = [r for r, ok in zip(members, self.group.alive(members)) if not ok]
        if not lost:
            return []
        with self._cond:
            if len(self.replacements) + len(lost) > self.limit:
                log.warning("rollout replica(s) %s lost, past runPolicy.replacementLimit %d: not rebuilt alone",
                            lost, self.limit)
                return []
            for rank in lost:
                self._replace(rank, reason)
        return lost

    def _replace(self, rank: int, reason: str) -> None:
        """Holding the lock: `rank` leaves the replicas and is rebuilt in the background."""
        if rank in self.live:
            self.live.remove(rank)
        if rank in self.joining:
            self.joining.remove(rank)
        event = Replacement(rank, reason.splitlines()[0][:300], time.perf_counter())
        self.replacements.append(event)
        log.warning("rollout replica %d lost (%s): rebuilding it while the other replicas (%s) go on",
                    rank, event.reason, self.live or "none")
        thread = threading.Thread(target=self._rebuild, args=(event,), name=f"rebuild-rollout-{rank}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _rebuild(self, event: Replacement) -> None:
        try:
            event.built = self.group.replace(event.rank, self.build_timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to the producer, which raises it
            error = RuntimeError(f"rollout replica {event.rank} could not be rebuilt (the limit is "
                                 f"{self.build_timeout_s:.0f} s): {e}")
            error.__cause__ = e  # a lost node stays a worker loss: the driver recovers the whole job in place
            with self._cond:
                self.error = error
                self._cond.notify_all()
            return
        with self._cond:
            self.joining.append(event.rank)
            self._cond.notify_all()
        log.warning("rollout replica %d rebuilt on %s: it takes the current weights at the next sync",
                    event.rank, event.built)

    def joined(self, checked: dict[int, bool]) -> list[Replacement]:
        """After a sync that reached every member: the joining replicas whose weights `checked` true take work.
        Returns their replacements (with how long each took)."""
        done = []
        with self._cond:
            for rank in list(self.joining):
                if rank not in checked:
                    continue
                if not checked[rank]:
                    raise RuntimeError(f"rollout replica {rank} rebuilt on {self.group.where[rank]} does not hold "
                                       "the trainer's weights after the sync")
                self.joining.remove(rank)
                self.live.append(rank)
                self.live.sort()
                event = next(e for e in reversed(self.replacements) if e.rank == rank)
                event.joined_after = time.perf_counter() - event.lost_at
                done.append(event)
            self._cond.notify_all()
        for e in done:
            log.warning("rollout replica %d takes work again, %.1f s after it was lost", e.rank, e.joined_after)
        return done

    def wait_working(self, stop: threading.Event) -> None:
        """Until a replica takes work (all lost: the trainer admits rebuilt ones while it waits for trajectories,
        or at its next sync), a rebuild failed (raised here) or `stop` is set."""
        with self._cond:
            while not self.live and self.error is None and not stop.is_set():
                self._cond.wait(0.5)
            if self.error is not None:
                raise self.error

    def settle(self, timeout_s: float) -> None:
        """Until every rebuild started has ended (a job ending waits for them: its evaluation uses every replica)."""
        deadline = time.monotonic() + timeout_s
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        if self.error is not None:
            raise self.error
        if any(t.is_alive() for t in self._threads):
            raise RuntimeError(f"rollout replicas still being rebuilt after {timeout_s:.0f} s")

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"rollout_replicas": float(self.size), "rollout_replicas_working": float(len(self.live)),
                    "rollout_replicas_replaced_total": float(len(self.replacements))}
