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

The pool also changes size while the job runs (issue 29, item 3; `follow`). Each pod of the pool holds a slot (its
index: api.pool_slot_resource). A slot that appears in the Ray cluster and holds no replica of ours (a pod added by
`kubectl scale`, or one made again after its predecessor left) is grown into: its replicas are built and join as a
rebuilt one does, weights checked first. A pod given notice (scale-down, eviction, drain, preemption) says so
through single_controller.membership: its replicas stop taking work, finish the calls they are in, and are ended;
nothing they made is lost and nothing is rebuilt for them. The pool never grows past `most` slots.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import ray

from hybridflow.api import pool_slot_resource
from hybridflow.api.run_policy import RunPolicy
from hybridflow.single_controller.failures import is_worker_loss, one_line
from hybridflow.single_controller.membership import Leaving
from hybridflow.single_controller.worker_group import RoleHandle, WorkerGroup

log = logging.getLogger("hybridflow.trainer.replicas")

REPLICA_BUILD_TIMEOUT_S = 600.0
"""How long a lost replica's rebuild may take: on Kubernetes the operator's replacement pod must be scheduled, pull
its image, join Ray and build its engine. Past it the rebuild is an error (the job recovers as a whole)."""
FOLLOW_INTERVAL_S = 2.0  # how often the pool's slots and the pods leaving it are looked at


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


