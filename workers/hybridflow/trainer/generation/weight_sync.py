"""How the trainer's new weights reach generation: one `WeightSync`, its kind picked by placement here
(`weight_sync`, the one place that picks): in memory beside the actor (`ColocatedWeightSync`, the 3D-HybridEngine:
engines.bridge.transfer inside each process), or streamed to a rollout pool of its own (`StreamedWeightSync`:
engines.bridge.stream between processes, over a group formed anew whenever its replicas change:
trainer.generation.replicas).

The two engine-side mechanisms stay apart below this: a transfer joins a training and a generation engine inside
one process, picked per pair of engine kinds, and hands tensors straight to the engine; the stream has two ends in
different processes (the actor's rank 0 sends, each replica receives), over a group that this controller forms and
forms again as replicas come and go, with versions and checksums. Neither is a kind of the other; the choice
between them is made once, here."""
from __future__ import annotations

from typing import Any, Mapping, Protocol

import numpy as np

from hybridflow.roles.protocols import ActorRole, ColocatedRolloutRole
from hybridflow.single_controller.worker_group import PendingResult, RoleHandle, resolve
from hybridflow.profiling import PREFIX, rank_means
from hybridflow.trainer.generation.replicas import Replacement, RolloutReplicas


class WeightSync(Protocol):
    version: int  # updates the trainer has made and generation holds (0: the initial weights)

    def sync(self, version: int, profile: bool = False) -> dict[str, float]:
        """The trainer's weights, as policy `version`, into every generation engine; the step's statistics.
        `profile`: the transition's seconds by kind of op too, where it runs in the trainer's processes."""

    def settle(self) -> None:
        """Every generation engine holds the trainer's latest weights (replicas rebuilt since the last sync take
        them now): before an evaluation that uses them all."""

    def admit(self) -> dict[str, float]:
        """Replicas rebuilt since the last sync take the current weights now (and then work); their statistics."""


class ColocatedWeightSync:
    """The rollout role beside the actor takes the weights in memory through the bridge (3D-HybridEngine)."""

    def __init__(self, rollout: ColocatedRolloutRole) -> None:
        self.rollout, self.version = rollout, 0

    def sync(self, version: int, profile: bool = False) -> dict[str, float]:
        per_rank = self.rollout.sync_weights(version, profile)
        self.version = version
        return {**rank_means(per_rank, PREFIX), "reshard_bytes": float(np.mean([x["bytes"] for x in per_rank])),
                "reshard_peak_bytes": float(max(x["peak_bytes"] for x in per_rank)),
                "generation_weight_bytes": float(max(x["generation_bytes"] for x in per_rank)),
                # generation's memory freed before the update (vLLM on GPU: sleep) and taken back by this sync
                # (wake), max over ranks
                "rollout_sleep_freed_bytes": float(max(x["sleep_freed_bytes"] for x in per_rank)),
                "rollout_wake_bytes": float(max(x["wake_bytes"] for x in per_rank))}

    def settle(self) -> None:
        pass

    def admit(self) -> dict[str, float]:
        return {}  # beside the actor: nothing is rebuilt alone


