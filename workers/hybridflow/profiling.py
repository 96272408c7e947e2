"""Where a stage's time goes, by kind of operation (spec.trainer.profileSteps): torch's profiler around one stage
of the steps named, its ops' own (self) time summed by kind, and what no op covers (Python, the loop, waits).

Why by kind: a step's MFU says how far the update is from the machine's matmul speed, not what the rest is. The
kinds are what a change can remove (an elementwise block fused, a copy or cast avoided, a collective overlapped),
so the table says which lever is worth building. The kinds are data (`OP_KINDS`, patterns over the profiler's op
names, the first kind that matches wins); an op no pattern names counts as "other", which the table shows too.

The numbers travel as the stage's own statistics (`profile_<stage>_<kind>_s`), so they reach the step log
(steps.jsonl), a table in the job's log and a bench's output the way a stage's statistics do, on a laptop and on
Kubernetes alike. On a GPU the device time of each kind comes beside it (`..._gpu_<kind>_s`). Profiling slows what
it measures (an update on CPU: 24.5 s against 17.7 s) and holds a record of every op until the stage ends.
"""
from __future__ import annotations

import contextlib
import logging
import re
import time
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from hybridflow.logs import say_once

log = logging.getLogger(__name__)

# kind -> patterns (re.search) over op names as torch's profiler records them: aten::mm, FSDP::all_gather_copy_in,
# autograd::engine::evaluate_function: MmBackward0, Optimizer.step#AdamW.step, c10d::allgather_ ...
OP_KINDS: dict[str, tuple[str, ...]] = {
    "matmul": (r"^aten::(mm|addmm|bmm|baddbmm|addmv|mv|dot|linear|matmul)$", r"mkldnn_(linear|matmul)", r"gemm",
               r"onednn_mm"),
    "attention": (r"scaled_dot_product", r"flash_attention", r"efficient_attention", r"cpu_attention",
                  r"paged_attention", r"unified_attention"),
    "softmax": (r"^aten::_?(log_)?softmax",),
    "optimizer": (r"_fused_adam", r"^Optimizer\.", r"^aten::_foreach_"),
    "fsdp": (r"^FSDP::",),  # FSDP's own work around its collectives (copy in and out, waits): before them
    "communication": (r"^(c10d|gloo|nccl)", r"all_gather|reduce_scatter|allreduce|all_reduce|broadcast",
                      r"^record_param_comms$"),
    "copy_cast": (r"^aten::(copy_|_to_copy|to|clone|contiguous|cat|stack|_copy_from|_copy_from_and_resize)$",),
    "fill_alloc": (r"^aten::(fill_|zero_|zeros|zeros_like|empty|empty_like|empty_strided|ones|ones_like|full|"
                   r"new_zeros|new_empty|new_empty_strided|resize_)$",),
    "indexing": (r"^aten::(index|index_put_|_index_put_impl_|gather|scatter|scatter_add_|embedding|"
                 r"embedding_dense_backward|embedding_backward|index_select|index_add_|masked_fill_?|where|nonzero|"
                 r"select_backward|slice_backward|masked_select|take_along_dim)$",),
    "reduction": (r"^aten::(sum|mean|max|min|amax|amin|norm|linalg_vector_norm|var|std|argmax|cumsum|logsumexp)$",),
    "elementwise": (r"^aten::(add|add_|sub|sub_|rsub|mul|mul_|div|div_|neg|pow|rsqrt|sqrt|exp|exp_|log|log_|silu|"
                    r"silu_backward|sigmoid|tanh|cos|sin|abs|clamp|clamp_|clamp_min|clamp_max|maximum|minimum|"
                    r"reciprocal|lerp_|addcmul_|addcdiv_|sign|eq|ne|lt|le|gt|ge|logical_and|logical_or|"
                    r"logical_not|bitwise_and|bitwise_or|bitwise_not|threshold_backward|gelu|gelu_backward|"
                    r"relu|tril|triu)$",),
    "autograd": (r"^autograd::", r"Backward\d*$"),
}
OTHER = "other"  # an op no pattern names
OUTSIDE = "outside_ops"  # the stage's wall time no op covers: Python, the loop, waiting on other ranks
KINDS = (*OP_KINDS, OTHER, OUTSIDE)
_COMPILED = [(kind, [re.compile(p) for p in patterns]) for kind, patterns in OP_KINDS.items()]
PREFIX = "profile_"
PROFILE = "profile"  # a batch's meta: the role that gets it profiles what it does with it (the step is profiled)
GENERATION_PROFILE = "generation_profile"  # a generated batch's meta: its generation's stage_stats


def rank_means(per_rank: Iterable[Mapping[str, float]], prefix: str = "") -> dict[str, float]:
    """Each statistic (those starting with `prefix`) as its mean over the ranks that report it: a rank whose
    profiler could not start or recorded nothing reports no profile, and the others' still count."""
    per_rank = list(per_rank)
    keys = dict.fromkeys(k for r in per_rank for k in r if k.startswith(prefix))
    return {k: float(np.mean([r[k] for r in per_rank if k in r])) for k in keys}


def op_kind(name: str) -> str:
    """The kind of the profiler's op `name` (OTHER where no pattern of OP_KINDS matches)."""
    for kind, patterns in _COMPILED:
        if any(p.search(name) for p in patterns):
            return kind
    return OTHER


