"""`hybridflow run|driver|validate|plan|export|crd|dashboards|rules|algorithms|doctor|environments serve|leave-pool`:
the same job YAML on a laptop (local Ray) or inside a pod.

Exit codes: 0 success, 1 the job failed while running, 2 bad input (manifest, paths), 130 interrupted.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from hybridflow.capacity import local_capacity_problems, machine_facts
from hybridflow.api import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_SANDBOX_UNAVAILABLE, RLHFJob, SpecError, load_job
from hybridflow.cli.pool_replica import cmd_environments_serve
from hybridflow.sandbox_pool import SERVES, SERVES_ALL
from hybridflow.sandbox.limits import SandboxUnavailable
from hybridflow.api.engines import standalone_rollout_engines
from hybridflow.agents.server import IDLE_SESSION_SECONDS, MAX_SESSION_SECONDS, MAX_SESSIONS
from hybridflow.trainer.preflight import check_runtime_paths, loaded_code_problems
from hybridflow.single_controller.ray_auth import RAY_AUTH_ENV, fresh_ray_token, restore_ray_auth

log = logging.getLogger("hybridflow")


class KeyValueFormatter(logging.Formatter):
    """One line per event: `ts level logger: message key=value ...` (structured, grep- and machine-friendly)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{ts} {record.levelname.lower()} {record.name}: {record.getMessage()}"


def setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("hybridflow").setLevel(logging.DEBUG if verbose else logging.WARNING)
    for noisy in ("ray", "vllm", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _load(path: str, overrides: dict[str, Any], quiet: bool = False) -> RLHFJob:
    job = load_job(path)
    if overrides:
        from hybridflow.api import dump_job, parse_job

        doc = dump_job(job)
        for dotted, value in overrides.items():
            node = doc
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        job = parse_job(doc, f"{path} (with command-line overrides)")
    problems = check_runtime_paths(job)
    if problems:
        raise SpecError(f"{path}: cannot run here\n" + "\n".join(f"  {p}" for p in problems))
    from hybridflow.cli.device_map import placed

    return placed(job, path, quiet)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "steps", None):
        out["spec.trainer.steps"] = args.steps
    if getattr(args, "checkpoint_dir", None):
        out["spec.trainer.checkpointDir"] = args.checkpoint_dir
    if getattr(args, "metrics_port", None) is not None:
        out["spec.metrics.port"] = args.metrics_port
    if getattr(args, "engine", None):
        out["spec.rollout.engine"] = args.engine
    return out


# Ray starts one idle worker process per CPU for the first driver; ours are never used (each WorkerHost asks for a
# runtime_env of its own, its allocator's, so Ray starts a dedicated process for it): ~0.6 s of a core each, per run.
LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def start_local_ray(job: RLHFJob, temp_dir: str | None, verbose: bool = False) -> None:
    """A private single-node Ray that listens on loopback only, advertises each pool's devices and admits only
    holders of a token of its own (`fresh_ray_token`)."""
    import ray

    from hybridflow.api import pool_resource, pool_slot_resource

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keeps Ray on 127.0.0.1
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    pools = job.spec.resource_pools
    need_cpus = sum(p.world_size * p.cpus_per_device for p in pools)
    if any(p.nodes > 1 for p in pools):
        raise SpecError(
            "spec.resourcePools[].nodes > 1 needs a Ray cluster: use `hybridflow driver --address` (or the operator)"
        )
    gpus = sum(p.world_size for p in pools if p.device == "gpu")
    fresh_ray_token()
    ray.init(
        num_cpus=max(int(need_cpus + 0.999), os.cpu_count() or 1),
        num_gpus=gpus or None,
        resources={**{pool_resource(p.name): p.world_size for p in pools},  # (and the one node's slot: a pool of
                   **{pool_slot_resource(p.name, 0): p.devices_per_node for p in pools}},  # replicas asks for it)
        include_dashboard=False,
        object_store_memory=256 << 20,
        log_to_driver=verbose,  # worker errors still arrive as exceptions; their chatter only with -v
        logging_level=logging.ERROR,
        _temp_dir=temp_dir,
        runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "1"}},
        _system_config=LOCAL_RAY_SYSTEM_CONFIG,
    )


@contextlib.contextmanager
def local_ray(job: RLHFJob, temp_dir: str | None, verbose: bool = False) -> Iterator[None]:
    """`start_local_ray` for the length of a block: Ray is shut down however the block ends, and a start that
    fails half-way is shut down too, so the next `ray.init` in this process does not inherit it."""
    import ray

    saved = {k: os.environ.get(k) for k in RAY_AUTH_ENV}
    try:
        start_local_ray(job, temp_dir, verbose)
        yield
    finally:
        ray.shutdown()
        restore_ray_auth(saved)  # this run's token ends with its Ray


