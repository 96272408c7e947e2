"""The training loop around the algorithm's program: evaluation before and after, checkpoints every saveFreq steps
(with the algorithm's own state), resume, progress lines, the step log and metrics; and `execute`, the job runner
that `hybridflow run` and `hybridflow driver` call once Ray is up."""
from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from hybridflow.checkpoint.checkpointer import Checkpointer
from hybridflow.checkpoint.store import storage_path
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.episodes import episode_failures
from hybridflow.trainer.recovery import Recoveries
from hybridflow.trainer.rollouts import Rollouts
from hybridflow.trainer.tracking import Tracker, close_trackers, open_trackers
from hybridflow.trainer.step import AlgorithmState, Step, generation_rows, rollout_records, run_program
from hybridflow.single_controller.failures import one_line
from hybridflow.single_controller.worker_group import resolve
from hybridflow.data.tasks import PromptStream, Sample
from hybridflow.metrics import JobMetrics, eval_scalars, step_scalars
from hybridflow.trainer.setup import (
    Prepared,
    Task,
    Workers,
    build_workers,
    controller_scorers,
    cost_scores,
    prompt_batch,
    reward_scores,
)
from hybridflow.api import RLHFJob
from hybridflow.sandbox_pool import SERVES_ANY, PoolClient, PoolError, pool_from_env

log = logging.getLogger("hybridflow.trainer.loop")


@dataclass
class Evaluation:
    reward: float
    cost: float | None = None  # safe_rlhf: its cost rule or cost model


