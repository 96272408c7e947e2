"""The replicas of a rollout pool of its own, as the controller sees them: which take work (`live`), which were
built while the job runs and take the current weights at the next sync before they work (`joining`), which are
being rebuilt, and which calls hold which replica (a replica is ended only once no call holds it).

Two policies change the set, each in a module of its own: the failure policy (`failures`: a lost replica leaves
and is rebuilt alone, issue 29 item 1) and the scaling policy (`scaling`: the pool grows into new pods and lets a
pod given notice leave, issue 29 item 3). `rollout_replicas` builds the set with both. A replica built by either
joins the same way: the weight stream is formed again over the members at the next sync (or at once when the
trainer waits for trajectories), its engine's checksums are compared with the trainer's weights, and only then does
it take work (`joined`)."""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

from hybridflow.roles.protocols import PooledRolloutRole
from hybridflow.single_controller.worker_group import RoleHandle, WorkerGroup

log = logging.getLogger("hybridflow.trainer.replicas")

REPLICA_BUILD_TIMEOUT_S = 600.0
"""How long a lost replica's rebuild may take: on Kubernetes the operator's replacement pod must be scheduled, pull
its image, join Ray and build its engine. Past it the rebuild is an error (the job recovers as a whole)."""


@dataclass
class Replacement:
    """One replica built while the job runs (`added`: for a slot the pool grew into; else in place of a lost one):
    who, why, and how long until it took work."""

    rank: int
    reason: str
    lost_at: float  # perf_counter: when it was lost, or when the slot was seen
    built: str = ""  # how the new replica is named (its node) once built
    joined_after: float | None = None  # seconds from the loss (the slot seen) until it held the weights and worked
    added: bool = False


class FailurePolicy(Protocol):
    """What becomes of a replica that is lost (trainer.generation.failures)."""

    def lost_in(self, err: BaseException, refs: Sequence[Any], timeout_s: float) -> list[int]: ...

    def check(self, reason: str = ...) -> list[int]: ...

    def stats(self) -> dict[str, float]: ...


class ScalingPolicy(Protocol):
    """How the pool grows and shrinks while the job runs (trainer.generation.scaling)."""

    def follow(self) -> None: ...

    def stop_following(self) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, float]: ...