def _refuse_unloadable_code(job: RLHFJob, path: str) -> None:
    """Exit 2 for user code that loads but cannot work (its file, line and field), before anything starts."""
    problems = loaded_code_problems(job)
    if problems:
        raise SpecError(f"{path}: its user code cannot work\n" + "\n".join(f"  {p}" for p in problems))


def cmd_run(args: argparse.Namespace) -> int:
    job = _load(args.job, _overrides(args), args.quiet)
    problems = local_capacity_problems(job.spec, machine_facts(job))
    if problems:
        raise SpecError(f"{args.job}: cannot run on this machine (`hybridflow validate` accepts it for a cluster)\n"
                        + "\n".join(f"  {p}" for p in problems))
    _refuse_unloadable_code(job, args.job)
    from hybridflow.trainer.loop import execute
    from hybridflow.trainer.setup import prepare

    prepared = prepare(job, progress=not args.quiet)
    try:
        with local_ray(job, args.ray_temp_dir, args.verbose):
            return execute(job, prepared, progress=not args.quiet)
    finally:
        prepared.close()


def cmd_driver(args: argparse.Namespace) -> int:
    import ray

    job = _load(args.job, _overrides(args), args.quiet)
    from hybridflow.trainer.loop import execute
    from hybridflow.trainer.setup import prepare

    prepared = prepare(job, progress=not args.quiet)
    try:
        ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=args.verbose)
        try:
            return execute(job, prepared, progress=not args.quiet)
        finally:
            ray.shutdown()
    finally:
        prepared.close()


