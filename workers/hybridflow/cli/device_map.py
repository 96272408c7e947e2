"""`hybridflow plan JOB --devices N --accelerator X`: the device-mapping planner (hybridflow.mapping) from the
command line: the best placements, device counts and layouts for N devices, ranked by predicted step time, and
`-o` writes the first as a resolved spec. Its own module so the memory plan's `cmd_plan` stays as it was."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.api import RLHFJob, SpecError, dump_job, load_job
from hybridflow.api.devices import PROFILES, DeviceProfile, accelerator_problem, calibrated, profile
from hybridflow.api.plan import MAX_PLAN_BYTES, PLAN_ENV, apply_plan, plan_from_text

if TYPE_CHECKING:
    from hybridflow.mapping.auto import AutoPlan


def plan_device(args: argparse.Namespace, job: RLHFJob) -> DeviceProfile:
    """The device profile --accelerator names (default: the job's first pool with an accelerator); --peak-flops
    replaces its peak; the CPU profile takes this machine's measured matmul peak otherwise, as the MFU metric
    does (hybridflow.flops)."""
    name = args.accelerator or next((p.accelerator for p in job.spec.resource_pools if p.accelerator), None)
    if name is None:
        raise SpecError("--accelerator: give the device to plan for, e.g. --accelerator h100-80gb (the job's pools "
                        "name none)")
    problem = None if name == "cpu" else accelerator_problem(name)
    if problem:
        raise SpecError(f"--accelerator: {problem}, or cpu")
    device = PROFILES["cpu"] if name == "cpu" else profile(name)
    if args.peak_flops is not None:
        if not args.peak_flops > 0:
            raise SpecError(f"--peak-flops: {args.peak_flops}; give the device's measured FLOP/s (more than 0)")
        return calibrated(device, args.peak_flops)
    return this_cpu(job) if name == "cpu" else device


def this_cpu(job: RLHFJob) -> DeviceProfile:
    """The CPU profile with this machine's measured matmul peak as each rank measures it for its MFU metric
    (roles/actor.py, hybridflow.flops): in the dtype the ranks compute in (training.computeDtype; `auto`: bfloat16
    where the CPU has it natively), on one device's threads (the first pool's cpusPerDevice), not every core."""
    import torch

    from hybridflow.engines.precision import compute_dtype
    from hybridflow.flops import matmul_peak_flops

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(job.spec.resource_pools[0].cpus_per_device)))
    try:
        dtype = compute_dtype(job.spec.training.compute_dtype, "cpu", model_dtype=job.spec.models.actor.dtype)
        peak = matmul_peak_flops(dtype)  # the best of a few windows: other work only ever lowers one
        return calibrated(PROFILES["cpu"], peak, peak if dtype == torch.float32 else matmul_peak_flops(torch.float32))
    finally:
        torch.set_num_threads(threads)


def _names(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def cmd_map(args: argparse.Namespace) -> int:
    """Print the ranking (exit 0); exit 2 naming the flag or field for input it cannot plan, or when nothing fits."""
    import yaml

    from hybridflow.api.engines import TRAIN_ENGINES
    from hybridflow.mapping import PlanError, render_ranking, search
    from hybridflow.memory import ShapeError, read_shapes

    job = load_job(args.job)
    if args.top < 1:
        raise SpecError(f"--top: {args.top}; give how many candidates to print (at least 1)")
    engines = _names(args.train_engines)
    unknown = [e for e in engines or [] if e not in TRAIN_ENGINES.names()]
    if unknown or engines == []:
        raise SpecError(f"--train-engines: {', '.join(unknown) or 'none given'}; use some of "
                        f"{', '.join(TRAIN_ENGINES.names())}")
    device = plan_device(args, job)
    try:
        shapes = read_shapes(job.spec, Path(args.job).parent, Path(args.model_config) if args.model_config else None)
        result = search(job, shapes, args.devices, device, top=args.top, modes=_names(args.modes) or [],
                        engines=engines)
    except (ShapeError, PlanError) as err:
        raise SpecError(str(err)) from err
    if not result.ranked:
        raise SpecError(f"{args.job}: no placement of its models fits {args.devices} x {device.name} "
                        f"({result.considered} candidates scored, none that the rules and the memory model accept); "
                        "give more --devices or a larger --accelerator, or shorten spec.rollout.maxResponseLength")
    print(render_ranking(result, args.devices, device))
    if args.output:
        best = result.ranked[0]
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# hybridflow plan {args.job} --devices {args.devices} --accelerator {device.name}: rank 1, "
                       f"{best.label}, mode {best.candidate.placement.mode}, {best.candidate.layout.describe()}, "
                       f"predicted {best.step_seconds:.1f} s a step\n"
                       + yaml.safe_dump(dump_job(best.job), sort_keys=False))
        print(f"wrote {out}")
    return 0


def auto_plan(job: RLHFJob, job_file: str, model_config: str | None = None) -> "AutoPlan":
    """A `placement: auto` job's plan for the devices its pools hold (a CPU job: this machine's measured CPU)."""
    from hybridflow.mapping import PlanError
    from hybridflow.mapping.auto import job_devices, resolve_auto
    from hybridflow.memory import ShapeError, read_shapes

    try:
        _, kind = job_devices(job)
        shapes = read_shapes(job.spec, Path(job_file).parent, Path(model_config) if model_config else None)
        return resolve_auto(job, shapes, this_cpu(job) if kind == "cpu" else profile(kind))
    except (ShapeError, PlanError) as err:
        raise SpecError(f"{job_file}: {err}") from err


def placed(job: RLHFJob, job_file: str, quiet: bool = False) -> RLHFJob:
    """The job as it runs: as written, or for `placement: auto` with its plan laid over it: the operator's
    (PLAN_ENV, in the job's pods: every pod builds the same job) or, elsewhere, one made here and printed."""
    if job.spec.placement != "auto":
        return job
    if text := os.environ.get(PLAN_ENV):
        return apply_plan(job, plan_from_text(text, PLAN_ENV)["fields"], PLAN_ENV)
    plan = auto_plan(job, job_file)
    if not quiet:
        print(plan.line(), flush=True)
    return plan.job


def cmd_auto(args: argparse.Namespace) -> int:
    """`hybridflow plan JOB --auto`: the plan of a `placement: auto` job, printed, and its record (JSON: summary
    and fields) written to --write-plan (a plan pod's termination log, which the operator reads)."""
    job = load_job(args.job)
    if job.spec.placement != "auto":
        raise SpecError(f"{args.job}: --auto plans a job with spec.placement: auto; this one places its roles "
                        "itself (spec.placement)")
    if args.devices is not None or args.output:
        raise SpecError("--auto plans onto the devices of the job's own pools (spec.resourcePools): leave out "
                        "--devices and -o, or drop --auto to rank placements for --devices")
    plan = auto_plan(job, args.job, args.model_config)
    print(plan.line())
    text = json.dumps(plan.record(), separators=(",", ":"))
    if len(text.encode()) > MAX_PLAN_BYTES:  # a termination message holds 4096 bytes: refused here, saying why
        raise SpecError(f"{args.job}: its plan is {len(text.encode())} bytes, more than the {MAX_PLAN_BYTES} a plan "
                        "pod can report; give spec.resourcePools fewer node selectors, tolerations or affinities")
    if args.write_plan:
        Path(args.write_plan).write_text(text)
    return 0
