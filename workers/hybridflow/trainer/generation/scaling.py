"""The replicas' scaling policy: the rollout pool changes size while the job runs (issue 29, item 3; `follow`).

Each pod of the pool holds a slot (its index: api.pool_slot_resource). A slot that appears in the Ray cluster and
holds no replica of ours (a pod added by `kubectl scale`, or one made again after its predecessor left) is grown
into: its replicas are built and join as a rebuilt one does, weights checked first (trainer.generation.replicas).
A pod given notice (scale-down, eviction, drain, preemption) says so through single_controller.membership: its
replicas stop taking work, finish the calls they are in, and are ended; nothing they made is lost and nothing is
rebuilt for them. The pool never grows past `most` slots."""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import ray

from hybridflow.api import pool_slot_resource
from hybridflow.single_controller.failures import one_line
from hybridflow.single_controller.membership import Leaving
from hybridflow.trainer.generation.replicas import Replacement, RolloutReplicas

log = logging.getLogger("hybridflow.trainer.replicas")

FOLLOW_INTERVAL_S = 2.0  # how often the pool's slots and the pods leaving it are looked at


class ElasticScaling:
    """Grow the replicas into new pods and let a pod given notice leave, while `follow`ing (a slotted pool: the
    rollout pool of an async job). `most`: the slots (pods) the pool may hold (default: those it starts with);
    `membership`: the job's single_controller.membership actor, which the pods leaving are read from."""

    def __init__(self, replicas: RolloutReplicas, most: int | None = None, membership: Any = None) -> None:
        self.replicas, self.group = replicas, replicas.group
        self.most = most if most is not None else self.group.pool.nodes
        self.membership = membership
        self.added: list[Replacement] = []  # replicas of slots the pool grew into
        self.left: list[tuple[int, list[int]]] = []  # (slot, its ranks) of each pod that left
        self._growing: set[int] = set()  # slots being grown into
        self._handled: set[Leaving] = set()  # pods leaving, seen
        self._stop_following = threading.Event()
        self._follower: threading.Thread | None = None

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
        with self.replicas.cond:
            self.replicas.cond.notify_all()

    def stats(self) -> dict[str, float]:
        return {"rollout_replicas_added_total": float(len(self.added)),
                "rollout_replicas_left_total": float(sum(len(r) for _, r in self.left))}

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
        r = self.replicas
        leaving = {tuple(x) for x in ray.get(self.membership.leaving.remote(self.group.pool.name), timeout=30)}
        for slot, node in sorted(leaving - self._handled):
            if slot in self._growing:
                continue  # its replicas are being built: retired once they are (the next look), never left behind
            self._handled.add((slot, node))
            with r.cond:
                ranks = [rank for rank in r.live + r.joining if self.group.slot_of(rank) == slot]
                r.leave(ranks)
                r.cond.notify_all()
            log.warning("rollout pod %d of pool %s leaves: its replicas %s stop taking work and finish the calls "
                        "they are in", slot, self.group.pool.name, ranks or "(none)")
            r.start(self._retire, (slot, node, ranks), f"retire-rollout-{slot}")
        return leaving

    def _retire(self, slot: int, node: str, ranks: list[int]) -> None:
        r = self.replicas
        r.wait_unclaimed(ranks, r.build_timeout_s)
        if ranks:
            self.group.retire(ranks)
        with r.cond:
            self.left.append((slot, ranks))
            r.cond.notify_all()
        ray.get(self.membership.release.remote(self.group.pool.name, slot, node), timeout=30)
        log.warning("rollout pod %d of pool %s released: replicas %s ended, %d working", slot,
                    self.group.pool.name, ranks or "(none)", len(r.live))

    def _free_slots(self, leaving: set[Leaving]) -> list[int]:
        """Slots some live Ray node holds, not leaving, that no replica of ours is in: a pod added to the pool, or
        made again after its predecessor left (a lost pod's replacement holds a slot whose replicas are rebuilt)."""
        pattern = re.compile(re.escape(pool_slot_resource(self.group.pool.name, 0))[:-1] + r"(\d+)$")
        gone = {node for _, node in leaving}
        there = {int(m.group(1)) for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in gone
                 for key in n.get("Resources", {}) if (m := pattern.match(key))}
        with self.replicas.cond:
            return sorted(there - self.replicas.held_slots() - self._growing)

    def _grow_into(self, slots: list[int]) -> None:
        for slot in slots:
            with self.replicas.cond:
                if len(self.replicas.held_slots()) + len(self._growing) >= self.most:
                    return
                self._growing.add(slot)
            self.replicas.start(self._grow, (slot, time.perf_counter()), f"grow-rollout-{slot}")

    def _grow(self, slot: int, seen_at: float) -> None:
        r = self.replicas
        try:
            ranks = self.group.grow(slot, r.build_timeout_s)
        except Exception as err:  # noqa: BLE001 - the pod went again before its replicas were built: not an error
            with r.cond:
                self._growing.discard(slot)
            log.warning("rollout pool %s: pod %d's replicas could not be built (%s); the pool stays as it is",
                        self.group.pool.name, slot, one_line(err, 300))
            return
        with r.cond:  # joining and no longer growing at once: the slot is never seen free in between
            self._growing.discard(slot)
            events = [Replacement(rank, f"pod {slot} joined the pool", seen_at, self.group.where[rank], added=True)
                      for rank in ranks]
            self.added += events
            r.built(ranks, events)
        log.warning("rollout pool %s grew into pod %d: replicas %s take the current weights at the next sync",
                    self.group.pool.name, slot, ranks)
