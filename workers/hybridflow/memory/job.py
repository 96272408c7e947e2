"""The edge of the memory model: a job file in, its plan out (reads config.json files; the rest is pure)."""
from __future__ import annotations

from pathlib import Path

from hybridflow.api import RLHFJob
from hybridflow.memory.plan import PoolPlan, memory_problems, pool_plans, render
from hybridflow.memory.shapes import ModelShape, read_shapes


def plan_job(job: RLHFJob, job_file: str,
             model_config: str | None = None) -> tuple[list[PoolPlan], dict[str, ModelShape]]:
    """Every pool's plan, with the model shapes found from the job file's directory (see memory.shapes)."""
    shapes = read_shapes(job.spec, Path(job_file).parent, Path(model_config) if model_config else None)
    return pool_plans(job.spec, shapes), shapes


def plan_text(job: RLHFJob, job_file: str, model_config: str | None = None) -> tuple[str, list[str]]:
    """`hybridflow plan`'s table and the problems that refuse the job (none: it fits)."""
    plans, shapes = plan_job(job, job_file, model_config)
    return render(job.spec, plans, shapes), memory_problems(job.spec, plans)


def gpu_memory_problems(job: RLHFJob, job_file: str) -> list[str]:
    """What `hybridflow validate` refuses: a GPU pool with an accelerator that its roles cannot fit."""
    if not any(p.device == "gpu" and p.accelerator for p in job.spec.resource_pools):
        return []
    plans, _ = plan_job(job, job_file)
    return [f"{msg} (`hybridflow plan {job_file}` prints the whole breakdown)"
            for msg in memory_problems(job.spec, [p for p in plans if p.device is not None])]
