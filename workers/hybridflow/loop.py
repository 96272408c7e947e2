"""The training loop around the algorithm's program: evaluation before and after, checkpoints every saveFreq steps
(with the algorithm's own state), resume, progress lines, the step log and metrics; and `execute`, the job runner
that `hybridflow run` and `hybridflow driver` call once Ray is up."""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from hybridflow import checkpoint as ckpt
from hybridflow.controller.batch import Batch
from hybridflow.controller.step import AlgorithmState, Step, rollout_records, run_program
from hybridflow.controller.worker_group import resolve
from hybridflow.data.tasks import PromptStream, Sample
from hybridflow.metrics import JobMetrics
from hybridflow.setup import (
    Prepared,
    Task,
    Workers,
    build_workers,
    controller_scorers,
    cost_scores,
    prompt_batch,
    reward_scores,
)
from hybridflow.spec import RLHFJob, SpecError

log = logging.getLogger("hybridflow.loop")


CHECKPOINTED_ROLES = ("actor", "critic", "cost_critic")


@dataclass
class Evaluation:
    reward: float
    cost: float | None = None  # safe_rlhf: its cost rule or cost model


def evaluate(w: Workers, task: Task, samples: Sequence[Sample]) -> Evaluation:
    """Mean reward (and cost) of greedy responses to held-out prompts."""
    dp = w.roles["actor"].dp_size
    usable = samples[: len(samples) // dp * dp]
    out = resolve(w.roles["actor"].generate(prompt_batch(usable), greedy=True))
    if task.rule is None and task.text_reward is None:  # files scored by a reward model only: it judges
        reward = float(resolve(w.roles["reward"].compute_rm_scores(out))["rm_scores"].mean())
    else:
        reward = float(reward_scores(out, task)[0].mean())
    cost = None
    if task.cost_rule is not None:
        cost = float(cost_scores(out, task)[0].mean())
    elif "cost" in w.roles:
        cost = float(resolve(w.roles["cost"].compute_rm_scores(out))["rm_scores"].mean())
    return Evaluation(reward, cost)


def checkpoint_identity(job: RLHFJob, w: Workers) -> dict[str, Any]:
    """The job and the architecture of each checkpointed role's model (critics default to the actor's)."""
    m = job.spec.models
    sources = {"actor": m.actor, "critic": m.critic or m.actor, "cost_critic": m.critic or m.actor}
    models = {role: ckpt.model_architecture(sources[role]) for role in CHECKPOINTED_ROLES if role in w.roles}
    return ckpt.identity(job.metadata.name, job.metadata.namespace, models)


@dataclass
class SaveInFlight:
    """An asynchronous save the ranks are still writing: sealed by `complete_save` once every write is done."""
    step: int
    staging: Path
    trainer_state: dict[str, Any]
    ident: dict[str, Any]
    started: float


def _roles(w: Workers) -> list[str]:
    return [role for role in CHECKPOINTED_ROLES if role in w.roles]


def _merged(per_rank: Sequence[dict[str, str] | None]) -> dict[str, str]:
    return {name: digest for d in per_rank if d for name, digest in d.items()}


def save(job: RLHFJob, w: Workers, root: Path, step: int, stream: PromptStream, algorithm: AlgorithmState,
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
    with ckpt.writing(root, step, ident) as staging:
        digests: dict[str, str] = {}
        started: list[str] = []
        try:
            for role in _roles(w):
                r0 = time.perf_counter()
                started.append(role)
                digests |= _merged(w.roles[role].save_checkpoint(str(staging), asynchronous))
                if not asynchronous:
                    log.info("checkpoint step %d: %s written, %.1f MB in %.1fs", step, role,
                             ckpt.size_bytes(staging / role) / 1e6, time.perf_counter() - r0)
        except BaseException:
            if asynchronous:  # the roles already writing finish before their directory is removed
                _collect(w, started[:-1])
            raise
        if asynchronous:
            return SaveInFlight(step, staging, state, ident, t0)
        return ckpt.seal(root, staging, step, state, job.spec.trainer.keep_checkpoints, ident, digests)


def _collect(w: Workers, roles: Sequence[str]) -> dict[str, str]:
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


def save_written(w: Workers) -> bool:
    """Whether every rank has finished writing (never blocks)."""
    return all(all(w.roles[role].checkpoint_written()) for role in _roles(w))


def complete_save(job: RLHFJob, w: Workers, root: Path, pending: SaveInFlight) -> Path:
    """Wait for an asynchronous save's writes and seal it; a failed write removes the checkpoint, like a failed
    synchronous save."""
    with ckpt.writing(root, pending.step, staging=pending.staging):
        digests = _collect(w, _roles(w))
        return ckpt.seal(root, pending.staging, pending.step, pending.trainer_state,
                         job.spec.trainer.keep_checkpoints, pending.ident, digests)


def resume_point(job: RLHFJob | None, root: Path) -> tuple[Path, dict[str, Any], bool] | None:
    """The checkpoint to resume from: this job's newest intact one, else `trainer.resumeFrom` (a step_* directory
    or another job's checkpointDir); the flag says whether it is another job's."""
    found = ckpt.latest_good(root)
    if found is not None:
        return (*found, False)
    source = job.spec.trainer.resume_from if job is not None else None
    if not source:
        return None
    where = ckpt.storage_path(source)
    if not (where / ckpt.MANIFEST).is_file() and not ckpt.list_checkpoints(where):
        # names no checkpoint at all: bad input that no restart mends (exit 2, which the operator does not retry)
        raise SpecError(f"spec.trainer.resumeFrom: {source} holds no checkpoint; name the old job's checkpointDir "
                        f"or one of its step_* directories")
    found = ckpt.checkpoint_at(where)  # a checkpoint that cannot be read (now) is a failure, retried
    if found is None:
        raise ckpt.CheckpointError(f"spec.trainer.resumeFrom: {source} holds no intact checkpoint; name a step_* "
                                   f"directory or a checkpointDir with one")
    return (*found, True)


def restore(w: Workers, root: Path, algorithm: AlgorithmState, data_fingerprint: str | None = None,
            job: RLHFJob | None = None) -> tuple[int, int]:
    """(step, data position) of the checkpoint loaded, or (0, 0) for a fresh start. With `job`, a checkpoint of
    another job or of an incompatible model is refused (CheckpointError) before any weights are read; a
    `trainer.resumeFrom` checkpoint may be another job's, but its model must fit."""
    found = resume_point(job, root)
    if found is None:
        return 0, 0
    path, state, other_job = found
    if job is not None:
        ckpt.check_compatible(path, checkpoint_identity(job, w), other_job_ok=other_job)
    if data_fingerprint != state.get("data_fingerprint", data_fingerprint):
        log.warning("the training prompts differ from the ones %s was trained on (files or their settings changed): "
                    "continuing at position %d of the new prompt order", path, state["data_position"])
    t0 = time.perf_counter()
    for role in _roles(w):
        w.roles[role].load_checkpoint(str(path))
    loaded = time.perf_counter() - t0
    algorithm.load(state.get("algorithm", {}))
    w.roles["actor"].sync_rollout_weights()
    dropped = ckpt.rewind_step_log(root, state["step"])
    ckpt.rewind_rollouts(root, state["step"])  # trainer.rolloutLog: the redone steps write theirs again
    if not other_job and state.get("step_record"):
        logged = ckpt.read_step_log(root)
        if not logged or logged[-1].get("step") != state["step"]:  # killed between the seal and the log line
            ckpt.append_step_log(root, {**state["step_record"], "checkpoint": str(path)})
            log.info("step %d's log record, lost to the interruption, restored from its checkpoint", state["step"])
    size = ckpt.size_bytes(path)
    log.info("resumed from %s (step %d, %.1f MB loaded in %.1fs, %.0f MB/s); %d logged step(s) after it will be "
             "redone", path, state["step"], size / 1e6, loaded, size / 1e6 / max(loaded, 1e-9), dropped)
    return int(state["step"]), int(state["data_position"])


def run_iteration(job: RLHFJob, w: Workers, task: Task, prompts: Batch, algorithm: AlgorithmState | None = None,
                  next_prompts: Callable[[], Batch] | None = None,
                  trained: Callable[[Batch], None] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """One step of the job's algorithm: (statistics, seconds per stage). `trained`, when given, gets the batch the
    actor trained on (with its advantages), after the step."""
    def no_more() -> Batch:
        raise RuntimeError("this iteration was given no prompt source for dynamic sampling")

    state = algorithm or AlgorithmState.for_spec(job.spec)
    step = Step(job.spec, w.roles, w.pools, controller_scorers(task), state, next_prompts or no_more)
    out = run_program(job.spec, step, prompts)
    if trained is not None and step.trained is not None:
        trained(step.trained)
    return out


@dataclass
class RunSummary:
    steps_done: int
    start_step: int
    eval_before: Evaluation | None
    eval_after: Evaluation | None
    seconds: float
    mean_throughput: float
    records: list[dict[str, Any]]


def fit(
    job: RLHFJob,
    w: Workers,
    task: Task,
    metrics: JobMetrics,
    progress: Callable[[str], None] = print,
) -> RunSummary:
    s = job.spec
    root = ckpt.open_root(s.trainer.checkpoint_dir)
    algorithm = AlgorithmState.for_spec(s)
    if ckpt.remove_unsealed(root):
        log.info("removed the unsealed checkpoint(s) of a save that was interrupted")
    start_step, position = (restore(w, root, algorithm, task.data_fingerprint, job) if s.trainer.resume == "auto"
                            else (0, 0))
    stream = PromptStream(task.train, s.trainer.prompts_per_step, s.data.seed, position)
    uids = iter(range(10**12))

    def next_prompts() -> Batch:  # fresh group ids: dynamic sampling draws several batches in one step
        samples = stream.next_batch()
        return prompt_batch(samples, uid_offset=next(uids) * len(samples))
    metrics.total_steps.labels(metrics.job).set(s.trainer.steps)
    metrics.devices.labels(metrics.job).set(w.devices)
    metrics.parameters.labels(metrics.job).set(w.roles["actor"].num_parameters())
    metrics.step.labels(metrics.job).set(start_step)
    # 0: none yet (also after a resumeFrom: that checkpoint is another job's, not in this job's checkpointDir)
    metrics.checkpoint_step.labels(metrics.job).set(start_step if ckpt.list_checkpoints(root) else 0)

    eval_before = None
    if s.trainer.eval and start_step == 0:
        eval_before = evaluate(w, task, task.eval)
        metrics.eval_reward.labels(metrics.job, "before").set(eval_before.reward)
        progress(f"held-out reward before training: {eval_before.reward:.3f} ({len(task.eval)} prompts, greedy)"
                 + (f", cost {eval_before.cost:.3f}" if eval_before.cost is not None else ""))
    t_start = time.perf_counter()
    records = []
    in_flight: SaveInFlight | None = None

    def sealed(step: int, saved: Path, started: float, stats: dict[str, Any]) -> Path:
        size, secs = ckpt.size_bytes(saved), time.perf_counter() - started
        log.info("checkpoint step %d sealed: %s, %.1f MB in %.1fs (%.0f MB/s)", step, saved, size / 1e6, secs,
                 size / 1e6 / max(secs, 1e-9))
        stats["checkpoint_bytes"], stats["checkpoint_step"], stats["checkpoint_write_seconds"] = size, step, secs
        metrics.checkpoint_step.labels(metrics.job).set(step)
        return saved

    def seal_in_flight(stats: dict[str, Any]) -> Path:
        nonlocal in_flight
        pending, in_flight = in_flight, None
        assert pending is not None
        return sealed(pending.step, complete_save(job, w, root, pending), pending.started, stats)

    for step in range(start_step + 1, s.trainer.steps + 1):
        t0 = time.perf_counter()
        trained: list[Batch] = []
        stats, stages = run_iteration(job, w, task, next_prompts(), algorithm, next_prompts,
                                      trained.append if s.trainer.rollout_log else None)
        if trained:  # before the step's checkpoint: a step that is sealed has its samples written
            ckpt.write_rollouts(root, step, rollout_records(trained[0], task.decode))
        saved = None
        if in_flight is not None and save_written(w):  # sealed as soon as written: a crash then loses less
            saved = seal_in_flight(stats)
        if (s.trainer.save_freq and step % s.trainer.save_freq == 0) or step == s.trainer.steps:
            c0 = time.perf_counter()  # the time training waits for checkpointing this step
            if in_flight is not None:  # one save in flight at a time
                saved = seal_in_flight(stats)
            so_far = {"step": step, **stats, "stages": dict(stages), "time": time.time()}
            started = save(job, w, root, step, stream, algorithm, task.data_fingerprint, s.trainer.async_save,
                           so_far)
            if isinstance(started, SaveInFlight):
                in_flight = started
                if step == s.trainer.steps:  # the last one: nothing left to overlap it with
                    saved = seal_in_flight(stats)
            else:
                saved = sealed(step, started, c0, stats)
            stages["checkpoint"] = time.perf_counter() - c0
        it = time.perf_counter() - t0
        done = step - start_step
        eta = (time.perf_counter() - t_start) / done * (s.trainer.steps - step)
        rec = {
            "step": step,
            **stats,
            "iteration_seconds": it,
            "throughput_tokens_per_s": stats["tokens"] / it,
            "throughput_per_device": stats["tokens"] / it / w.devices,
            "generation_tokens_per_s": stats["response_tokens"] / max(stages["generate"], 1e-9),
            "eta_seconds": eta,
            "stages": stages,
            "checkpoint": str(saved) if saved else None,
            "time": time.time(),
        }
        ckpt.append_step_log(root, rec)
        metrics.record_step(rec, stages)
        records.append(rec)
        progress(progress_line(rec, s.trainer.steps))
    eval_after = None
    if s.trainer.eval:
        eval_after = evaluate(w, task, task.eval)
        metrics.eval_reward.labels(metrics.job, "after").set(eval_after.reward)
        progress(f"held-out reward after training: {eval_after.reward:.3f}"
                 + (f", cost {eval_after.cost:.3f}" if eval_after.cost is not None else ""))
    secs = time.perf_counter() - t_start
    tput = float(np.mean([r["throughput_tokens_per_s"] for r in records])) if records else 0.0
    return RunSummary(len(records), start_step, eval_before, eval_after, secs, tput, records)


def progress_line(rec: dict[str, Any], total: int) -> str:
    st = rec["stages"]
    eta = rec["eta_seconds"]
    parts = [
        f"step {rec['step']}/{total}",
        f"reward {rec['reward_mean']:.3f}",
        f"{rec['throughput_tokens_per_s']:.0f} tok/s",
        f"gen {st.get('generate', 0):.2f}s",
        f"train {sum(v for k, v in st.items() if k.endswith('_update')):.2f}s",
        f"reshard {st.get('reshard', 0):.2f}s",
        f"ETA {int(eta // 60)}m{int(eta % 60):02d}s" if math.isfinite(eta) else "ETA ?",
    ]
    if "cost_mean" in rec:
        parts.insert(2, f"cost {rec['cost_mean']:.3f} (lambda {rec['lagrange_multiplier']:.2f})")
    if rec.get("checkpoint"):  # sealed this step; an asynchronous save seals a step it began earlier
        parts.append(f"saved step {rec.get('checkpoint_step', rec['step'])}")
    return " | ".join(parts)


def execute(job: RLHFJob, prepared: Prepared, progress: bool = True) -> int:
    s = job.spec
    say = print if progress else (lambda *_: None)
    metrics = JobMetrics(job.metadata.name)
    if s.metrics.port:
        port = metrics.serve(s.metrics.port, s.metrics.address)
        say(f"metrics: http://{s.metrics.address}:{port}/metrics")
    t0 = time.perf_counter()
    workers = build_workers(job, prepared.model_dir, prepared.task, prepared.critic_dir, prepared.rm_dir,
                            prepared.cost_dir)
    say(f"workers ready in {time.perf_counter() - t0:.1f}s: {workers.devices} devices, "
        + "; ".join(f"pool {g.pool.name}: {', '.join(g.roles)}" for g in workers.groups))
    try:
        summary = fit(job, workers, prepared.task, metrics, progress=say)
    finally:
        workers.shutdown()
    say(
        f"done: {summary.steps_done} steps (from step {summary.start_step}) in {summary.seconds:.1f}s, "
        f"mean {summary.mean_throughput:.0f} tokens/s"
    )
    before, after = summary.eval_before, summary.eval_after
    if before is not None and after is not None:
        say(f"held-out reward: before {before.reward:.3f} -> after {after.reward:.3f}")
        if before.cost is not None and after.cost is not None:
            say(f"held-out cost: before {before.cost:.3f} -> after {after.cost:.3f} "
                f"(limit {s.algorithm.cost_limit:g})")
    summary_path = ckpt.storage_path(s.trainer.checkpoint_dir) / "summary.json"
    summary_path.write_text(json.dumps({
        "steps_done": summary.steps_done, "start_step": summary.start_step,
        "eval_before": before.reward if before else None, "eval_after": after.reward if after else None,
        "eval_cost_before": before.cost if before else None, "eval_cost_after": after.cost if after else None,
        "seconds": summary.seconds, "mean_tokens_per_s": summary.mean_throughput,
    }, indent=1))
    if s.metrics.port and s.metrics.linger_seconds:
        time.sleep(s.metrics.linger_seconds)  # the final step's values reach Prometheus before the exporter goes
    return 0