class RolloutReplicas:
    """The replicas of a rollout pool of its own, as the controller sees them: `live` take work; `joining` were
    rebuilt and take the current weights at the next sync before they take work; the rest are being rebuilt.
    Thread-safe: the async producer loses replicas, the trainer's sync lets them join."""

    def __init__(self, group: WorkerGroup, role: RoleHandle, policy: RunPolicy | None, build_timeout_s: float,
                 most: int | None = None, membership: Any = None) -> None:
        """`most`: the slots (pods) the pool may hold (default: those it starts with); `membership`: the job's
        single_controller.membership actor, which `follow` reads the pods leaving from."""
        self.group, self.role, self.build_timeout_s = group, role, build_timeout_s
        self.replaceable = policy is not None and policy.restart_policy == "failedPod" and group.independent
        self.limit = policy.replacement_limit if policy is not None else 0
        self.most = most if most is not None else group.pool.nodes
        self.membership = membership
        self.live: list[int] = list(range(len(group.hosts)))
        self.joining: list[int] = []
        self.replacements: list[Replacement] = []
        self.added: list[Replacement] = []  # replicas of slots the pool grew into
        self.left: list[tuple[int, list[int]]] = []  # (slot, its ranks) of each pod that left
        self.error: BaseException | None = None  # a rebuild that failed: the producer raises it
        self._built = len(group.hosts)  # the role handle as built calls (and lays data out over) this many ranks
        self._rebuilding: set[int] = set()
        self._joining_for: dict[int, Replacement] = {}  # rank -> why it is being built or joins (its latest event)
        self._growing: set[int] = set()  # slots being grown into
        self._claims: collections.Counter[int] = collections.Counter()  # calls in flight per rank
        self._handled: set[Leaving] = set()  # pods leaving, seen
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stop_following = threading.Event()
        self._follower: threading.Thread | None = None

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
        """The rollout role on `ranks` (the role as built when they are the ranks it was built on, all there are)."""
        every = list(range(len(self.group.hosts)))
        return self.role if list(ranks) == every and len(every) == self._built else self.role.on(ranks)

    def claim(self, joining_too: bool = False) -> list[int]:
        """The replicas a call is about to use (those taking work; `joining_too`: the weight stream's members),
        held until `unclaim`: a replica whose pod leaves is ended only once no call holds it."""
        with self._cond:
            ranks = sorted(self.live + (self.joining if joining_too else []))
            self._claims.update(ranks)
            return ranks

    def unclaim(self, ranks: Sequence[int]) -> None:
        with self._cond:
            self._claims.subtract(ranks)
            self._cond.notify_all()

    @contextlib.contextmanager
    def claimed(self, joining_too: bool = False) -> Iterator[list[int]]:
        ranks = self.claim(joining_too)
        try:
            yield ranks
        finally:
            self.unclaim(ranks)

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
        self._rebuilding.add(rank)
        event = Replacement(rank, reason.splitlines()[0][:300], time.perf_counter())
        self.replacements.append(event)
        self._joining_for[rank] = event
        log.warning("rollout replica %d lost (%s): rebuilding it while the other replicas (%s) go on",
                    rank, event.reason, self.live or "none")
        self._start(self._rebuild, (event,), f"rebuild-rollout-{rank}")

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
            self._rebuilding.discard(event.rank)
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
                event = self._joining_for.pop(rank)
                event.joined_after = time.perf_counter() - event.lost_at
                done.append(event)
            self._cond.notify_all()
        for e in done:
            log.warning("rollout replica %d takes work %s, %.1f s after %s", e.rank,
                        "for the first time" if e.added else "again", e.joined_after,
                        "its pod joined" if e.added else "it was lost")
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
            held = len(self.live) + len(self.joining) + len(self._rebuilding)
            return {"rollout_replicas": float(held), "rollout_replicas_working": float(len(self.live)),
                    "rollout_replicas_replaced_total": float(len(self.replacements)),
                    "rollout_replicas_added_total": float(len(self.added)),
                    "rollout_replicas_left_total": float(sum(len(r) for _, r in self.left))}

    # -- the pool's size while the job runs ------------------------------------------------------------------

    def follow(self) -> None:
        """Start following the pool's slots and the pods leaving it (a slotted pool: the rollout pool of an async
        job), until `stop_following`."""
        if self.group.pool.slots is None or self._follower is not None:
            return
        self._stop_following.clear()
        self._follower = threading.Thread(target=self._follow, name="rollout-pool-follower", daemon=True)
        self._follower.start()

    def close(self) -> None:
        """No more following; the membership actor goes (a pod leaving after this stops at once)."""
        self.stop_following()
        if self.membership is not None:
            ray.kill(self.membership)
            self.membership = None

    def stop_following(self) -> None:
        self._stop_following.set()
        if self._follower is not None:
            self._follower.join(timeout=2 * FOLLOW_INTERVAL_S + 10)
            self._follower = None
        with self._cond:
            self._cond.notify_all()

    def _follow(self) -> None:
        while not self._stop_following.is_set():
            try:
                leaving = self._leaving_now()
                self._grow_into(self._free_slots(leaving))
            except Exception as err:  # noqa: BLE001 - Ray busy or restarting: looked at again next time
                log.warning("rollout pool %s: its slots could not be read (%s); trying again",
                            self.group.pool.name, one_line(err, 200))
            self._stop_following.wait(FOLLOW_INTERVAL_S)

    def _leaving_now(self) -> set[Leaving]:
        """The pods announced as leaving; those new since the last look have their replicas retired (threads)."""
        if self.membership is None:
            return set()
        leaving = {tuple(x) for x in ray.get(self.membership.leaving.remote(self.group.pool.name), timeout=30)}
        for slot, node in sorted(leaving - self._handled):
            if slot in self._growing:
                continue  # its replicas are being built: retired once they are (the next look), never left behind
            self._handled.add((slot, node))
            with self._cond:
                ranks = [r for r in self.live + self.joining if self.group.slot_of(r) == slot]
                for r in ranks:
                    (self.live if r in self.live else self.joining).remove(r)
                    self._joining_for.pop(r, None)
                self._cond.notify_all()
            log.warning("rollout pod %d of pool %s leaves: its replicas %s stop taking work and finish the calls "
                        "they are in", slot, self.group.pool.name, ranks or "(none)")
            self._start(self._retire, (slot, node, ranks), f"retire-rollout-{slot}")
        return leaving

    def _retire(self, slot: int, node: str, ranks: list[int]) -> None:
        deadline = time.monotonic() + self.build_timeout_s
        with self._cond:
            while any(self._claims[r] > 0 for r in ranks) and time.monotonic() < deadline:
                self._cond.wait(0.5)
        if ranks:
            self.group.retire(ranks)
        with self._cond:
            self.left.append((slot, ranks))
            self._cond.notify_all()
        ray.get(self.membership.release.remote(self.group.pool.name, slot, node), timeout=30)
        log.warning("rollout pod %d of pool %s released: replicas %s ended, %d working", slot,
                    self.group.pool.name, ranks or "(none)", len(self.live))

    def _free_slots(self, leaving: set[Leaving]) -> list[int]:
        """Slots some live Ray node holds, not leaving, that no replica of ours is in: a pod added to the pool, or
        made again after its predecessor left (a lost pod's replacement holds a slot whose replicas are rebuilt)."""
        pattern = re.compile(re.escape(pool_slot_resource(self.group.pool.name, 0))[:-1] + r"(\d+)$")
        gone = {node for _, node in leaving}
        there = {int(m.group(1)) for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in gone
                 for key in n.get("Resources", {}) if (m := pattern.match(key))}
        with self._cond:
            return sorted(there - self._held_slots() - self._growing)

    def _grow_into(self, slots: list[int]) -> None:
        for slot in slots:
            with self._cond:
                if len(self._held_slots()) + len(self._growing) >= self.most:
                    return
                self._growing.add(slot)
            self._start(self._grow, (slot, time.perf_counter()), f"grow-rollout-{slot}")

    def _held_slots(self) -> set[int | None]:
        """Holding the lock: the slots our replicas are in (working, joining, being rebuilt)."""
        return {self.group.slot_of(r) for r in [*self.live, *self.joining, *self._rebuilding]}

    def _grow(self, slot: int, seen_at: float) -> None:
        try:
            ranks = self.group.grow(slot, self.build_timeout_s)
        except Exception as err:  # noqa: BLE001 - the pod went again before its replicas were built: not an error
            with self._cond:
                self._growing.discard(slot)
            log.warning("rollout pool %s: pod %d's replicas could not be built (%s); the pool stays as it is",
                        self.group.pool.name, slot, one_line(err, 300))
            return
        with self._cond:  # joining and no longer growing at once: the slot is never seen free in between
            self._growing.discard(slot)
            for r in ranks:
                event = Replacement(r, f"pod {slot} joined the pool", seen_at, self.group.where[r], added=True)
                self.added.append(event)
                self._joining_for[r] = event
            self.joining += ranks
            self._cond.notify_all()
        log.warning("rollout pool %s grew into pod %d: replicas %s take the current weights at the next sync",
                    self.group.pool.name, slot, ranks)

    def _start(self, target: Any, args: tuple, name: str) -> None:
        """A background thread of ours (a rebuild, a growth, a retirement), which `settle` waits for."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._cond:
            self._threads.append(thread)
        thread.start()
