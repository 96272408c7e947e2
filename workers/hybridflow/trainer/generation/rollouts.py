"""Where a step's generations come from, one source per spec.rollout.mode (how the trainer's new weights reach
generation: trainer.generation.weight_sync).

* sync: the program's generate runs when it is called; the weights follow every update (HybridFlow as published).
* one_step_off: when a step's prompts are generated, the next step's are launched at once on the rollout pool, so
  they generate while this step trains (Ray runs one call at a time per rollout rank: the weight sync that ends
  the step queues behind that generation and lands before the one after). Every trained batch is one version old.
* async: a producer thread keeps the rollout pool generating into a trajectory queue of `queuePrompts` groups; a
  step takes promptsPerStep groups once they are ready, dropping (and counting) those whose oldest token is more
  than maxStaleness versions behind the trainer. With partialRolloutTokens, generations advance a chunk per engine
  call, so new weights land between chunks and the rest of a response comes from them (each token tagged).
  The producer calls only the replicas taking work: one that is lost is rebuilt alone while the others go on, and
  what it was generating is generated again; the pool grows and shrinks meanwhile, a replica leaving only once the
  call it is in has ended (trainer.generation.replicas).

Every generated batch carries `token_versions` (the policy version of each response token), which the step's
staleness statistics, the metrics and the rollout log (trainer.rolloutLog) read.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

import numpy as np

from hybridflow.api import JobSpec
from hybridflow.data.tasks import PromptStream
from hybridflow.profiling import GENERATION_PROFILE
from hybridflow.registry import Registry
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.worker_group import PendingResult, resolve, wait_done
from hybridflow.trainer.generation.replicas import RolloutReplicas
from hybridflow.trainer.generation.weight_sync import WeightSync
from hybridflow.trainer.rows import prompt_groups
from hybridflow.trainer.generation.trajectories import (
    Trajectory, oldest_versions, pack_trajectories, staleness, too_stale,
)

Shape = Callable[[Batch], Batch]  # a step's prompts -> the rows generation gets (responsesPerPrompt each, greedy flags)


class Rollouts:
    """sync mode, and what the other modes share: the weight sync (which keeps the trainer's policy version) and
    the step's staleness statistics. `shape` makes a step's generation rows from its prompts (used by a source
    that generates before the program asks); `rollout_ranks` is the rollout pool's size; `replicas`, for a rollout
    pool of its own, which of its replicas take work (async replaces a lost one alone: trainer.generation.replicas)."""

    def __init__(self, spec: JobSpec, rollout: Any, weights: WeightSync, prompts: Callable[[], Batch],
                 shape: Shape, rollout_ranks: int = 1, stop_token_ids: tuple[int, ...] = (),
                 replicas: RolloutReplicas | None = None) -> None:
        self.spec, self.rollout, self.weights, self._prompts = spec, rollout, weights, prompts
        self.shape, self.ranks, self.stop_ids = shape, rollout_ranks, stop_token_ids
        self.replicas = replicas
        self.stats: dict[str, float] = {}
        self.last_step = False
        self.rollout_busy = 0.0
        self.profiled = False

    @property
    def version(self) -> int:
        return self.weights.version

    def start_step(self, last: bool, profiled: bool = False) -> None:
        """A new step (`last`: the job's last; `profiled`: its weight sync is profiled, spec.trainer.profileSteps)."""
        self.stats, self.last_step, self.rollout_busy, self.profiled = {}, last, 0.0, profiled

    def next_prompts(self) -> Batch:
        return self._prompts()

    def generate(self, prompts: Batch, shape: Shape) -> Any:
        return self.rollout.generate(shape(prompts))

    def sync(self) -> dict[str, float]:
        return self.weights.sync(self.version + 1, self.profiled)

    def data_position(self, stream: PromptStream) -> int:
        """The stream's position less the batches drawn and not trained yet (generated ahead): what a checkpoint
        records, so a resumed job trains them."""
        return stream.position

    def trained(self, batch: Batch) -> None:
        """The batch the actor is about to train on (the trainer's version is `self.version`; each token carries
        the version that made it, `token_versions`, tagged by the rank that generated it): its staleness into the
        step's statistics and the batch's meta (the rollout log writes them)."""
        self.rollout_busy += float(batch.meta.get("generate_seconds", 0.0))
        self.stats.update(batch.meta.get(GENERATION_PROFILE, {}))  # one rank's (the last), where it was profiled
        ages = [staleness(self.version, int(v)) for v in oldest_versions(batch)]
        batch.meta.update(trainer_version=self.version, staleness=ages)
        self.stats.update(staleness_mean=float(np.mean(ages)), staleness_max=float(max(ages)))

    def step_stats(self) -> dict[str, float]:
        return {**self.stats, "rollout_busy_seconds": self.rollout_busy}

    def close(self) -> None:
        pass


class OneStepOffRollouts(Rollouts):
    """Each step's prompts were launched during the step before; generating them launches the next ones."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ahead: tuple[Batch, PendingResult] | None = None

    def next_prompts(self) -> Batch:
        return self.ahead[0] if self.ahead is not None else self._prompts()

    def generate(self, prompts: Batch, shape: Shape) -> Any:
        if self.ahead is not None and self.ahead[0] is prompts:
            out, self.ahead = self.ahead[1], None
        else:
            out = self.rollout.generate(shape(prompts))
        if not self.last_step:  # the next prompts generate with these weights while this batch trains
            following = self._prompts()
            self.ahead = (following, self.rollout.generate(shape(following)))
        return out

    def sync(self) -> dict[str, float]:
        """After the generation in flight: the stream's timeout then bounds the transfer alone (a long generation
        is not a stalled peer), and the trainer's wait for it is idle time."""
        if self.ahead is not None:
            t0 = time.perf_counter()
            wait_done(self.ahead[1])
            self.stats["trainer_wait_seconds"] = self.stats.get("trainer_wait_seconds", 0.0) + time.perf_counter() - t0
        return super().sync()

    def data_position(self, stream: PromptStream) -> int:
        return stream.position - int(self.ahead is not None)


class AsyncRollouts(Rollouts):
    """A producer thread generating into a bounded queue of finished groups; steps take them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        r = self.spec.rollout
        self.group_size, self.per_step = r.responses_per_prompt, self.spec.trainer.prompts_per_step
        self.capacity = r.queue_prompts or 2 * self.per_step
        self.ready: collections.deque[Batch] = collections.deque()  # finished groups, oldest first
        self.in_flight = 0  # groups drawn and not finished
        self.dropped = 0
        self._dropped_reported = 0
        self._taken: Batch | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._busy_total = 0.0
        self._active: list[list[Trajectory]] = []  # partial rollouts: groups whose responses are in the making
        self._returned: collections.deque[Batch] = collections.deque()  # drawn, their replica lost: generate again
        self.regenerated = 0  # prompt groups handed back by a lost replica
        self._calling = False  # an engine call of the producer's is in flight
        self._syncing = False  # the trainer waits to sync: the producer starts no call meanwhile
        produce = self._produce_partial if r.partial_rollout_tokens else self._produce_whole
        self._thread = threading.Thread(target=self._run, args=(produce,), name="rollout-producer", daemon=True)
        self._thread.start()
        if self.replicas is not None:  # the pool grows and shrinks while the job runs (trainer.generation.replicas)
            self.replicas.scaling.follow()

    # -- the trainer's side ----------------------------------------------------------------------------------

    def next_prompts(self) -> Batch:
        t0 = time.perf_counter()
        while (groups := self._take()) is None:  # short of a step: rebuilt replicas join now, not at the sync
            self._between_calls(self.weights.admit)
        waited = time.perf_counter() - t0
        self.stats["trainer_wait_seconds"] = self.stats.get("trainer_wait_seconds", 0.0) + waited
        self._taken = Batch.concat(groups)
        self._taken.meta["generate_seconds"] = waited
        return self._taken

    def _take(self) -> list[Batch] | None:
        """A step's groups once the queue has them; None after a while without (the trainer may act meanwhile)."""
        with self._cond:
            for _ in range(10):
                if self._error is not None:
                    raise RuntimeError(f"rollout generation failed: {self._error}") from self._error
                self._drop_stale()
                if len(self.ready) >= self.per_step:
                    groups = [self.ready.popleft() for _ in range(self.per_step)]
                    self._cond.notify_all()
                    return groups
                self._cond.wait(0.5)
        return None

    def generate(self, prompts: Batch, shape: Shape) -> Any:
        if prompts is not self._taken:
            raise RuntimeError("async rollouts generate the prompts they hand out (next_prompts) only")
        return prompts

    def _drop_stale(self) -> None:
        kept = collections.deque(g for g in self.ready if not too_stale(
            self.version, int(oldest_versions(g).min()), self.spec.rollout.max_staleness))
        self.dropped += len(self.ready) - len(kept)
        if len(kept) < len(self.ready):  # room in the queue: a producer waiting for it starts now, not at its
            self._cond.notify_all()      # next poll (the trainer would wait that poll out too)
        self.ready = kept

    def sync(self) -> dict[str, float]:
        """Between two engine calls of the producer (it starts none while the trainer waits here), so the stream's
        timeout bounds the transfer alone and the new weights make the producer's next call."""
        return self._between_calls(super().sync, waiting_counts=True)

    def _between_calls(self, act: Callable[[], dict[str, float]], waiting_counts: bool = False) -> dict[str, float]:
        """`act` (a weight sync) once the producer's engine call in flight has ended, none starting meanwhile."""
        t0 = time.perf_counter()
        with self._cond:
            self._syncing = True
            while self._calling and self._error is None:
                self._cond.wait(0.5)
        if waiting_counts:  # (next_prompts counts its own wait, this one included)
            self.stats["trainer_wait_seconds"] = self.stats.get("trainer_wait_seconds", 0.0) + time.perf_counter() - t0
        try:
            if self.replicas is not None:  # one that died idle leaves the set before the stream is formed over it
                self.replicas.failures.check()
            out = act()
            for key in ("replica_recovery_seconds", "replica_join_seconds"):
                if key in out:
                    self.stats[key] = out[key]
            return out
        finally:
            with self._cond:
                self._syncing = False
                self._cond.notify_all()

    def data_position(self, stream: PromptStream) -> int:
        with self._cond:  # the producer draws under it: position and what is held agree
            return stream.position - (len(self.ready) + self.in_flight) // self.per_step

    def step_stats(self) -> dict[str, float]:
        with self._cond:
            depth = len(self.ready)
            busy, self._busy_total = self._busy_total, 0.0
        dropped, self._dropped_reported = self.dropped - self._dropped_reported, self.dropped
        replicas = self.replicas.stats() if self.replicas is not None else {}
        return {**self.stats, "queue_depth": float(depth), "dropped_stale": float(dropped),
                "dropped_stale_total": float(self.dropped), "rollout_busy_seconds": busy,
                "regenerated_prompts_total": float(self.regenerated), **replicas}

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.scaling.stop_following()
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=self.spec.rollout.weight_sync_timeout_seconds)

    # -- the producer's side ---------------------------------------------------------------------------------

    def _run(self, produce: Callable[[], None]) -> None:
        try:
            while not self._stop.is_set():
                produce()
        except BaseException as e:  # the trainer raises it at its next take
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _room(self) -> int:
        """Groups the queue can still take in (finished + in flight below capacity); waits while it is full."""
        with self._cond:
            while not self._stop.is_set() and len(self.ready) + self.in_flight >= self.capacity:
                self._cond.wait(0.5)
            return 0 if self._stop.is_set() else self.capacity - len(self.ready) - self.in_flight

    def _call(self, launch: Callable[[Any, int], PendingResult]) -> Any | None:
        """One engine call on the replicas taking work, `launch(role on them, how many)`, started only while the
        trainer is not waiting to sync: the call's result, or None when it was not made (stopping) or a replica
        was lost during it (trainer.generation.replicas rebuilds it; the caller hands back what the call was for)."""
        while True:
            if self.replicas is not None:
                self.replicas.wait_working(self._stop)
            with self._cond:
                while self._syncing and not self._stop.is_set():
                    self._cond.wait(0.5)
                if self._stop.is_set():
                    return None
                ranks = self.replicas.claim() if self.replicas is not None else list(range(self.ranks))
                if ranks:
                    self._calling = True
                    break
        pending: PendingResult | None = None
        try:
            role = self.replicas.handle(ranks) if self.replicas is not None else self.rollout
            pending = launch(role, len(ranks))
            return resolve(pending)
        except Exception as err:
            if self.replicas is None or pending is None or not self.replicas.failures.lost_in(
                    err, pending.refs, pending.timeout_s or self.spec.rollout.weight_sync_timeout_seconds):
                raise
            return None
        finally:
            if self.replicas is not None:
                self.replicas.unclaim(ranks)
            with self._cond:
                self._calling = False
                self._cond.notify_all()

    def _finished(self, groups: list[Batch], seconds: float) -> None:
        with self._cond:
            self.ready.extend(groups)
            self.in_flight -= len(groups)
            self._busy_total += seconds
            self._cond.notify_all()

    def _draw(self) -> Batch:
        """The next prompts: those a lost replica handed back first (still counted in flight), else the stream's."""
        with self._cond:
            if self._returned:
                return self._returned.popleft()
            prompts = self._prompts()
            self.in_flight += len(prompts)
        return prompts

    def _hand_back(self, prompts: Batch) -> None:
        with self._cond:
            self._returned.append(prompts)
            self.regenerated += len(prompts)

    def _produce_whole(self) -> None:
        """A batch of prompts per engine call, each response generated whole by the weights it began with."""
        if not self._room():
            return
        prompts = self._draw()
        rows = self.shape(prompts)
        out = self._call(lambda role, k: role.generate(_padded_batch(rows, k)))
        if out is None:
            if not self._stop.is_set():  # a replica was lost: they are generated again
                self._hand_back(prompts)
            return
        # each prompt's rows (an agent program's episode may be several), the padding's left out (its uid < 0)
        self._finished(prompt_groups(out), float(out.meta.get("generate_seconds", 0.0)))

    def _produce_partial(self) -> None:
        """Partial rollouts: every call advances each unfinished response by at most partialRolloutTokens; weights
        that arrived since the last call make the next tokens."""
        r = self.spec.rollout
        active = self._active
        if self._room() and sum(1 for g in active for t in g if not t.done) < self.per_step * self.group_size:
            rows = self.shape(self._draw())
            for g in range(len(rows) // self.group_size):
                active.append([Trajectory({k: rows.non_tensors[k][i] for k in rows.non_tensors})
                               for i in range(g * self.group_size, (g + 1) * self.group_size)])
        todo = [t for g in active for t in g if not t.done]
        if not todo:
            time.sleep(0.05)
            return
        asked = [min(r.partial_rollout_tokens, r.max_response_length - len(t.tokens)) for t in todo]

        def launch(role: Any, ranks: int) -> PendingResult:
            rows = _padded(list(zip(todo, asked)), ranks)  # every rank gets rows; the padding's output is unused
            return role.continue_generation(Batch(non_tensors={
                "prompt_ids": [t.row["prompt_ids"] for t, _ in rows], "response_ids": [t.tokens for t, _ in rows],
                "greedy": [bool(t.row.get("greedy", False)) for t, _ in rows], "max_new": [n for _, n in rows]}))

        parts = self._call(launch)
        if parts is None:  # a replica was lost: nothing advanced, the next call goes to the others
            return
        tokens = [x for p in parts for x in p["tokens"]]
        log_probs = [x for p in parts for x in p["log_probs"]]
        versions = [p["policy_version"] for p in parts for _ in p["tokens"]]
        for t, toks, lps, v, n in zip(todo, tokens, log_probs, versions, asked):
            t.advance(toks, lps, v, n, r.max_response_length, self.stop_ids)
        done = [g for g in active if all(t.done for t in g)]
        for g in done:
            active.remove(g)
        groups = [pack_trajectories(g, r.max_prompt_length, r.max_response_length) for g in done]
        self._finished(groups, max(float(p["seconds"]) for p in parts))


def _padded(rows: list[Any], ranks: int) -> list[Any]:
    """`rows` repeated up to a multiple of `ranks` (the generation call splits evenly over the ranks)."""
    return (rows * ranks)[: len(rows) + (-len(rows) % ranks)]


def _padded_batch(rows: Batch, ranks: int) -> Batch:
    """`rows` with its first rows repeated up to a multiple of `ranks` (fewer replicas than the pool has: the
    prompts need not divide); the padding's output is left out by the caller: its uid is below 0 (trainer.rows)."""
    if not len(rows) % ranks:
        return rows
    out = rows.index(np.array(_padded(list(range(len(rows))), ranks)))
    if "uid" in out.non_tensors:
        out.non_tensors["uid"][len(rows):] = [-1 - i for i in range(len(out) - len(rows))]
    return out


# spec.rollout.mode -> its source (the schema lists the same names; tests/trainer/test_rollouts.py checks they agree)
ROLLOUT_MODES: Registry[type[Rollouts]] = Registry("rollout mode", plural="rollout modes")
ROLLOUT_MODES.add("sync", Rollouts)
ROLLOUT_MODES.add("one_step_off", OneStepOffRollouts)
ROLLOUT_MODES.add("async", AsyncRollouts)
