"""The controller's side of checkpointing: when a step is saved (a pure decision, `Checkpointer.after_step`),
saving every trained role's shards and sealing them (synchronously, or in the background while training goes on),
and resuming: this job's newest intact checkpoint, else `trainer.resumeFrom`, with the step log rewound to it.
Everything it writes goes through the job's `CheckpointRoot` (checkpoint.root). `fit` resumes through it, and its
after-step callbacks (trainer.after_step) drive it once per step; they know nothing else of checkpoints."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from hybridflow.checkpoint.identity import check_compatible, identity, model_architecture
from hybridflow.checkpoint.root import CheckpointRoot
from hybridflow.checkpoint.sealing import checkpoint_at
from hybridflow.checkpoint.store import (
    MANIFEST, CheckpointError, is_link, is_step_dir_name, link_refused, list_checkpoints, size_bytes, storage_path,
)
from hybridflow.api import RLHFJob, SpecError
from hybridflow.api.roles import trained_roles
from hybridflow.api.training import role_lora

log = logging.getLogger("hybridflow.checkpoint")

CHECKPOINTED_ROLES = trained_roles()  # those holding optimizer state (api.roles): actor, critic, cost_critic


class HasRoles(Protocol):
    """The job's workers as far as checkpoints go: role name -> its handle (setup.Workers)."""

    roles: Mapping[str, Any]

    def sync_weights(self, version: int) -> dict[str, float]:
        """The actor's weights into generation, as policy `version` (after loading a checkpoint: its step)."""


class CarriedState(Protocol):
    """The algorithm's state carried across steps (KL controller, Lagrangian): saved and loaded with the weights."""

    def state(self) -> dict[str, Any]: ...

    def load(self, state: dict[str, Any]) -> None: ...


class Position(Protocol):
    """Where the prompt stream is: a resumed job continues there."""

    position: int


def checkpoint_identity(job: RLHFJob, w: HasRoles) -> dict[str, Any]:
    """The job and the architecture of each checkpointed role's model (critics default to the actor's); with LoRA
    also the adapters' settings: such a checkpoint holds the adapters alone, which fit no other training."""
    m = job.spec.models
    sources = {"actor": m.actor, "critic": m.critic or m.actor, "cost_critic": m.critic or m.actor}
    models = {role: model_architecture(sources[role]) for role in CHECKPOINTED_ROLES if role in w.roles}
    for role in models:  # an adapter's weights load into no other shape of training
        lora = role_lora(role, job.spec.training)
        if lora is not None:  # what shapes and scales the saved adapters (dropout may change on resume)
            models[role]["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": lora.target_modules}
    return identity(job.metadata.name, job.metadata.namespace, models)


@dataclass
class SaveInFlight:
    """An asynchronous save the ranks are still writing: sealed by `complete_save` once every write is done."""
    step: int
    staging: Path
    trainer_state: dict[str, Any]
    ident: dict[str, Any]
    started: float


def _roles(w: HasRoles) -> list[str]:
    """The trained roles this job has (the others are rebuilt from their sources: nothing to save)."""
    return [role for role in CHECKPOINTED_ROLES if role in w.roles]


def _merged(per_rank: Sequence[dict[str, str] | None]) -> dict[str, str]:
    """One {file: sha256} of the ranks' own (each rank hashes the files it wrote)."""
    return {name: digest for d in per_rank if d for name, digest in d.items()}


def save(job: RLHFJob, w: HasRoles, root: CheckpointRoot, step: int, stream: Position, algorithm: CarriedState,
         data_fingerprint: str | None = None, asynchronous: bool = False,
         record: dict[str, Any] | None = None) -> Path | SaveInFlight:
    """Checkpoint `step`: every rank writes its shards of every trained role. Synchronous: returns the sealed
    checkpoint. Asynchronous: returns once the ranks hold a host copy of their state, as a SaveInFlight for
    `complete_save`. A failed save (full disk) removes what it wrote and keeps the previous checkpoints.

    `record` (the step's log record so far) travels in the checkpoint: a job killed after the seal but before its
    step log got the record gets it back on resume, so the log still lists every step once."""
    ident = checkpoint_identity(job, w)
    state = {"data_position": stream.position, "data_fingerprint": data_fingerprint, "algorithm": algorithm.state(),
             "step_record": record}
    t0 = time.perf_counter()
    with root.writing(step, ident) as staging:
        digests: dict[str, str] = {}
        started: list[str] = []
        try:
            for role in _roles(w):
                r0 = time.perf_counter()
                started.append(role)
                digests |= _merged(w.roles[role].save_checkpoint(str(staging), asynchronous))
                if not asynchronous:
                    log.info("checkpoint step %d: %s written, %.1f MB in %.1fs", step, role,
                             size_bytes(staging / role) / 1e6, time.perf_counter() - r0)
        except BaseException:
            if asynchronous:  # the roles already writing finish before their directory is removed
                _collect(w, started[:-1])
            raise
        if asynchronous:
            return SaveInFlight(step, staging, state, ident, t0)
        return root.seal(staging, step, state, job.spec.trainer.keep_checkpoints, ident, digests)