class StreamedWeightSync:
    """The actor's rank 0 streams whole tensors, in the generation dtype, to every rollout replica over a group of
    their own (engines.bridge.stream). The group is formed over the replicas present (trainer.generation.replicas),
    and formed again when that set changed since the last sync: a replica lost leaves it, a rebuilt one joins it,
    and the rebuilt one's weights are checked against the trainer's before it takes work. A sync that failed otherwise
    (the stream broke and aborted its group, every replica still there) leaves it to be formed again too."""

    def __init__(self, actor: ActorRole, replicas: RolloutReplicas, timeout_s: float) -> None:
        self.actor, self.replicas, self.version = actor, replicas, 0
        self.timeout_s = timeout_s
        self.dtype = replicas.role.call.generation_dtype_name()
        self.members: list[int] = []
        self._form(replicas.members())

    def _form(self, members: list[int]) -> None:
        t = self.timeout_s
        host, port = self.actor.open_weight_stream(1 + len(members), t)
        joining = [self.actor.join_weight_stream(members, t),
                   self.replicas.handle(members).call.join_weight_stream(host, port, members, t)]
        for pending in reversed(joining):
            resolve(pending)
        self.members = members

    def sync(self, version: int, profile: bool = False) -> dict[str, float]:
        """`profile` is not taken: the stream crosses processes of two pools, each side's time its own."""
        while True:
            with self.replicas.claimed(joining_too=True) as members:  # (a pod leaving waits for this sync to end)
                if not members:  # every replica lost: the rebuilt ones get this version when they join
                    self.version = version
                    return {"rollout_policy_version": float(version)}
                calls: list[PendingResult] = []
                try:
                    if members != self.members:
                        self._form(members)
                    calls = [self.actor.send_weights(version, self.dtype),
                             self.replicas.handle(members).call.sync_weights(version)]
                    got = resolve(calls[1])  # first: a receiver's error names the peer that did not answer
                    sent = resolve(calls[0])
                    joined = self._admit(members)
                    break
                except Exception as err:
                    if not self._replica_lost(err, calls):
                        # The stream broke with every replica still there (a stall, an NCCL error): each rank that
                        # saw it aborted its side of the group, so it is formed anew before the next sync, the path
                        # a lost replica takes; this sync's error stands (it names the peer, version and bucket).
                        self.members = []
                        raise
        self.version = version
        stats = {"reshard_bytes": float(np.mean([x["bytes"] for x in got])),
                 "reshard_peak_bytes": float(max(x["peak_bytes"] for x in [*got, *sent])),
                 "generation_weight_bytes": float(max(x["generation_bytes"] for x in got)),
                 "weight_sync_bytes": float(sum(x["bytes"] for x in got)),
                 "weight_sync_seconds": float(max(x["seconds"] for x in [*got, *sent])),
                 "rollout_policy_version": float(version)}
        for key, events in (("replica_recovery_seconds", [e for e in joined if not e.added]),
                            ("replica_join_seconds", [e for e in joined if e.added])):
            if events:
                stats[key] = max(e.joined_after or 0.0 for e in events)
        return stats

    def _replica_lost(self, err: BaseException, calls: list[PendingResult]) -> bool:
        """A sync (or the forming of its group) failed: whether it was for a replica lost during it (it leaves the
        replicas and is rebuilt; the sync is made again to the others, over a group formed anew), once every
        rank's part of it has ended (the sender closed the broken group, so receivers still waiting fail at once)."""
        refs = [ref for call in calls for ref in call.refs]
        if not self.replicas.failures.lost_in(err, refs, self.timeout_s + 10):
            return False
        self.members = []
        return True

    def admit(self) -> dict[str, float]:
        """Rebuilt replicas take the current weights now, not at the next sync (the trainer waits for
        trajectories and no generation is in flight: with no replica left working, none would come)."""
        return self.sync(self.version) if self.replicas.joining_now() else {}

    def _admit(self, members: list[int]) -> list[Replacement]:
        """The rebuilt replicas among `members`, which just received the weights: each takes work once its engine
        sums to the trainer's weights (cast to its dtype)."""
        joining = self.replicas.joining_now()
        new = [r for r in members if r in joining]
        if not new:
            return []
        trainer = self.actor.weight_checksums_as(self.dtype)[0]
        sums = self.replicas.handle(new).call.weight_checksums()
        return self.replicas.joined({r: got == trainer for r, got in zip(new, sums)})

    def settle(self) -> None:
        self.replicas.failures.check()  # one that died idle since the last sync is rebuilt too
        self.replicas.settle(self.timeout_s + self.replicas.build_timeout_s)
        if self.replicas.members() != self.members:  # the version they lack, over the group formed anew (its
            self.sync(self.version)                  # sender and receivers start fresh: the same version is new)


def weight_sync(roles: Mapping[str, RoleHandle[Any]], replicas: RolloutReplicas | None,
                timeout_s: float) -> WeightSync:
    """The job's WeightSync: streamed to the replicas of a rollout pool of its own (`replicas`), else in memory to
    the rollout role beside the actor. `timeout_s`: spec.rollout.weightSyncTimeoutSeconds (a stream's)."""
    if replicas is None:
        return ColocatedWeightSync(roles["rollout"].typed(ColocatedRolloutRole).call)
    return StreamedWeightSync(roles["actor"].typed(ActorRole).call, replicas, timeout_s)