def cmd_validate(args: argparse.Namespace) -> int:
    from hybridflow.memory import gpu_memory_problems

    job = _load(args.job, {})
    _refuse_unloadable_code(job, args.job)
    problems = gpu_memory_problems(job, args.job)
    if problems:
        raise SpecError(f"{args.job}: does not fit its GPUs\n" + "\n".join(f"  {p}" for p in problems))
    print(f"{args.job}: valid {job.kind} '{job.metadata.name}'")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """The memory plan per pool, role and phase; exit 2 when a pool does not fit its devices (0 when it fits).
    With --devices: the device-mapping planner's ranking instead (cli/device_map.py)."""
    if args.auto or args.devices is not None:
        from hybridflow.cli.device_map import cmd_auto, cmd_map

        return cmd_auto(args) if args.auto else cmd_map(args)
    from hybridflow.memory import ShapeError, plan_text

    try:
        text, problems = plan_text(load_job(args.job), args.job, args.model_config)
    except ShapeError as err:
        raise SpecError(str(err)) from err
    print(text)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return EXIT_BAD_INPUT if problems else 0


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint (a step_* directory, or a checkpointDir: its newest intact one) as an HF model directory."""
    from hybridflow import checkpoint as ckpt
    from hybridflow.export import chosen_checkpoint, export

    try:
        source = chosen_checkpoint(args.checkpoint)
        out = export(source, Path(args.to), args.role, args.dtype, Path(args.model_dir) if args.model_dir else None,
                     merge=args.merge)
    except (ckpt.CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"exported {args.role} of {source} to {out}")
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    from hybridflow.api.crd import render_crd

    text = render_crd()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    return 0


def cmd_dashboards(args: argparse.Namespace) -> int:
    from hybridflow.dashboards import write_all

    for p in write_all(Path(args.output)):
        print(f"wrote {p}")
    return 0


def cmd_algorithms(args: argparse.Namespace) -> int:
    """Each registered algorithm with the roles it adds and its defaults, the roles, then the registered pieces."""
    from hybridflow.algorithms import ALGORITHMS
    from hybridflow.api.roles import ROLE_KINDS
    from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from hybridflow.algorithms.corrections import OFF_POLICY_CORRECTIONS
    from hybridflow.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS
    from hybridflow.algorithms.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
    from pydantic.alias_generators import to_camel

    for name in ALGORITHMS.names():
        a = ALGORITHMS[name]
        roles = ", ".join(r for r, on in (("critic", a.critic), ("cost + cost critic", a.cost)) if on) or "no critic"
        defaults = ", ".join(f"{to_camel(k)}={v}" for k, v in a.defaults.items())
        print(f"{name}: {a.summary}\n    roles: actor, {roles}; min responses per prompt {a.min_group}; {defaults}")
    print("roles (spec.placement's keys), each with the spec section that configures it:")
    for name, kind in ROLE_KINDS.items():
        print(f"    {name} (spec.{kind.section}): {kind.summary}")
    for registry in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, LOSS_AGGREGATIONS, KL_ESTIMATORS, KL_CONTROLLERS,
                     OFF_POLICY_CORRECTIONS):
        print(f"registered {registry.kind}: {', '.join(registry.names())}")
    return 0


def cmd_rules(args: argparse.Namespace) -> int:
    from hybridflow.rewards.rules import RULES

    for name, fn in sorted(RULES.items()):
        print(f"{name}: {(fn.__doc__ or '').strip().splitlines()[0]}")
    return 0


def cmd_leave_pool(args: argparse.Namespace) -> int:
    from hybridflow.single_controller.membership import leave

    print(leave(args.address, args.pool, args.index, args.timeout), flush=True)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from hybridflow.doctor import run

    return run(want_gpu=args.gpu)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridflow", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs from hybridflow")
    sub = p.add_subparsers(dest="cmd", required=True)

    def job_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help_)
        c.add_argument("job", help="RLHFJob YAML manifest")
        c.add_argument("--steps", type=int, help="override spec.trainer.steps")
        c.add_argument("--checkpoint-dir", help="override spec.trainer.checkpointDir")
        c.add_argument("--metrics-port", type=int, help="override spec.metrics.port (0 disables)")
        c.add_argument("--engine", choices=standalone_rollout_engines(), help="override spec.rollout.engine")
        c.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
        return c

    run = job_cmd("run", "run a job on this machine (starts a private local Ray)")
    run.add_argument("--ray-temp-dir", help="Ray's session directory (default: Ray's)")
    run.set_defaults(fn=cmd_run)
    drv = job_cmd("driver", "run a job's controller on an existing Ray cluster (inside the head pod)")
    drv.add_argument("--address", required=True, help="Ray cluster address, e.g. head-svc:6379")
    drv.set_defaults(fn=cmd_driver)
    leave = sub.add_parser("leave-pool", help="a pod given notice hands its rollout replicas back to the controller "
                           "and waits until it let them go (the preStop hook of an async job's rollout pods)")
    leave.add_argument("--address", required=True, help="the job's Ray head, e.g. head-svc:6379")
    leave.add_argument("--pool", required=True, help="the pod's resource pool")
    leave.add_argument("--index", type=int, required=True, help="the pod's index in its pool")
    leave.add_argument("--timeout", type=float, default=60.0, help="the longest wait, in seconds (default 60)")
    leave.set_defaults(fn=cmd_leave_pool)
    val = sub.add_parser("validate", help="check a manifest and the paths it names")
    val.add_argument("job")
    val.set_defaults(fn=cmd_validate)
    plan = sub.add_parser("plan", help="print the job's memory per device, role and phase; exit 2 if it cannot fit")
    plan.add_argument("job")
    plan.add_argument("--model-config", help="config.json of the actor's model when its directory is not here")
    plan.add_argument("--devices", type=int, help="plan the job's placement for this many devices instead: rank "
                      "placements, device counts and layouts by predicted step time (the paper's auto-mapping)")
    plan.add_argument("--accelerator", help="with --devices: the device profile to plan for (e.g. h100-80gb; "
                      "default: the job's pools' accelerator; cpu: this machine's measured peak)")
    plan.add_argument("-o", "--output", help="with --devices: write the first candidate's resolved spec here")
    plan.add_argument("--auto", action="store_true", help="plan a placement: auto job onto its pools' devices, as "
                      "`run` and the operator do")
    plan.add_argument("--write-plan", help="with --auto: write the plan (JSON) here (a plan pod's termination log)")
    plan.add_argument("--top", type=int, default=10, help="with --devices: how many candidates to print (10)")
    plan.add_argument("--modes", default="sync,one_step_off,async", help="with --devices: rollout modes to consider "
                      "(comma-separated; default all three)")
    plan.add_argument("--train-engines", help="with --devices: training engines to consider (comma-separated; "
                      "default every one the job can use)")
    plan.add_argument("--peak-flops", type=float, help="with --devices: the device's measured peak FLOP/s "
                      "(replaces the profile's)")
    plan.set_defaults(fn=cmd_plan)
    exp = sub.add_parser("export", help="write a checkpoint's actor (or critic) as an HF model directory")
    exp.add_argument("checkpoint", help="a step_* checkpoint directory, or a checkpointDir (its newest intact one)")
    exp.add_argument("--to", required=True, help="new directory for the HF model (safetensors, config, tokenizer)")
    exp.add_argument("--role", default="actor", help="actor (default), critic or cost_critic")
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                     help="cast the weights (default: the dtype they trained in)")
    exp.add_argument("--model-dir", help="HF directory the job trained from (for checkpoints without config, and the "
                     "base a LoRA adapter merges into when the job's own path is not here)")
    exp.add_argument("--merge", action="store_true", help="a LoRA checkpoint: write the base model with the adapter "
                     "merged in (default: the adapter alone, as a PEFT directory that peft and vLLM load)")
    exp.set_defaults(fn=cmd_export)
    crd = sub.add_parser("crd", help="write the RLHFJob CRD generated from the spec")
    crd.add_argument("-o", "--output", default="crds/rlhfjob.yaml", help="file, or - for stdout")
    crd.set_defaults(fn=cmd_crd)
    dash = sub.add_parser("dashboards", help="write the Grafana dashboards (JSON) generated from code")
    dash.add_argument("-o", "--output", default="helm/hybridflow/files/dashboards", help="directory")
    dash.set_defaults(fn=cmd_dashboards)
    rules = sub.add_parser("rules", help="list registered reward rules")
    rules.set_defaults(fn=cmd_rules)
    envs = sub.add_parser("environments", help="the job's environment pool (spec.environments)")
    env_sub = envs.add_subparsers(dest="environments_cmd", required=True)
    serve = env_sub.add_parser("serve", help="serve the job's tools and environment sessions over HTTP (one replica)")
    serve.add_argument("--spec", required=True, help="the job's (resolved) spec file")
    serve.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    serve.add_argument("--address", default="127.0.0.1", help="address to bind (default 127.0.0.1; a pod: 0.0.0.0)")
    serve.add_argument("--idle-session-seconds", type=float, default=IDLE_SESSION_SECONDS,
                       help=f"close a session nobody has stepped for this long (default {IDLE_SESSION_SECONDS:.0f})")
    serve.add_argument("--max-session-seconds", type=float, default=MAX_SESSION_SECONDS,
                       help=f"close a session this long after it opened, stepped or not (default "
                            f"{MAX_SESSION_SECONDS:.0f})")
    serve.add_argument("--serves", choices=SERVES, default=SERVES_ALL,
                       help="what this replica serves: all (default), agents (tools and environments only) or "
                            "rewards (reward functions only): the operator sets reward functions apart from the "
                            "model's code where the sandbox is partial")
    serve.add_argument("--max-sessions", type=int, default=MAX_SESSIONS,
                       help="sessions open at once; more are refused (503) and opened on another replica")
    serve.set_defaults(fn=cmd_environments_serve)
    algorithms = sub.add_parser("algorithms", help="list registered algorithms, roles, estimators, losses and KL pieces")
    algorithms.set_defaults(fn=cmd_algorithms)
    doctor = sub.add_parser("doctor", help="print this node's NVIDIA driver, CUDA, NCCL, torch, vLLM and GPUs, and "
                            "refuse (exit 1) a stack that cannot run the pinned vLLM")
    doctor.add_argument("--gpu", action="store_true", help="this node must have a GPU (a GPU worker pod)")
    doctor.set_defaults(fn=cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return args.fn(args)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SandboxUnavailable as err:
        print(f"error: {err}. On Kubernetes, where pods cannot make user namespaces (seccomp RuntimeDefault), set "
              "spec.sandbox.runtimeClassName to a gVisor or Kata RuntimeClass, or spec.sandbox.allowPartial: true to "
              "run it with the pod's own containment", file=sys.stderr)
        return EXIT_SANDBOX_UNAVAILABLE
    except KeyboardInterrupt:
        print("interrupted; the last checkpoint is kept and `resume: auto` continues from it", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the one place that turns any failure into an exit code
        log.debug("failure", exc_info=True)
        print(f"error: job failed: {type(err).__name__}: {bounded_message(err)}\n(rerun with -v for the whole "
              f"error and its traceback; checkpoints in spec.trainer.checkpointDir are kept)", file=sys.stderr)
        return EXIT_FAILED


def bounded_message(err: BaseException, max_lines: int = 12, max_chars: int = 1500) -> str:
    """`err`'s message, whole when it is short; else its first line and as many of its last lines as fit. A pod's
    termination message is its log's last 2 KiB: an error carrying a remote traceback (a Ray task's) would push
    out the line that says the job failed, and the operator would report nothing; the bottom of a traceback
    names what failed."""
    lines = [ln.rstrip() for ln in str(err).strip().splitlines() if ln.strip()] or [type(err).__name__]
    if len(lines) <= max_lines and sum(len(ln) + 1 for ln in lines) <= max_chars:
        return "\n".join(lines)
    head, tail = lines[0][:300], []
    budget = max_chars - len(head) - 4
    for ln in reversed(lines[1:]):
        if len(tail) == max_lines - 2 or len(ln) + 1 > budget:
            break
        tail.insert(0, ln)
        budget -= len(ln) + 1
    return "\n".join([head, "...", *(tail or [lines[-1][:budget]])])