def seconds_by_kind(ops: Iterable[tuple[str, float]], wall: float) -> dict[str, float]:
    """(op name, self seconds) pairs summed by kind, every kind present, plus OUTSIDE: the wall seconds no op
    covered (never below zero: ops on other threads can add up to more than the wall)."""
    out = dict.fromkeys(KINDS, 0.0)
    for name, seconds in ops:
        out[op_kind(name)] += seconds
    out[OUTSIDE] = max(0.0, wall - sum(v for k, v in out.items() if k != OUTSIDE))
    return out


def stage_stats(stage: str, wall: float, by_kind: Mapping[str, float], ops: int,
                gpu_by_kind: Mapping[str, float] | None = None) -> dict[str, float]:
    """The statistics a profiled stage reports: its wall seconds, op count and seconds per kind (and per kind on
    the GPU)."""
    out = {f"{PREFIX}{stage}_wall_s": wall, f"{PREFIX}{stage}_ops": float(ops)}
    out.update({f"{PREFIX}{stage}_{k}_s": v for k, v in by_kind.items()})
    out.update({f"{PREFIX}{stage}_gpu_{k}_s": v for k, v in (gpu_by_kind or {}).items()})
    return out


@contextlib.contextmanager
def profiled(stage: str, on: bool) -> Iterator[dict[str, float]]:
    """Profile what runs inside when `on`; the dict yielded is filled with `stage_stats` on the way out (left empty
    when off: nothing is recorded, nothing slows). A profiler that cannot start or be read (a Kineto or CUPTI
    failure) or that recorded nothing leaves it empty too, said once in the log: a profile never fails the step it
    measures."""
    out: dict[str, float] = {}
    prof = _started_profiler() if on else None
    if prof is None:
        yield out
        return
    t0 = time.perf_counter()
    try:
        yield out
    except BaseException:
        with contextlib.suppress(Exception):  # the work's own error is the one to see
            prof.stop()
        raise
    wall = time.perf_counter() - t0
    try:
        prof.stop()
        out.update(_read(prof, stage, wall))
    except Exception as e:  # noqa: BLE001 - the measurement is optional, the step's work is not
        say_once(log, f"profile of '{stage}' not taken: the profiler could not be read ({e})")


def _started_profiler() -> Any:
    """torch's profiler, started (CPU ops, and CUDA kernels where this process uses a GPU); None where it cannot
    start."""
    import os

    os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # read at the profiler's first start: no "USDT: profiler_start"
    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []))
    try:
        prof.start()
    except Exception as e:  # noqa: BLE001 - a Kineto or CUPTI failure
        say_once(log, f"profile not taken: the profiler could not start ({e})")
        return None
    prof.with_gpu = gpu  # type: ignore[attr-defined]
    return prof


def _read(prof: Any, stage: str, wall: float) -> dict[str, float]:
    averages = prof.key_averages()
    if not averages:  # no table of zeros passed off as a profile
        raise RuntimeError("it recorded no op")
    by_kind = seconds_by_kind(((e.key, e.self_cpu_time_total / 1e6) for e in averages), wall)
    gpu_by_kind = None
    if prof.with_gpu:
        gpu_by_kind = seconds_by_kind(((e.key, e.self_device_time_total / 1e6) for e in averages), 0.0)
        del gpu_by_kind[OUTSIDE]
    return stage_stats(stage, wall, by_kind, sum(e.count for e in averages), gpu_by_kind)


_KEY = re.compile(rf"^((?:\w+?_)?){PREFIX}(\w+?)_(gpu_)?({'|'.join(KINDS)})_s$")


def profile_tables(stats: Mapping[str, float]) -> dict[str, tuple[dict[str, float], float]]:
    """stage -> ({kind: seconds}, its wall seconds) from a step's statistics. A role that prefixes its own keeps its
    prefix in the stage's name (`critic_profile_update_...`: "critic_update"); a stage's device time on a GPU is a
    stage of its own, "<stage> (gpu)"."""
    tables: dict[str, tuple[dict[str, float], float]] = {}
    for key, value in stats.items():
        m = _KEY.match(key)
        if m:
            role, stage, gpu, kind = m.groups()
            name = f"{role}{stage}" + (" (gpu)" if gpu else "")
            wall = float(stats.get(f"{role}{PREFIX}{stage}_wall_s", 0.0))
            tables.setdefault(name, ({}, wall))[0][kind] = value
    return tables


def profile_report(stats: Mapping[str, float]) -> str:
    """Every profiled stage's table in a step's statistics, one after another ("" when nothing was profiled)."""
    return "\n\n".join(format_table(stage, by_kind, wall) for stage, (by_kind, wall) in profile_tables(stats).items())


def format_table(stage: str, by_kind: Mapping[str, float], wall: float) -> str:
    """A markdown table of one stage's seconds by kind, largest first, with each kind's share of the wall."""
    lines = [f"| {stage}: kind | seconds | share of {wall:.2f} s |", "|---|---:|---:|"]
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        if seconds > 0:
            share = f" {seconds / wall:.1%} " if wall else " "
            lines.append(f"| {kind} | {seconds:.3f} |{share}|")
    return "\n".join(lines)
