"""`placement: auto`: a job resolved by the planner onto the devices its resource pools hold. The pools say how
many devices the job has and of what kind (their sum, their accelerator); the plan re-cuts them into pools of its
own, places the models, and picks the layouts and micro-batch size; the user's rollout mode stays theirs (it
changes what is learned: staleness), so only placements of that mode compete. `hybridflow run` resolves for this
machine before Ray starts; the plan's summary is what status.plan records and the console prints."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hybridflow.api import RLHFJob
from hybridflow.api.devices import DeviceProfile, profile
from hybridflow.api.plan import plan_fields
from hybridflow.mapping.search import PlanError, Ranked, search
from hybridflow.mapping.stage_time import Calibration
from hybridflow.memory.shapes import ModelShape


@dataclass(frozen=True)
class AutoPlan:
    """The chosen candidate and the job it resolves to."""

    job: RLHFJob
    best: Ranked
    devices: int
    device: DeviceProfile
    considered: int

    def summary(self) -> dict[str, Any]:
        """What the job records of its plan (status.plan, the run's console): the placement, the pools' devices,
        the layout, and the prediction it was chosen on."""
        spec = self.job.spec
        return {
            "placement": self.best.label,
            "pools": {p.name: p.nodes * p.devices_per_node for p in spec.resource_pools},
            "roles": {r: spec.pool(r).name for r in spec.roles()},
            "mode": spec.rollout.mode,
            "layout": self.best.candidate.layout.describe(),
            "devices": self.devices,
            "accelerator": self.device.name,
            "predictedStepSeconds": round(self.best.step_seconds, 4),
            "candidates": self.considered,
        }

    def record(self) -> dict[str, Any]:
        """The plan as a plan pod prints it and status.plan holds it: its summary, and the spec fields it decides
        (hybridflow.api.plan.apply_plan lays them over the accepted spec)."""
        return {"summary": self.summary(), "fields": plan_fields(self.job)}

    def line(self) -> str:
        s = self.summary()
        return (f"placement auto: {s['placement']}, {s['layout']}, mode {s['mode']} on {s['devices']} x "
                f"{s['accelerator']} (predicted {s['predictedStepSeconds']:.3g} s a step; best of "
                f"{s['candidates']} candidates)")


def job_devices(job: RLHFJob) -> tuple[int, str]:
    """The devices an auto-placed job may use (every pool's, summed) and their kind (the first accelerator named,
    `cpu` for CPU pools); pools of different accelerators cannot be planned as one."""
    pools = job.spec.resource_pools
    kinds = {p.accelerator or ("cpu" if p.device == "cpu" else "") for p in pools}
    if len(kinds) != 1 or "" in kinds:
        raise PlanError("spec.placement: auto plans one kind of device; give every spec.resourcePools entry the "
                        "same accelerator (GPU pools need spec.resourcePools[].accelerator, e.g. h100-80gb), or "
                        "place the roles by hand")
    return sum(p.nodes * p.devices_per_node for p in pools), kinds.pop()


def resolve_auto(job: RLHFJob, shapes: dict[str, ModelShape], device: DeviceProfile | None = None,
                 calibration: Calibration | None = None) -> AutoPlan:
    """The job as the planner places it (a job not `placement: auto` is an error of the caller). `device`: the
    profile to plan for (default: the pools' accelerator; a CPU job's caller passes the calibrated CPU profile)."""
    assert job.spec.placement == "auto", "only a placement: auto job is resolved"
    devices, kind = job_devices(job)
    # the nodes the user's pools describe, not the profile's usual node: no planned pod asks for more devices than
    # the job's nodes have
    device = replace(device or profile(kind),
                     devices_per_node=max(p.devices_per_node for p in job.spec.resource_pools))
    # the user's own choices stay theirs: the rollout mode (it changes what is learned) and a training engine named
    training = job.spec.training
    engines = [training.engine] if "engine" in training.model_fields_set else None
    try:
        result = search(job, shapes, devices, device, top=1, modes=[job.spec.rollout.mode], engines=engines,
                        calibration=calibration)
    except PlanError as err:  # its messages name `hybridflow plan`'s flags: here they are the job's pools
        raise PlanError(f"spec.placement: auto, for spec.resourcePools' {devices} x {device.name}: {err}") from err
    if not result.ranked:
        raise PlanError(f"spec.placement: auto: no placement of this job's models fits its {devices} x {device.name}"
                        f" (spec.resourcePools; {result.considered} candidates, none the rules and the memory model "
                        "accept); add devices, or shorten spec.rollout.maxResponseLength")
    best = result.ranked[0]
    return AutoPlan(best.job, best, devices, device, result.considered)