def _collect(w: HasRoles, roles: Sequence[str]) -> dict[str, str]:
    """Wait for every role's asynchronous write, all of them even when one fails (so none still writes into a
    directory being removed); their digests, or the first failure."""
    digests: dict[str, str] = {}
    failures: list[BaseException] = []
    for role in roles:
        try:
            digests |= _merged(w.roles[role].finish_checkpoint())
        except Exception as err:  # noqa: BLE001 - re-raised below, after the other roles are collected
            failures.append(err)
    if failures:
        raise failures[0]
    return digests


def save_written(w: HasRoles) -> bool:
    """Whether every rank has finished writing (never blocks)."""
    return all(all(w.roles[role].checkpoint_written()) for role in _roles(w))


def complete_save(job: RLHFJob, w: HasRoles, root: CheckpointRoot, pending: SaveInFlight) -> Path:
    """Wait for an asynchronous save's writes and seal it; a failed write removes the checkpoint, like a failed
    synchronous save."""
    with root.writing(pending.step, staging=pending.staging):
        digests = _collect(w, _roles(w))
        return root.seal(pending.staging, pending.step, pending.trainer_state, job.spec.trainer.keep_checkpoints,
                         pending.ident, digests)


def resume_point(job: RLHFJob | None, root: CheckpointRoot) -> tuple[Path, dict[str, Any], bool] | None:
    """The checkpoint to resume from: this job's newest intact one, else `trainer.resumeFrom` (a step_* directory
    or another job's checkpointDir); the flag says whether it is another job's."""
    found = root.latest_good()
    if found is not None:
        return (*found, False)
    source = job.spec.trainer.resume_from if job is not None else None
    if not source:
        return None
    where = storage_path(source)
    if is_link(where) and is_step_dir_name(where.name):  # never followed, even to nothing (store.open_below)
        raise CheckpointError(f"spec.trainer.resumeFrom: {link_refused(where)}")
    if not (where / MANIFEST).is_file() and not list_checkpoints(where):
        # names no checkpoint at all: bad input that no restart mends (exit 2, which the operator does not retry)
        raise SpecError(f"spec.trainer.resumeFrom: {source} holds no checkpoint; name the old job's checkpointDir "
                        f"or one of its step_* directories")
    found = checkpoint_at(where)  # a checkpoint that cannot be read (now) is a failure, retried
    if found is None:
        raise CheckpointError(f"spec.trainer.resumeFrom: {source} holds no intact checkpoint; name a step_* "
                                   f"directory or a checkpointDir with one")
    return (*found, True)


def restore(w: HasRoles, root: CheckpointRoot, algorithm: CarriedState, data_fingerprint: str | None = None,
            job: RLHFJob | None = None) -> tuple[int, int]:
    """(step, data position) of the checkpoint loaded, or (0, 0) for a fresh start. With `job`, a checkpoint of
    another job or of an incompatible model is refused (CheckpointError) before any weights are read; a
    `trainer.resumeFrom` checkpoint may be another job's, but its model must fit."""
    found = resume_point(job, root)
    if found is None:  # from scratch: what an earlier attempt logged before its first checkpoint is redone too
        root.rewind(0)
        return 0, 0
    path, state, other_job = found
    if job is not None:
        check_compatible(path, checkpoint_identity(job, w), other_job_ok=other_job)
    if data_fingerprint != state.get("data_fingerprint", data_fingerprint):
        log.warning("the training prompts differ from the ones %s was trained on (files or their settings changed): "
                    "continuing at position %d of the new prompt order", path, state["data_position"])
    t0 = time.perf_counter()
    for role in _roles(w):
        w.roles[role].load_checkpoint(str(path))
    loaded = time.perf_counter() - t0
    algorithm.load(state.get("algorithm", {}))
    w.sync_weights(state["step"])
    dropped = root.rewind(state["step"])  # the redone steps log (and write their rollouts) again
    if not other_job and state.get("step_record"):
        logged = root.step_log()
        if not logged or logged[-1].get("step") != state["step"]:  # killed between the seal and the log line
            root.log_step({**state["step_record"], "checkpoint": str(path)})
            log.info("step %d's log record, lost to the interruption, restored from its checkpoint", state["step"])
    size = size_bytes(path)
    log.info("resumed from %s (step %d, %.1f MB loaded in %.1fs, %.0f MB/s); %d logged step(s) after it will be "
             "redone", path, state["step"], size / 1e6, loaded, size / 1e6 / max(loaded, 1e-9), dropped)
    return int(state["step"]), int(state["data_position"])


@dataclass(frozen=True)
class Resumed:
    """Where a job continues (`Checkpointer.resume`): after `step` (0: from the start), at the prompt stream's
    `position`; `own`: its checkpointDir holds a checkpoint of its own (a resumeFrom checkpoint is another job's);
    `logged()`: the resumed step's log record, if it was logged (trackers opened now log it again; read only then)."""

    step: int
    position: int
    own: bool
    logged: Callable[[], dict[str, Any] | None] = lambda: None


