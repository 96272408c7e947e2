"""`hybridflow run|driver|validate|crd|rules`: the same job YAML on a laptop (local Ray) or inside a pod.

Exit codes: 0 success, 1 the job failed while running, 2 bad input (manifest, paths), 130 interrupted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from hybridflow.spec import EXIT_BAD_INPUT, EXIT_FAILED, RLHFJob, SpecError, check_runtime_paths, load_job

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


def _load(path: str, overrides: dict[str, Any]) -> RLHFJob:
    job = load_job(path)
    if overrides:
        from hybridflow.spec import dump_job, parse_job

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
    return job


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


def start_local_ray(job: RLHFJob, temp_dir: str | None, verbose: bool = False) -> None:
    """A private single-node Ray that listens on loopback only and advertises each pool's devices."""
    import ray

    from hybridflow.spec import pool_resource

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keeps Ray on 127.0.0.1
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    pools = job.spec.resource_pools
    need_cpus = sum(p.world_size * p.cpus_per_device for p in pools)
    if any(p.nodes > 1 for p in pools):
        raise SpecError(
            "spec.resourcePools[].nodes > 1 needs a Ray cluster: use `hybridflow driver --address` (or the operator)"
        )
    gpus = sum(p.world_size for p in pools if p.device == "gpu")
    ray.init(
        num_cpus=max(int(need_cpus + 0.999), os.cpu_count() or 1),
        num_gpus=gpus or None,
        resources={pool_resource(p.name): p.world_size for p in pools},
        include_dashboard=False,
        object_store_memory=256 << 20,
        log_to_driver=verbose,  # worker errors still arrive as exceptions; their chatter only with -v
        logging_level=logging.ERROR,
        _temp_dir=temp_dir,
        runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "1"}},
    )


@dataclass
class Prepared:
    """What a job needs before its workers start: model directories, and the prompts and the reward."""

    model_dir: Path
    critic_dir: Path | None
    rm_dir: Path | None
    task: Any  # trainer.Task

    def close(self) -> None:
        self.task.close()  # a reward function's worker processes


def prepare(job: RLHFJob, progress: bool = True) -> Prepared:
    """Models and data, before Ray starts: a bad data file is exit 2 with nothing started, and tokenizing does not
    hold a cluster's devices."""
    from hybridflow import trainer
    from hybridflow.models.builders import materialize, model_cache_dir

    s = job.spec
    cache = model_cache_dir()
    if progress:
        print(f"job {job.metadata.name}: {s.algorithm.name} on {s.models.actor.source} model, rollout "
              f"{s.rollout.engine}, {s.trainer.steps} steps x {s.trainer.prompts_per_step} prompts x "
              f"{s.rollout.responses_per_prompt} samples")
    model_dir = materialize(s.models.actor, cache, s.trainer.seed)
    critic_dir = materialize(s.models.critic, cache, s.trainer.seed) if s.models.critic else None
    rm_dir = materialize(s.models.reward.model, cache, s.trainer.seed) if s.models.reward.model else None
    task = trainer.build_task(job, model_dir)
    if progress:
        print(f"prompts: {len(task.train)} for training, {len(task.eval)} held out")
    return Prepared(model_dir, critic_dir, rm_dir, task)


