"""The memory model of a job: bytes per device for every role, by phase, against the pool's device profile
(hybridflow.api.devices). `hybridflow plan` prints it; `hybridflow validate` refuses a GPU job that cannot fit."""
from hybridflow.memory.job import gpu_memory_problems, plan_job, plan_text
from hybridflow.memory.plan import PoolPlan, memory_problems, pool_plans, render
from hybridflow.memory.shapes import ModelShape, ShapeError, read_shapes, shape_from_config
from hybridflow.memory.terms import PHASES, Term

__all__ = ["PHASES", "ModelShape", "PoolPlan", "ShapeError", "Term", "gpu_memory_problems", "memory_problems",
           "plan_job", "plan_text", "pool_plans", "read_shapes", "render", "shape_from_config"]