class Checkpointer:
    """One job's checkpoints, as `fit` uses them: `resume` once, then `save_step` after every step (which saves when
    `after_step` says so and seals an asynchronous save as soon as its writes are done), the step and rollout logs
    beside them. At most one asynchronous save is in flight."""

    def __init__(self, job: RLHFJob, w: HasRoles, algorithm: CarriedState, data_fingerprint: str | None = None,
                 on_sealed: Callable[[int], None] = lambda step: None) -> None:
        self.job, self.w, self.algorithm, self.data_fingerprint = job, w, algorithm, data_fingerprint
        self.root = CheckpointRoot.open(job.spec.trainer.checkpoint_dir)
        self.save_freq, self.steps = job.spec.trainer.save_freq, job.spec.trainer.steps
        self.on_sealed = on_sealed  # the step just sealed (the checkpoint-step metric)
        self.in_flight: SaveInFlight | None = None

    def after_step(self, step: int) -> bool:
        """Whether `step` is checkpointed: every saveFreq steps (0: none of them) and always the last one."""
        return bool(self.save_freq and step % self.save_freq == 0) or step == self.steps

    def resume(self) -> "Resumed":
        """Where to continue (step 0 at data position 0 for a fresh start or `resume: never`), with what the driver
        reports of it. Removes the unsealed leftovers of a save that was interrupted first."""
        if self.root.remove_unsealed():
            log.info("removed the unsealed checkpoint(s) of a save that was interrupted")
        step, position = 0, 0
        if self.job.spec.trainer.resume == "auto":
            step, position = restore(self.w, self.root, self.algorithm, self.data_fingerprint, self.job)
        return Resumed(step, position, self.has_own(), functools.partial(self._logged, step))

    def _logged(self, step: int) -> dict[str, Any] | None:
        """`step`'s record in the step log (the last one, after a repair), read only when a tracker asks for it."""
        logged = [r for r in self.step_log() if r.get("step") == step]
        return logged[-1] if logged else None

    def has_own(self) -> bool:
        """Whether this job's checkpointDir holds any checkpoint (a resumeFrom checkpoint is another job's)."""
        return bool(self.root.checkpoints())

    def write_rollouts(self, step: int, records: list[dict[str, Any]]) -> None:
        """`step`'s trained samples (trainer.rolloutLog); before the step's checkpoint, so a sealed step has them."""
        self.root.write_rollouts(step, records)

    def step_log(self) -> list[dict[str, Any]]:
        """The step records logged so far (after resume(): repaired, each step once)."""
        return self.root.step_log()

    def log_step(self, record: dict[str, Any]) -> None:
        """Append the step's record to the step log (after its checkpoint, which carries it in case of a crash)."""
        self.root.log_step(record)

    def save_step(self, step: int, stream: Position, stats: dict[str, Any], stages: dict[str, float]) -> Path | None:
        """After `step`: the checkpoint sealed now, if any (an asynchronous one may be of an earlier step). Adds the
        sealed checkpoint's size, step and write time to `stats`, and the time training waited to `stages`."""
        saved = None
        if self.in_flight is not None and save_written(self.w):  # sealed as soon as written: a crash then loses less
            saved = self._seal_in_flight(stats)
        if not self.after_step(step):
            return saved
        c0 = time.perf_counter()  # the time training waits for checkpointing this step
        if self.in_flight is not None:  # one save in flight at a time
            saved = self._seal_in_flight(stats)
        so_far = {"step": step, **stats, "stages": dict(stages), "time": time.time()}
        started = save(self.job, self.w, self.root, step, stream, self.algorithm, self.data_fingerprint,
                       self.job.spec.trainer.async_save, so_far)
        if isinstance(started, SaveInFlight):
            self.in_flight = started
            if step == self.steps:  # the last one: nothing left to overlap it with
                saved = self._seal_in_flight(stats)
        else:
            saved = self._sealed(step, started, c0, stats)
        stages["checkpoint"] = time.perf_counter() - c0
        return saved

    def _sealed(self, step: int, saved: Path, started: float, stats: dict[str, Any]) -> Path:
        """Report a sealed checkpoint: logged, added to the step's statistics, the checkpoint-step metric."""
        size, secs = size_bytes(saved), time.perf_counter() - started
        log.info("checkpoint step %d sealed: %s, %.1f MB in %.1fs (%.0f MB/s)", step, saved, size / 1e6, secs,
                 size / 1e6 / max(secs, 1e-9))
        stats["checkpoint_bytes"], stats["checkpoint_step"], stats["checkpoint_write_seconds"] = size, step, secs
        self.on_sealed(step)
        return saved

    def _seal_in_flight(self, stats: dict[str, Any]) -> Path:
        """Wait for the asynchronous save's writes and seal it."""
        pending, self.in_flight = self.in_flight, None
        assert pending is not None
        return self._sealed(pending.step, complete_save(self.job, self.w, self.root, pending), pending.started, stats)