def evaluate(w: Workers, task: Task, samples: Sequence[Sample]) -> Evaluation:
    """Mean reward (and cost) of greedy responses to held-out prompts."""
    rollout = w.rollout
    dp = rollout.dp_sizes["rollout"]
    usable = samples[: len(samples) // dp * dp]
    out = resolve(rollout.generate(prompt_batch(usable), greedy=True))
    failures = episode_failures(w.spec.rollout.agent, "the held-out evaluation")
    if failures is not None:  # an environment that fails every episode stops the job here, before training
        failures.add(out)
        failures.report()
    if task.rule is None and task.text_reward is None and task.episode_score in (None, "reward"):  # a model judges
        reward = float(resolve(w.roles["reward"].compute_rm_scores(out))["rm_scores"].mean())
    else:
        reward = float(reward_scores(out, task)[0].mean())
    cost = None
    if task.cost_rule is not None:
        cost = float(cost_scores(out, task)[0].mean())
    elif "cost" in w.roles:
        cost = float(resolve(w.roles["cost"].compute_rm_scores(out))["rm_scores"].mean())
    return Evaluation(reward, cost)


def run_iteration(job: RLHFJob, w: Workers, task: Task, prompts: Batch | None, algorithm: AlgorithmState | None = None,
                  next_prompts: Callable[[], Batch] | None = None,
                  trained: Callable[[Batch], None] | None = None,
                  rollouts: Rollouts | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """One step of the job's algorithm: (statistics, seconds per stage). `rollouts`: where generations come from
    (fit's, for the job's rollout mode; default: generate when asked, with `next_prompts` for dynamic sampling);
    `prompts` None: the step's prompts are the rollouts' next. `trained`, when given, gets the batch the actor
    trained on (with its advantages), after the step."""
    def no_more() -> Batch:
        raise RuntimeError("this iteration was given no prompt source for dynamic sampling")

    state = algorithm or AlgorithmState.for_spec(job.spec)
    source = rollouts or Rollouts(job.spec, w.roles["rollout"], w.weights, next_prompts or no_more,
                                  functools.partial(generation_rows, n=job.spec.rollout.responses_per_prompt))
    step = Step(job.spec, w.roles, w.pools, controller_scorers(task), state, source)
    out = run_program(job.spec, step, source.next_prompts() if prompts is None else prompts)
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
    recoveries: Recoveries | None = None,
) -> RunSummary:
    """Resume (or start), evaluate, run the steps left, evaluate again. Each step runs the algorithm's program on
    fresh prompts, writes the samples it trained on (trainer.rolloutLog), lets the checkpointer save when it is
    due, and is logged, exported and printed."""
    s = job.spec
    algorithm = AlgorithmState.for_spec(s)
    checkpoints = Checkpointer(job, w, algorithm, task.data_fingerprint,
                               on_sealed=metrics.checkpoint_step.labels(metrics.job).set)
    start_step, position = checkpoints.resume()
    stream = PromptStream(task.train, s.trainer.prompts_per_step, s.data.seed, position)
    _export_job_metrics(metrics, w, s.trainer.steps, start_step, checkpoints.has_own())
    run_eval = s.trainer.eval and start_step == 0
    trackers, finished = open_trackers(job, start_step), False
    try:
        if start_step and trackers:  # the resumed step again: a tracker opened here dropped what came from it on
            resumed = [r for r in checkpoints.step_log() if r["step"] == start_step]
            _track(trackers, start_step, lambda: step_scalars(metrics.job, resumed[-1]) if resumed else {})
        eval_before = _evaluate_and_report(w, task, metrics, progress, "before") if run_eval else None
        if eval_before is not None:
            _track(trackers, 0, lambda: eval_scalars(metrics, "before"))
        t_start = time.perf_counter()
        records = []
        rollouts = w.rollouts(prompt_source(stream), task.stop_token_ids)  # async: its producer starts generating
        try:
            for step in range(start_step + 1, s.trainer.steps + 1):
                records.append(_fit_step(job, w, task, metrics, progress, checkpoints, algorithm, rollouts, stream,
                                         step, (t_start, start_step), recoveries))
                _track(trackers, step, lambda: step_scalars(metrics.job, records[-1]))
        finally:
            rollouts.close()
        w.weights.settle()  # a replica rebuilt after the last sync takes the final weights before it is evaluated
        eval_after = _evaluate_and_report(w, task, metrics, progress, "after") if s.trainer.eval else None
        if eval_after is not None:
            _track(trackers, s.trainer.steps, lambda: eval_scalars(metrics, "after"))
        finished = True
    finally:
        close_trackers(trackers, finished)
    secs = time.perf_counter() - t_start
    tput = float(np.mean([r["throughput_tokens_per_s"] for r in records])) if records else 0.0
    return RunSummary(len(records), start_step, eval_before, eval_after, secs, tput, records)


def _track(trackers: Sequence[Tracker], step: int, scalars: Callable[[], dict[str, float]]) -> None:
    """`scalars` is computed only when a tracker is on (a job without one builds no per-step registry)."""
    if trackers:
        values = scalars()
        for tracker in trackers:
            tracker.log(step, values)


def _fit_step(job: RLHFJob, w: Workers, task: Task, metrics: JobMetrics, progress: Callable[[str], None],
              checkpoints: Checkpointer, algorithm: AlgorithmState, rollouts: Rollouts, stream: PromptStream,
              step: int, started: tuple[float, int], recoveries: Recoveries | None = None) -> dict[str, Any]:
    """One step of `fit`: the program, its rollout log, the checkpointer, the step record everywhere (the first
    after an in-place recovery carries how long the recovery took)."""
    s = job.spec
    t0 = time.perf_counter()
    trained: list[Batch] = []
    rollouts.start_step(last=step == s.trainer.steps)
    stats, stages = run_iteration(job, w, task, None, algorithm, None,
                                  trained.append if s.trainer.rollout_log else None, rollouts)
    if w.rollout_apart:  # what each side of an overlapped step spent waiting for the other
        it = time.perf_counter() - t0
        stats.update(trainer_idle_fraction=min(1.0, stats.get("trainer_wait_seconds", 0.0) / it),
                     rollout_idle_fraction=max(0.0, 1.0 - stats.get("rollout_busy_seconds", 0.0) / it))
    if trained:  # before the step's checkpoint: a step that is sealed has its samples written
        checkpoints.write_rollouts(step, rollout_records(trained[0], task.decode))
    saved = checkpoints.save_step(step, DataPosition(rollouts.data_position(stream)), stats, stages)
    rec = _step_record(step, stats, stages, saved, t0, (*started, s.trainer.steps), w.devices)
    recovered = recoveries.step_logged() if recoveries is not None else None
    if recovered is not None:
        rec["recovery_seconds"] = recovered
    checkpoints.log_step(rec)
    metrics.record_step(rec, stages)
    progress(progress_line(rec, s.trainer.steps))
    return rec


@dataclass
class DataPosition:
    """A checkpoint's data position (checkpointer.Position): the prompts trained so far, not those drawn ahead."""

    position: int


def prompt_source(stream: PromptStream) -> Callable[[], Batch]:
    """The next batch of training prompts, with fresh group ids each time: dynamic sampling draws several batches
    in one step, and group ids must not repeat."""
    uids = iter(range(10**12))

    def next_prompts() -> Batch:
        samples = stream.next_batch()
        return prompt_batch(samples, uid_offset=next(uids) * len(samples))
    return next_prompts


def _export_job_metrics(metrics: JobMetrics, w: Workers, steps: int, start_step: int, has_checkpoint: bool) -> None:
    """What the job is (steps, devices, parameters) and where it starts, before its first step."""
    metrics.total_steps.labels(metrics.job).set(steps)
    metrics.devices.labels(metrics.job).set(w.devices)
    metrics.parameters.labels(metrics.job).set(w.roles["actor"].num_parameters())
    metrics.step.labels(metrics.job).set(start_step)
    # 0: none yet (also after a resumeFrom: that checkpoint is another job's, not in this job's checkpointDir)
    metrics.checkpoint_step.labels(metrics.job).set(start_step if has_checkpoint else 0)


def _report_sandbox_layers(metrics: JobMetrics, pool: PoolClient, every: float = 5.0, tries: int = 120) -> None:
    """Ask the sandbox pool's replicas which layers their sandboxes lack, until each has answered (they start with
    the gang, and may be up after the first step), and export and log them once: the operator makes them the job's
    SandboxPartial condition."""
    said: set[str] = set()
    for _ in range(tries):
        try:
            missing, answered = pool.missing_layers()
        except PoolError as err:  # its token refused: the job's first reward or tool call says so, and stops
            log.warning("asking the sandbox pool which layers it lacks: %s", err)
            return
        if new := {layer: why for layer, why in missing.items() if layer not in said}:
            for layer in new:
                metrics.sandbox_missing.labels(metrics.job, layer).set(1)
            log.warning("the sandbox pool runs the job's user code without %s (spec.sandbox.allowPartial)",
                        "; ".join(f"{layer} ({why})" for layer, why in sorted(new.items())))
            said |= set(new)
        if answered == len(pool.replicas):
            return
        time.sleep(every)


def _evaluate_and_report(w: Workers, task: Task, metrics: JobMetrics, progress: Callable[[str], None],
                         when: str) -> Evaluation:
    """`evaluate` on the held-out prompts `when` ("before" or "after") training, exported and printed."""
    result = evaluate(w, task, task.eval)
    metrics.eval_reward.labels(metrics.job, when).set(result.reward)
    detail = f" ({len(task.eval)} prompts, greedy)" if when == "before" else ""
    progress(f"held-out reward {when} training: {result.reward:.3f}{detail}"
             + (f", cost {result.cost:.3f}" if result.cost is not None else ""))
    return result


def _step_record(step: int, stats: dict[str, Any], stages: dict[str, float], saved: Path | None, started: float,
                 run: tuple[float, int, int], devices: int) -> dict[str, Any]:
    """A step's log record: its statistics, throughput, seconds per stage, the ETA and the checkpoint sealed.
    `run`: when the loop started, the step it started after and the last step (for the ETA)."""
    t_start, start_step, total = run
    it = time.perf_counter() - started
    eta = (time.perf_counter() - t_start) / (step - start_step) * (total - step)
    return {
        "step": step,
        **stats,
        "iteration_seconds": it,
        "throughput_tokens_per_s": stats["tokens"] / it,
        "throughput_per_device": stats["tokens"] / it / devices,
        "generation_tokens_per_s": stats["response_tokens"] / max(stages["generate"], 1e-9),
        "eta_seconds": eta,
        "stages": stages,
        "checkpoint": str(saved) if saved else None,
        "time": time.time(),
    }


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
    if "trainer_idle_fraction" in rec:  # rollout on a pool of its own: how far behind, and who waited
        queued = f", queue {rec['queue_depth']:.0f}" if "queue_depth" in rec else ""
        if rec.get("rollout_replicas_working", 0) < rec.get("rollout_replicas", 0):  # one lost, being rebuilt
            queued += f", replicas {rec['rollout_replicas_working']:.0f}/{rec['rollout_replicas']:.0f}"
        parts.insert(-1, f"stale {rec.get('staleness_max', 0):.0f}{queued} | idle trainer "
                         f"{rec['trainer_idle_fraction']:.0%} rollout {rec['rollout_idle_fraction']:.0%}")
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
    # on Kubernetes: which layers the sandbox pool's user code lacks
    if (pool := pool_from_env(SERVES_ANY)) is not None:
        # (once per driver: an in-place recovery below keeps the pool, and what was said of it)
        threading.Thread(target=_report_sandbox_layers, args=(metrics, pool), name="sandbox-layers",
                         daemon=True).start()
    recoveries = Recoveries(s.run_policy)
    while True:  # once, and again after each in-place recovery from a lost worker (trainer.recovery)
        workers = None
        try:
            t0 = time.perf_counter()
            workers = build_workers(job, prepared.model_dir, prepared.task, prepared.critic_dir, prepared.rm_dir,
                                    prepared.cost_dir)
            say(f"workers ready in {time.perf_counter() - t0:.1f}s: {workers.devices} devices, "
                + "; ".join(f"pool {g.pool.name}: {', '.join(g.roles)} "
                            f"({'/'.join(sorted(set(g.allocators())))} malloc)" for g in workers.groups))
            summary = fit(job, workers, prepared.task, metrics, progress=say, recoveries=recoveries)
            break
        except Exception as err:
            if not recoveries.recoverable(err):
                raise
            metrics.recoveries.labels(metrics.job).inc()
            say(f"worker lost ({recoveries.done}/{s.run_policy.replacement_limit} in-place recoveries): "
                f"{type(err).__name__}: {one_line(err)}; rebuilding the worker groups, resuming from the last "
                "checkpoint")
        finally:
            if workers is not None:
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
    summary_path = storage_path(s.trainer.checkpoint_dir) / "summary.json"
    summary_path.write_text(json.dumps({
        "steps_done": summary.steps_done, "start_step": summary.start_step,
        "eval_before": before.reward if before else None, "eval_after": after.reward if after else None,
        "eval_cost_before": before.cost if before else None, "eval_cost_after": after.cost if after else None,
        "seconds": summary.seconds, "mean_tokens_per_s": summary.mean_throughput,
    }, indent=1))
    if s.metrics.port and s.metrics.linger_seconds:
        time.sleep(s.metrics.linger_seconds)  # the final step's values reach Prometheus before the exporter goes
    return 0
