"""The training loop around the algorithm's program: evaluation before and after, the steps with what follows each
(trainer.after_step: checkpoints with the algorithm's own state, the step log, metrics, trackers, progress), resume;
and `execute`, the job runner that `hybridflow run` and `hybridflow driver` call once Ray is up."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from hybridflow.checkpoint.checkpointer import Checkpointer, Resumed
from hybridflow.checkpoint.store import storage_path
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.after_step import RunClock, StepDone, after_step, track
from hybridflow.trainer.episodes import episode_failures
from hybridflow.trainer.generation.rollouts import Rollouts
from hybridflow.trainer.recovery import Recoveries
from hybridflow.trainer.tracking import Tracker, tracking
from hybridflow.trainer.step import AlgorithmState, Step, generation_rows, run_program, skipped_stages
from hybridflow.single_controller.failures import one_line
from hybridflow.single_controller.worker_group import resolve
from hybridflow.data.tasks import PromptStream, Sample
from hybridflow.metrics import JobMetrics, eval_scalars, step_scalars
from hybridflow.trainer.setup import Prepared, Workers, build_workers
from hybridflow.trainer.task import Reward, Task, prompt_batch
from hybridflow.api import RLHFJob
from hybridflow.roles.protocols import ActorRole
from hybridflow.sandbox_pool import SERVES_ANY, PoolClient, PoolError, pool_from_env

log = logging.getLogger("hybridflow.trainer.loop")


@dataclass
class Evaluation:
    reward: float
    cost: float | None = None  # safe_rlhf: its cost rule or cost model


def evaluate(w: Workers, reward: Reward, samples: Sequence[Sample]) -> Evaluation:
    """Mean reward (and cost) of greedy responses to held-out prompts."""
    rollout = w.rollout
    dp = rollout.dp_sizes["rollout"]
    usable = samples[: len(samples) // dp * dp]
    out = resolve(rollout.call.generate(prompt_batch(usable), greedy=True))
    failures = episode_failures(w.spec.rollout.agent, "the held-out evaluation")
    if failures is not None:  # an environment that fails every episode stops the job here, before training
        failures.add(out)
        failures.report()
    return Evaluation(*reward.held_out(out, w.roles))


def build_step(job: RLHFJob, w: Workers, task: Task, *, rollouts: Rollouts | None = None,
               algorithm: AlgorithmState | None = None, skipped: frozenset[str] | None = None) -> Step:
    """The Step the algorithm's program calls, built once for every iteration (`run_iteration` begins each).
    `rollouts`: where generations come from (fit's, for the job's rollout mode; default: generate the prompts each
    iteration is given); `algorithm`: what the algorithm carries from step to step (default: fresh); `skipped`: the
    stages it leaves out (default: `skipped_stages`). `fit` decides the last two once, before it resumes."""
    def no_more() -> Batch:
        raise RuntimeError("this iteration was given no prompt source for dynamic sampling")

    s = job.spec
    shape = functools.partial(generation_rows, n=s.rollout.responses_per_prompt)  # as Workers.rollouts shapes them
    source = rollouts or Rollouts(s, w.roles["rollout"], w.weights, no_more, shape)
    return Step(s, w.roles, w.pools, task.reward.scorers(w.roles), algorithm or AlgorithmState.for_spec(s), source,
                skipped_stages(s) if skipped is None else skipped)


def run_iteration(step: Step, prompts: Batch | None = None,
                  profiled: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """One iteration of the job's algorithm on `step`: (statistics, seconds per stage). `prompts` None: the
    iteration's prompts are its rollouts' next. `profiled`: its stages are profiled (spec.trainer.profileSteps)."""
    step.begin(profiled)
    prompts = step.next_prompts() if prompts is None else prompts
    return run_program(step.spec, step, prompts)


@dataclass
class RunSummary:
    steps_done: int
    start_step: int
    eval_before: Evaluation | None
    eval_after: Evaluation | None
    seconds: float
    mean_throughput: float
    records: list[dict[str, Any]]


def fit(job: RLHFJob, w: Workers, task: Task, metrics: JobMetrics, progress: Callable[[str], None] = print,
        recoveries: Recoveries | None = None) -> RunSummary:
    """Resume (or start), evaluate, run the steps left, evaluate again. Each step runs the algorithm's program on
    fresh prompts; what follows it (trainer.after_step) writes the samples it trained on, lets the checkpointer save
    when it is due, and logs, exports, prints and tracks it."""
    s = job.spec
    algorithm, skipped = AlgorithmState.for_spec(s), skipped_stages(s)  # decided once, before anything runs
    checkpoints = Checkpointer(job, w, algorithm, task.data_fingerprint,
                               on_sealed=metrics.checkpoint_step.labels(metrics.job).set)
    start = checkpoints.resume()
    stream = PromptStream(task.train, s.trainer.prompts_per_step, s.data.seed, start.position)
    _export_job_metrics(metrics, w, s.trainer.steps, start)
    records: list[dict[str, Any]] = []
    with tracking(job, start.step) as trackers:
        _track_resumed(trackers, metrics, start)
        held_out = _held_out(w, task, metrics, progress, trackers)
        eval_before = held_out("before", 0) if s.trainer.eval and start.step == 0 else None
        run = RunClock(time.perf_counter(), start.step, s.trainer.steps)
        # async: its producer starts generating now
        with contextlib.closing(w.rollouts(prompt_source(stream), task.stop_token_ids)) as rollouts:
            step = build_step(job, w, task, rollouts=rollouts, algorithm=algorithm, skipped=skipped)
            callbacks = after_step(job, checkpoints, rollouts=rollouts, stream=stream, decode=task.decode, run=run,
                                   devices=w.devices, metrics=metrics, progress=progress, recoveries=recoveries,
                                   trackers=trackers, records=records)
            for n in range(start.step + 1, s.trainer.steps + 1):
                done = _step(w, step, n)
                if n == start.step + 1:  # the gang has started: judged as a step from now (api.run_policy)
                    w.first_step_done()
                for callback in callbacks:
                    callback(done)
        w.weights.settle()  # a replica rebuilt after the last sync takes the final weights before it is evaluated
        eval_after = held_out("after", s.trainer.steps) if s.trainer.eval else None
    tput = float(np.mean([r["throughput_tokens_per_s"] for r in records])) if records else 0.0
    return RunSummary(len(records), start.step, eval_before, eval_after, time.perf_counter() - run.started, tput,
                      records)


def _step(w: Workers, step: Step, n: int) -> StepDone:
    """Step `n` of `fit`: the algorithm's program on the rollouts' next prompts."""
    t0 = time.perf_counter()
    profiled = n in step.spec.trainer.profile_steps
    step.rollouts.start_step(last=n == step.spec.trainer.steps, profiled=profiled)
    stats, stages = run_iteration(step, profiled=profiled)
    if w.rollout_apart:  # what each side of an overlapped step spent waiting for the other
        it = time.perf_counter() - t0
        stats.update(trainer_idle_fraction=min(1.0, stats.get("trainer_wait_seconds", 0.0) / it),
                     rollout_idle_fraction=max(0.0, 1.0 - stats.get("rollout_busy_seconds", 0.0) / it))
    return StepDone(n, stats, stages, step.trained, t0)


def _track_resumed(trackers: Sequence[Tracker], metrics: JobMetrics, start: Resumed) -> None:
    """The resumed step again: a tracker opened here dropped what came from it on."""
    if start.step:
        track(trackers, start.step, lambda: step_scalars(metrics.job, record) if (record := start.logged()) else {})


def _held_out(w: Workers, task: Task, metrics: JobMetrics, progress: Callable[[str], None],
              trackers: Sequence[Tracker]) -> Callable[[str, int], Evaluation]:
    """`evaluate` on the held-out prompts `when` ("before" or "after") training, exported, printed and tracked (at
    step `at`)."""
    def held_out(when: str, at: int) -> Evaluation:
        result = evaluate(w, task.reward, task.eval)
        metrics.eval_reward.labels(metrics.job, when).set(result.reward)
        detail = f" ({len(task.eval)} prompts, greedy)" if when == "before" else ""
        progress(f"held-out reward {when} training: {result.reward:.3f}{detail}"
                 + (f", cost {result.cost:.3f}" if result.cost is not None else ""))
        track(trackers, at, lambda: eval_scalars(metrics, when))
        return result
    return held_out


def prompt_source(stream: PromptStream) -> Callable[[], Batch]:
    """The next batch of training prompts, with fresh group ids each time: dynamic sampling draws several batches
    in one step, and group ids must not repeat."""
    uids = iter(range(10**12))

    def next_prompts() -> Batch:
        samples = stream.next_batch()
        return prompt_batch(samples, uid_offset=next(uids) * len(samples))
    return next_prompts


def _export_job_metrics(metrics: JobMetrics, w: Workers, steps: int, start: Resumed) -> None:
    """What the job is (steps, devices, parameters) and where it starts, before its first step."""
    metrics.total_steps.labels(metrics.job).set(steps)
    metrics.devices.labels(metrics.job).set(w.devices)
    metrics.parameters.labels(metrics.job).set(w.roles["actor"].typed(ActorRole).call.num_parameters())
    metrics.step.labels(metrics.job).set(start.step)
    # 0: none yet (also after a resumeFrom: that checkpoint is another job's, not in this job's checkpointDir)
    metrics.checkpoint_step.labels(metrics.job).set(start.step if start.own else 0)


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
