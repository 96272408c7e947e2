"""What happens after each step of `fit`, as a list of callbacks each given the step just done (`StepDone`), in
order: the samples it trained on (trainer.rolloutLog), its checkpoint when one is due, its log record (with the ETA
and, after an in-place recovery, how long the recovery took), the step log, the metrics, the progress line, the run's
records and the trackers. `after_step` makes the job's list."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from hybridflow.api import RLHFJob
from hybridflow.checkpoint.checkpointer import Checkpointer
from hybridflow.data.tasks import PromptStream
from hybridflow.metrics import JobMetrics, step_scalars
from hybridflow.profiling import profile_report
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.generation.rollouts import Rollouts
from hybridflow.trainer.recovery import Recoveries
from hybridflow.trainer.step import rollout_records
from hybridflow.trainer.task import Decode
from hybridflow.trainer.tracking import Tracker


@dataclass
class StepDone:
    """One step of `fit`, as its callbacks see it (each may add what the ones after it read: `saved`, `record`)."""

    step: int
    stats: dict[str, Any]
    stages: dict[str, float]
    trained: Batch | None  # the batch the actor trained on, with its advantages
    started: float  # perf_counter when the step began
    saved: Path | None = None  # the checkpoint sealed after it, if any
    record: dict[str, Any] = field(default_factory=dict)  # its step log record


AfterStep = Callable[[StepDone], None]


@dataclass
class RunClock:
    """When the loop started, the step it started after and the last step (for the ETA)."""

    started: float
    start_step: int
    total: int


@dataclass
class DataPosition:
    """A checkpoint's data position (checkpointer.Position): the prompts trained so far, not those drawn ahead."""

    position: int


def after_step(job: RLHFJob, checkpoints: Checkpointer, *, rollouts: Rollouts, stream: PromptStream,
               decode: Decode | None, run: RunClock, devices: int, metrics: JobMetrics,
               progress: Callable[[str], None], recoveries: Recoveries | None, trackers: Sequence[Tracker],
               records: list[dict[str, Any]]) -> list[AfterStep]:
    """The job's callbacks after each step, in the order they run."""
    return [
        *([write_rollouts(checkpoints, decode)] if job.spec.trainer.rollout_log else []),
        save_checkpoint(checkpoints, rollouts, stream),  # after the rollouts: a step that is sealed has its samples
        make_record(run, devices, recoveries),
        lambda done: checkpoints.log_step(done.record),  # after its checkpoint, which carries it in case of a crash
        lambda done: metrics.record_step(done.record, done.stages),
        lambda done: progress(progress_line(done.record, run.total)),
        report_profile(progress),
        lambda done: records.append(done.record),
        lambda done: track(trackers, done.step, lambda: step_scalars(metrics.job, done.record)),
    ]


def report_profile(progress: Callable[[str], None]) -> AfterStep:
    """A profiled step's tables (spec.trainer.profileSteps), after its progress line; nothing for other steps."""
    def report(done: StepDone) -> None:
        text = profile_report(done.record)
        if text:
            progress(f"step {done.step} profiled:\n{text}")
    return report


def write_rollouts(checkpoints: Checkpointer, decode: Decode | None) -> AfterStep:
    """The samples the step trained on (trainer.rolloutLog), beside the checkpoints."""
    def write(done: StepDone) -> None:
        if done.trained is not None:
            checkpoints.write_rollouts(done.step, rollout_records(done.trained, decode))
    return write


def save_checkpoint(checkpoints: Checkpointer, rollouts: Rollouts, stream: PromptStream) -> AfterStep:
    """The checkpointer after the step (it saves when one is due, and seals an asynchronous save once written)."""
    def save(done: StepDone) -> None:
        position = DataPosition(rollouts.data_position(stream))
        done.saved = checkpoints.save_step(done.step, position, done.stats, done.stages)
    return save


def make_record(run: RunClock, devices: int, recoveries: Recoveries | None) -> AfterStep:
    """The step's log record; the first after an in-place recovery carries how long the recovery took."""
    def record(done: StepDone) -> None:
        done.record = step_record(done, run, devices)
        recovered = recoveries.step_logged() if recoveries is not None else None
        if recovered is not None:
            done.record["recovery_seconds"] = recovered
    return record


def track(trackers: Sequence[Tracker], step: int, scalars: Callable[[], dict[str, float]]) -> None:
    """`scalars` is computed only when a tracker is on (a job without one builds no per-step registry)."""
    if trackers:
        values = scalars()
        for tracker in trackers:
            tracker.log(step, values)


def step_record(done: StepDone, run: RunClock, devices: int) -> dict[str, Any]:
    """A step's log record: its statistics, throughput, seconds per stage, the ETA and the checkpoint sealed."""
    stats, stages, step = done.stats, done.stages, done.step
    it = time.perf_counter() - done.started
    eta = (time.perf_counter() - run.started) / (step - run.start_step) * (run.total - step)
    return {
        "step": step,
        **stats,
        "iteration_seconds": it,
        "throughput_tokens_per_s": stats["tokens"] / it,
        "throughput_per_device": stats["tokens"] / it / devices,
        "generation_tokens_per_s": stats["response_tokens"] / max(stages["generate"], 1e-9),
        "eta_seconds": eta,
        "stages": stages,
        "checkpoint": str(done.saved) if done.saved else None,
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
    if "judge_requests" in rec:  # a generative judge: what it cost, and how often it agrees with the task's rule
        agrees = f", agrees with the rule {rec['judge_rule_agreement']:.0%}" if "judge_rule_agreement" in rec else ""
        parts.insert(3, f"judge {rec.get('judge_seconds', 0):.2f}s{agrees}")
    if "trainer_idle_fraction" in rec:  # rollout on a pool of its own: how far behind, and who waited
        queued = f", queue {rec['queue_depth']:.0f}" if "queue_depth" in rec else ""
        if rec.get("rollout_replicas_working", 0) < rec.get("rollout_replicas", 0):  # one lost, being rebuilt
            queued += f", replicas {rec['rollout_replicas_working']:.0f}/{rec['rollout_replicas']:.0f}"
        parts.insert(-1, f"stale {rec.get('staleness_max', 0):.0f}{queued} | idle trainer "
                         f"{rec['trainer_idle_fraction']:.0%} rollout {rec['rollout_idle_fraction']:.0%}")
    if rec.get("checkpoint"):  # sealed this step; an asynchronous save seals a step it began earlier
        parts.append(f"saved step {rec.get('checkpoint_step', rec['step'])}")
    return " | ".join(parts)