class RolloutReplicas:
    """The replicas of a rollout pool of its own: `live` take work; `joining` were built and take the current
    weights at the next sync before they take work; `rebuilding` are being rebuilt. Thread-safe (`cond`): the async
    producer loses replicas, the scaling policy's thread grows and shrinks the pool, the trainer's sync lets them
    join. `failures` and `scaling` are its policies (set by `rollout_replicas`)."""

    failures: FailurePolicy
    scaling: ScalingPolicy

    def __init__(self, group: WorkerGroup, role: RoleHandle[PooledRolloutRole], build_timeout_s: float) -> None:
        self.group, self.role, self.build_timeout_s = group, role, build_timeout_s
        self.live: list[int] = list(range(len(group.hosts)))
        self.joining: list[int] = []
        self.rebuilding: set[int] = set()
        self.error: BaseException | None = None  # a build that failed: the producer raises it
        self._built = len(group.hosts)  # the role handle as built calls (and lays data out over) this many ranks
        self._joining_for: dict[int, Replacement] = {}  # rank -> why it is being built or joins (its latest event)
        self._claims: collections.Counter[int] = collections.Counter()  # calls in flight per rank
        self.cond = threading.Condition()
        self._threads: list[threading.Thread] = []

    def members(self) -> list[int]:
        """The replicas the weight stream serves: those taking work and those about to."""
        with self.cond:
            return sorted(self.live + self.joining)

    def working(self) -> list[int]:
        with self.cond:
            return list(self.live)

    def joining_now(self) -> list[int]:
        with self.cond:
            return list(self.joining)

    def handle(self, ranks: Sequence[int]) -> RoleHandle[PooledRolloutRole]:
        """The rollout role on `ranks` (the role as built when they are the ranks it was built on, all there are)."""
        every = list(range(len(self.group.hosts)))
        return self.role if list(ranks) == every and len(every) == self._built else self.role.on(ranks)

    # -- calls holding replicas ------------------------------------------------------------------------------

    def claim(self, joining_too: bool = False) -> list[int]:
        """The replicas a call is about to use (those taking work; `joining_too`: the weight stream's members),
        held until `unclaim`: a replica whose pod leaves is ended only once no call holds it."""
        with self.cond:
            ranks = sorted(self.live + (self.joining if joining_too else []))
            self._claims.update(ranks)
            return ranks

    def unclaim(self, ranks: Sequence[int]) -> None:
        with self.cond:
            self._claims.subtract(ranks)
            self.cond.notify_all()

    @contextlib.contextmanager
    def claimed(self, joining_too: bool = False) -> Iterator[list[int]]:
        ranks = self.claim(joining_too)
        try:
            yield ranks
        finally:
            self.unclaim(ranks)

    def wait_unclaimed(self, ranks: Sequence[int], timeout_s: float) -> None:
        """Until no call holds any of `ranks` (at most `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(self._claims[r] > 0 for r in ranks) and time.monotonic() < deadline:
                self.cond.wait(0.5)

    # -- the set changing (the policies' side; each holding `cond`) ------------------------------------------

    def leave(self, ranks: Sequence[int]) -> None:
        """Holding `cond`: `ranks` take no more work and no longer join."""
        for r in ranks:
            if r in self.live:
                self.live.remove(r)
            if r in self.joining:
                self.joining.remove(r)
            self._joining_for.pop(r, None)

    def building(self, event: Replacement) -> None:
        """Holding `cond`: the replica of `event` is being rebuilt."""
        self.leave([event.rank])
        self.rebuilding.add(event.rank)
        self._joining_for[event.rank] = event

    def built(self, ranks: Sequence[int], events: Sequence[Replacement] = ()) -> None:
        """Holding `cond`: `ranks` are built (rebuilt, or `events`: added) and join at the next sync."""
        for event in events:
            self._joining_for[event.rank] = event
        self.rebuilding.difference_update(ranks)
        self.joining += list(ranks)
        self.cond.notify_all()

    def failed(self, error: BaseException) -> None:
        """A build failed: the producer raises `error` (wait_working, settle)."""
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def held_slots(self) -> set[int | None]:
        """Holding `cond`: the slots our replicas are in (working, joining, being rebuilt)."""
        return {self.group.slot_of(r) for r in [*self.live, *self.joining, *self.rebuilding]}

    def start(self, target: Any, args: tuple, name: str) -> None:
        """A background thread of a policy's (a rebuild, a growth, a retirement), which `settle` waits for."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self.cond:
            self._threads.append(thread)
        thread.start()

    # -- joining ---------------------------------------------------------------------------------------------

    def joined(self, checked: dict[int, bool]) -> list[Replacement]:
        """After a sync that reached every member: the joining replicas whose weights `checked` true take work.
        Returns their replacements (with how long each took)."""
        done = []
        with self.cond:
            for rank in list(self.joining):
                if rank not in checked:
                    continue
                if not checked[rank]:
                    raise RuntimeError(f"rollout replica {rank} rebuilt on {self.group.where[rank]} does not hold "
                                       "the trainer's weights after the sync")
                self.joining.remove(rank)
                self.live.append(rank)
                self.live.sort()
                event = self._joining_for.pop(rank)
                event.joined_after = time.perf_counter() - event.lost_at
                done.append(event)
            self.cond.notify_all()
        for e in done:
            log.warning("rollout replica %d takes work %s, %.1f s after %s", e.rank,
                        "for the first time" if e.added else "again", e.joined_after,
                        "its pod joined" if e.added else "it was lost")
        return done

    def wait_working(self, stop: threading.Event) -> None:
        """Until a replica takes work (all lost: the trainer admits rebuilt ones while it waits for trajectories,
        or at its next sync), a rebuild failed (raised here) or `stop` is set."""
        with self.cond:
            while not self.live and self.error is None and not stop.is_set():
                self.cond.wait(0.5)
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
        with self.cond:
            held = len(self.live) + len(self.joining) + len(self.rebuilding)
            return {"rollout_replicas": float(held), "rollout_replicas_working": float(len(self.live)),
                    **self.failures.stats(), **self.scaling.stats()}