def execute(job: RLHFJob, prepared: Prepared, progress: bool = True) -> int:
    from hybridflow import trainer
    from hybridflow.metrics import JobMetrics

    s = job.spec
    say = print if progress else (lambda *_: None)
    metrics = JobMetrics(job.metadata.name)
    if s.metrics.port:
        port = metrics.serve(s.metrics.port, s.metrics.address)
        say(f"metrics: http://{s.metrics.address}:{port}/metrics")
    workers = trainer.build_workers(job, prepared.model_dir, prepared.task, prepared.critic_dir, prepared.rm_dir)
    try:
        summary = trainer.fit(job, workers, prepared.task, metrics, progress=say)
    finally:
        workers.shutdown()
    say(
        f"done: {summary.steps_done} steps (from step {summary.start_step}) in {summary.seconds:.1f}s, "
        f"mean {summary.mean_throughput:.0f} tokens/s"
    )
    if summary.eval_before is not None and summary.eval_after is not None:
        say(f"held-out reward: before {summary.eval_before:.3f} -> after {summary.eval_after:.3f}")
    summary_path = Path(s.trainer.checkpoint_dir) / "summary.json"
    summary_path.write_text(json.dumps({
        "steps_done": summary.steps_done, "start_step": summary.start_step, "eval_before": summary.eval_before,
        "eval_after": summary.eval_after, "seconds": summary.seconds, "mean_tokens_per_s": summary.mean_throughput,
    }, indent=1))
    if s.metrics.port and s.metrics.linger_seconds:
        time.sleep(s.metrics.linger_seconds)  # the final step's values reach Prometheus before the exporter goes
    return 0


@contextlib.contextmanager
def local_ray(job: RLHFJob, temp_dir: str | None, verbose: bool = False) -> Iterator[None]:
    """`start_local_ray` for the length of a block: Ray is shut down however the block ends, and a start that
    fails half-way is shut down too, so the next `ray.init` in this process does not inherit it."""
    import ray

    try:
        start_local_ray(job, temp_dir, verbose)
        yield
    finally:
        ray.shutdown()


def cmd_run(args: argparse.Namespace) -> int:
    job = _load(args.job, _overrides(args))
    prepared = prepare(job, progress=not args.quiet)
    try:
        with local_ray(job, args.ray_temp_dir, args.verbose):
            return execute(job, prepared, progress=not args.quiet)
    finally:
        prepared.close()


def cmd_driver(args: argparse.Namespace) -> int:
    import ray

    job = _load(args.job, _overrides(args))
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
    job = _load(args.job, {})
    print(f"{args.job}: valid {job.kind} '{job.metadata.name}'")
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    from hybridflow.crd import render_crd

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


def cmd_rules(args: argparse.Namespace) -> int:
    from hybridflow.rewards.rules import RULES

    for name, fn in sorted(RULES.items()):
        print(f"{name}: {(fn.__doc__ or '').strip().splitlines()[0]}")
    return 0


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
        c.add_argument("--engine", choices=["vllm", "hf"], help="override spec.rollout.engine")
        c.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
        return c

    run = job_cmd("run", "run a job on this machine (starts a private local Ray)")
    run.add_argument("--ray-temp-dir", help="Ray's session directory (default: Ray's)")
    run.set_defaults(fn=cmd_run)
    drv = job_cmd("driver", "run a job's controller on an existing Ray cluster (inside the head pod)")
    drv.add_argument("--address", required=True, help="Ray cluster address, e.g. head-svc:6379")
    drv.set_defaults(fn=cmd_driver)
    val = sub.add_parser("validate", help="check a manifest and the paths it names")
    val.add_argument("job")
    val.set_defaults(fn=cmd_validate)
    crd = sub.add_parser("crd", help="write the RLHFJob CRD generated from the spec")
    crd.add_argument("-o", "--output", default="crds/rlhfjob.yaml", help="file, or - for stdout")
    crd.set_defaults(fn=cmd_crd)
    dash = sub.add_parser("dashboards", help="write the Grafana dashboards (JSON) generated from code")
    dash.add_argument("-o", "--output", default="helm/hybridflow/files/dashboards", help="directory")
    dash.set_defaults(fn=cmd_dashboards)
    rules = sub.add_parser("rules", help="list registered reward rules")
    rules.set_defaults(fn=cmd_rules)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return args.fn(args)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted; the last checkpoint is kept and `resume: auto` continues from it", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the one place that turns any failure into an exit code
        log.debug("failure", exc_info=True)
        print(f"error: job failed: {type(err).__name__}: {err}\n(rerun with -v for the traceback; checkpoints in "
              f"spec.trainer.checkpointDir are kept)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
