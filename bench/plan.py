"""The device-mapping planner (hybridflow.mapping) against measured step times on this machine (issue 52, item 4).

One real job, the tiny GRPO policy of examples/tiny-grpo-megatron.yaml (2 layers, hidden 64, vocabulary 16, two
key/value heads so that tensor-parallel 2 divides them; 32 prompts x 8 responses of 8 + 6 tokens; vLLM generation),
in placements the planner enumerates for 2 CPU devices: colocated on one pool of 2, and on two pools of 1 (rollout on
a pool of its own in sync, one_step_off and async, or the reference apart), FSDP and megatron (TP=2; TP=1 on one
device), micro-batches of 64 and 8 rows. Each placement is a candidate of `search`, resolved to a job by the
planner's own `resolve`: the run is what `hybridflow plan -o` would write.

For each: the planner's prediction (mapping.search.predict: the stage-time model, the cpu profile's peak measured
here at the start in the ranks' compute dtype on one thread, as each rank's MFU metric measures it, and the cpu
calibration mapping.stage_time.CALIBRATIONS["cpu"]); then a measured run (`hybridflow run JOB.yaml` in a temporary
directory, its own Ray, one run at a time), whose step log gives the median step seconds over the steps after the
first WARMUP (vLLM's first calls, the allocator growing) and before the last (it waits for the run's end); process
start is in no step. The table: placement, predicted and measured s/step, error, and whether the planner's first
choice among these placements is the measured fastest, or within 10% of it.

    .venv/bin/python bench/plan.py                   # predict and measure every placement (about 6 minutes)
    .venv/bin/python bench/plan.py --repeat 2        # each placement twice, interleaved (about 12 minutes)
    .venv/bin/python bench/plan.py --predict         # the predictions only, no runs
    .venv/bin/python bench/plan.py --json OUT.json   # also keep each run's step log
    .venv/bin/python bench/plan.py --from-json A.json[,B.json]   # predict against runs kept before (pooled)
    .venv/bin/python bench/plan.py --from-json bench/plan_fit.json --fit abcefgj   # the cpu calibration's fit

The machine has 2 cores and other work beside it (other test suites): timings are noisy, 10-40% from one
invocation to the next under load and up to 2x for a run that meets a burst (each run's load average is printed);
`--repeat 2` runs the placements twice, interleaved, and counts each placement's least disturbed run (other work
only ever adds time). The cpu calibration was fitted on bench/plan_fit.json (`--from-json bench/plan_fit.json
--fit abcefgj`: the constants and their provenance are in hybridflow.mapping.stage_time.CALIBRATIONS); the table
in docs/performance.md is a later invocation, bench/plan_check.json, measured after the fit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))

from hybridflow.api import RLHFJob, dump_job, load_job, parse_job  # noqa: E402
from hybridflow.api.devices import PROFILES, DeviceProfile, calibrated  # noqa: E402
from hybridflow.mapping import Candidate, Layout, Placement, resolve  # noqa: E402
from hybridflow.mapping.candidates import enumerate_candidates  # noqa: E402
from hybridflow.mapping.search import predict  # noqa: E402
from hybridflow.mapping.stage_time import Calibration, calibration_for  # noqa: E402
from hybridflow.memory import read_shapes  # noqa: E402

JOB = ROOT / "examples" / "tiny-grpo-megatron.yaml"
DEVICES = 2
WARMUP = 2  # steps left out at the start: the first calls of vLLM, the allocator's growth
MEASURED_SECONDS = 6.0  # about this many seconds of measured steps a run (from the prediction), 12 to 60 steps
CO = (("actor", "reference", "rollout"),)
OWN = (("actor", "reference"), ("rollout",))
REF_APART = (("actor", "rollout"), ("reference",))


# The FSDP switches of issue 57 (spec.training): runs kept before they existed (a --json file without this key)
# gathered and reduced per micro-batch, so they are priced with both off; runs measured now record what they ran.
SWITCHES = ("keepGatheredForBackward", "reduceGradientsPerStep")
BEFORE_SWITCHES = {k: "off" for k in SWITCHES}


def as_measured(job: RLHFJob, kept: dict[str, Any]) -> RLHFJob:
    """The job as the kept runs ran it: with the FSDP switches they recorded (both off for runs that predate
    them); `job` itself when nothing is kept (the runs measure it now)."""
    if not kept:
        return job
    doc = dump_job(job)
    doc["spec"].setdefault("training", {}).update(kept.get("fsdp_switches", BEFORE_SWITCHES))
    return parse_job(doc)


@dataclass(frozen=True)
class Run:
    key: str
    candidate: Candidate


def _run(key: str, groups: tuple, devices: tuple, mode: str, engine: str, tp: int, micro: int) -> Run:
    return Run(key, Candidate(Placement(groups, mode), devices, Layout(engine, tp, 1, 1, micro)))


RUNS = [
    _run("a", CO, (2,), "sync", "fsdp", 1, 64),
    _run("b", CO, (2,), "sync", "fsdp", 1, 8),
    _run("c", CO, (2,), "sync", "megatron", 2, 64),
    _run("d", CO, (2,), "sync", "megatron", 2, 8),
    _run("e", OWN, (1, 1), "sync", "fsdp", 1, 64),
    _run("f", OWN, (1, 1), "one_step_off", "fsdp", 1, 64),
    _run("g", OWN, (1, 1), "async", "fsdp", 1, 64),
    _run("h", REF_APART, (1, 1), "sync", "fsdp", 1, 64),
    _run("i", OWN, (1, 1), "async", "fsdp", 1, 8),
    _run("j", OWN, (1, 1), "sync", "megatron", 1, 64),
]


def pools(c: Candidate) -> str:
    return ", ".join("+".join(g) + f":{n}" for g, n in zip(c.placement.groups, c.devices))


def describe(c: Candidate) -> str:
    return f"{pools(c)}; {c.placement.mode}; {c.layout.describe()}"


def machine() -> str:
    """This machine in words: CPU model, cores, the vector extensions that matter to torch here, no GPU."""
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    ext = [name for flag, name in (("avx512_bf16", "AVX-512-BF16"), ("amx_bf16", "AMX")) if flag in flags]
    return f"{model}, {os.cpu_count()} cores{' with ' + ' and '.join(ext) if ext else ''}, no GPU"


def cpu_device(job: RLHFJob) -> DeviceProfile:
    """The cpu profile with this machine's matmul peak as `hybridflow plan --accelerator cpu` takes it: in the
    ranks' compute dtype, on one device's threads (what each rank's MFU metric divides by)."""
    from hybridflow.cli.device_map import this_cpu

    return this_cpu(job)


def job_doc(job: RLHFJob, run: Run, device: DeviceProfile, steps: int, ckpt: Path) -> dict[str, Any]:
    """The candidate's resolved job with `steps` steps, no evaluation, no checkpoints but the last, no metrics."""
    doc = dump_job(resolve(job, run.candidate, device))
    spec = doc["spec"]
    spec["trainer"].update(steps=steps, saveFreq=0, checkpointDir=str(ckpt), eval=False)
    spec["metrics"] = {"port": 0}
    doc["metadata"]["name"] = f"plan-bench-{run.key}"
    return doc


def measure(doc: dict[str, Any], work: Path, key: str) -> dict[str, Any]:
    """Run the job (its own Ray, `hybridflow run -q`) and read its step log."""
    ckpt = Path(doc["spec"]["trainer"]["checkpointDir"])
    path = work / f"{key}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    cmd = [str(Path(sys.executable).parent / "hybridflow"), "run", str(path), "-q", "--ray-temp-dir",
           tempfile.mkdtemp(prefix=f"pb{key}", dir=work)]
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"[{key}] {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (ckpt / "steps.jsonl").read_text().splitlines()]
    return {"records": records, "wall": wall, "load": [load0, os.getloadavg()[0]]}


KEPT = ("step", "iteration_seconds", "stages", "rollout_busy_seconds", "trainer_wait_seconds", "dropped_stale",
        "weight_sync_seconds", "update_seconds", "mfu")  # what --json keeps of each step record


def slim(run: dict[str, Any]) -> dict[str, Any]:
    return {**run, "records": [{k: r[k] for k in KEPT if k in r} for r in run["records"]]}


def load_measured(paths: str) -> dict[str, list[dict[str, Any]]]:
    """Runs kept by --json, several files pooled: key -> its runs."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in paths.split(","):
        for key, v in json.loads(Path(path).read_text())["runs"].items():
            out.setdefault(key, []).extend(v if isinstance(v, list) else [v])
    return out


def run_median(run: dict[str, Any]) -> float:
    """A run's median step seconds over its steps after WARMUP and before its last."""
    return statistics.median(r["iteration_seconds"] for r in run["records"][WARMUP:-1])


def least_disturbed(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Of a placement's runs, the one with the lowest median step: on a shared machine other work only ever adds
    time, so the fastest repeat is the least disturbed."""
    return min(runs, key=run_median)


def measured_step(runs: list[dict[str, Any]]) -> float:
    return run_median(least_disturbed(runs))


PREPARE_STAGES = ("old_log_prob", "reference", "values", "cost_values")  # trainer/step.py's remote scoring stages


def measured_stages(runs: list[dict[str, Any]], c: Candidate) -> dict[str, float]:
    """The step log's median seconds per model stage: generate (sync: the stage; otherwise the rollout pool's busy
    time, the trainer's wait being overlap), the colocated transition and the stream (the trainer's `reshard`
    either way), prepare (the scoring stages, which colocated add up), update, and the controller's own work (sync:
    the step less the other stages; otherwise reward and advantages)."""
    rec = least_disturbed(runs)["records"][WARMUP:-1]
    med = lambda f: statistics.median(f(r) for r in rec)  # noqa: E731
    stage = lambda r, *names: sum(r["stages"].get(s, 0.0) for s in names)  # noqa: E731
    sync, own = c.placement.mode == "sync", c.placement.rollout_own
    out = {
        "generate": med(lambda r: stage(r, "generate")) if sync else med(lambda r: r.get("rollout_busy_seconds", 0.0)),
        "transition": 0.0 if own else med(lambda r: stage(r, "reshard")),
        "stream": med(lambda r: stage(r, "reshard")) if own else 0.0,
        "prepare": med(lambda r: stage(r, *PREPARE_STAGES)),
        "update": med(lambda r: stage(r, "actor_update")),
    }
    if sync:
        out["driver"] = med(lambda r: r["iteration_seconds"] - stage(r, "generate", "reshard", "actor_update",
                                                                     *PREPARE_STAGES))
    else:
        out["driver"] = med(lambda r: stage(r, "reward", "advantages"))
    return out


# What --fit fits. The model is affine in each of LINEAR, and in the inverse of the MFU (one for training and
# scoring passes: the same matmuls), once comm_overlap is 0 (gloo's collectives run on the cores that compute:
# nothing hides behind anything on a CPU rank, a structural choice, not a fit); pool_overlap, which multiplies, is
# fitted after them to the steps of the overlapped runs among those fitted on.
LINEAR = ("call_s", "layer_op_s", "collective_latency_s", "optimizer_step_s", "decode_row_s", "kernel_step_s",
          "weight_load_s", "driver_step_s")
INVERSE = ("train_mfu", "forward_mfu")  # fitted as one
FITTED = (*LINEAR, *INVERSE, "pool_overlap")


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 100) -> np.ndarray:
    """Non-negative least squares, min |a x - b| with x >= 0 (Lawson and Hanson's active set)."""
    n = a.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(iterations):
        w = a.T @ (b - a @ x)
        if free.all() or w[~free].max(initial=-np.inf) <= 1e-12:
            break
        free[np.argmax(np.where(free, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            neg = free & (z <= 0)
            x = x + np.min(x[neg] / (x[neg] - z[neg])) * (z - x)
            free &= x > 1e-15
    return x


def fit(job: RLHFJob, shapes: dict, device: DeviceProfile, runs: list[Run], measured: dict[str, list[dict]],
        base: Calibration) -> tuple[Calibration, list[str]]:
    """LINEAR and the MFU (INVERSE) fitted to the measured stage medians of `runs` by non-negative least squares on
    relative residuals (each stage's over its measurement): the prediction is affine in each constant (in 1 / MFU),
    so a constant's column is the prediction with it at 1 less that with all at 0 (sync runs' stages only: an
    overlapped run's stages stretch by the contention pool_overlap stands for). Then pool_overlap, on a grid, to the
    overlapped runs' steps. Returns the calibration and the medians used."""
    zero = replace(base, comm_overlap=0.0, pool_overlap=1.0, **{k: 0.0 for k in LINEAR},
                   **{k: math.inf for k in INVERSE})
    rows, target, used = [], [], []
    for r in runs:
        if r.candidate.placement.mode != "sync":
            continue
        got = measured_stages(measured[r.key], r.candidate)
        at0 = predict(job, shapes, r.candidate, device, zero)[1]
        cols = [predict(job, shapes, r.candidate, device, replace(zero, **{k: 1.0}))[1] for k in LINEAR]
        cols.append(predict(job, shapes, r.candidate, device, replace(zero, **{k: 1.0 for k in INVERSE}))[1])
        for stage, seconds in got.items():
            feature = [c[stage] - at0[stage] for c in cols]
            if seconds <= 0 or not any(feature):
                continue
            rows.append([f / seconds for f in feature])
            target.append((seconds - at0[stage]) / seconds)
            used.append(f"{r.key}.{stage}")
    x = nnls(np.array(rows), np.array(target))
    mfu = min(1.0, 1.0 / x[-1]) if x[-1] > 0 else 1.0
    cal = replace(zero, **{k: float(v) for k, v in zip(LINEAR, x)}, **{k: float(mfu) for k in INVERSE})
    overlapped = [r for r in runs if r.candidate.placement.mode != "sync"]
    if overlapped:
        def error(ov: float) -> float:
            c = replace(cal, pool_overlap=ov)
            return sum((predict(job, shapes, r.candidate, device, c)[0] / measured_step(measured[r.key]) - 1) ** 2
                       for r in overlapped)

        cal = replace(cal, pool_overlap=min(np.linspace(0.0, 1.0, 101), key=error))
        used += [f"{r.key}.step" for r in overlapped]
    return cal, used


def steps_for(predicted: float) -> int:
    return WARMUP + 1 + max(12, min(60, math.ceil(MEASURED_SECONDS / predicted)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="".join(r.key for r in RUNS), help="which placements (letters)")
    ap.add_argument("--steps", type=int, help=f"steps per run (default: about {MEASURED_SECONDS:.0f} s of measured "
                    f"steps by the prediction, 12 to 60, plus the {WARMUP} warm-up steps and the last)")
    ap.add_argument("--repeat", type=int, default=1, help="run the placements this many times, interleaved; each "
                    "placement's least disturbed run (lowest median step) counts")
    ap.add_argument("--predict", action="store_true", help="print the predictions only; run nothing")
    ap.add_argument("--json", help="write each run's step log and the predictions here")
    ap.add_argument("--from-json", help="measurements kept by --json before (comma-separated files are pooled)")
    ap.add_argument("--stages", action="store_true", help="also print each stage's predicted / measured seconds")
    ap.add_argument("--fit", metavar="LETTERS", help="fit the cpu calibration to these runs, print it, and predict "
                    "every run with it (the others are the held-out check)")
    args = ap.parse_args()
    runs = [r for r in RUNS if r.key in args.runs]
    if args.fit and (args.predict or not set(args.fit) <= {r.key for r in runs}):
        ap.error(f"--fit {args.fit}: fit on runs that are measured here (of --runs {args.runs}), not with --predict")
    if args.steps is not None and args.steps < WARMUP + 2:
        ap.error(f"--steps {args.steps}: at least {WARMUP + 2} (the warm-up steps, one measured, the last)")
    kept = json.loads(Path(args.from_json.split(",")[0]).read_text()) if args.from_json else {}
    job = as_measured(load_job(JOB), kept)
    shapes = read_shapes(job.spec, JOB.parent)
    if kept.get("peak_flops"):  # the peak measured with those runs: their predictions, again
        device = calibrated(PROFILES["cpu"], kept["peak_flops"], kept.get("fp32_peak_flops") or None)
    else:
        device = cpu_device(job)
    cal = calibration_for(device)
    enumerated = set(enumerate_candidates(job.spec, shapes, DEVICES, device))
    for r in runs:
        assert r.candidate in enumerated, f"({r.key}) is no candidate the planner enumerates: {describe(r.candidate)}"
    print(f"{machine()} (load average {os.getloadavg()[0]:.1f}); cpu profile: {device.description}, one thread "
          "per device")
    measured: dict[str, list[dict[str, Any]]] = {}
    if args.from_json:
        measured = load_measured(args.from_json)
    elif not args.predict:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="plan-bench") as tmp:
            for i in range(args.repeat):
                for r in runs:
                    steps = args.steps or steps_for(predict(job, shapes, r.candidate, device, cal)[0])
                    doc = job_doc(job, r, device, steps, Path(tmp) / f"run-{r.key}-{i}")
                    print(f"[{r.key}] {describe(r.candidate)}: {steps} steps ...", end=" ", flush=True)
                    measured.setdefault(r.key, []).append(measure(doc, Path(tmp), f"{r.key}-{i}"))
                    got = measured[r.key][-1]
                    print(f"{run_median(got):.3f} s/step (run {got['wall']:.0f} s, load average "
                          f"{got['load'][0]:.1f} -> {got['load'][1]:.1f})", flush=True)
        print(f"(all runs: {time.perf_counter() - t0:.0f} s)")
    fitted_on = ""
    if args.fit:
        cal, used = fit(job, shapes, device, [r for r in runs if r.key in args.fit], measured, cal)
        fitted_on = args.fit
        print(f"\nfitted on runs {', '.join(args.fit)} ({len(used)} medians: {' '.join(used)}):\n  "
              + ",\n  ".join(f"{k}={getattr(cal, k):.3g}" for k in (*FITTED, "comm_overlap")))
    predicted = {r.key: predict(job, shapes, r.candidate, device, cal) for r in runs}
    print_table(runs, predicted, measured, fitted_on)
    if args.stages and measured:
        print("\nper stage, predicted / measured s (medians; an overlapped mode's generate: the rollout pool's busy "
              "time; driver: the controller's own)")
        for r in runs:
            got = measured_stages(measured[r.key], r.candidate)
            print(f"({r.key}) " + "  ".join(f"{k} {predicted[r.key][1][k]:.3f} / {v:.3f}" for k, v in got.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine(), "command": " ".join(["bench/plan.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "peak_flops": device.peak_flops,
            "fp32_peak_flops": device.fp32_peak_flops,
            "fsdp_switches": {k: dump_job(job)["spec"].get("training", {}).get(k, "auto") for k in SWITCHES},
            "runs": {k: [slim(x) for x in v] for k, v in measured.items()}, "predicted": {
            k: {"step": s, "stages": st} for k, (s, st) in predicted.items()}}, indent=1))
    return 0


def print_table(runs: list[Run], predicted: dict, measured: dict, fitted_on: str = "") -> None:
    """The table; then which placement the planner ranks first among these, and how it measured."""
    print("\n| | placement (pool: devices) | mode | layout | predicted s/step | measured s/step | error | "
          "each run's median |")
    print("|---|---|---|---|---:|---:|---:|---|")
    got = {r.key: measured_step(measured[r.key]) for r in runs if r.key in measured}
    for r in runs:
        c = r.candidate
        p, m = predicted[r.key][0], got.get(r.key)
        err = f"{(p - m) / m:+.0%}" if m else "-"
        mark = " (fit)" if r.key in fitted_on else ""
        each = ", ".join(f"{run_median(x):.3f}" for x in measured.get(r.key, []))
        print(f"| {r.key}{mark} | {pools(c)} | {c.placement.mode} | {c.layout.describe()} | {p:.3f} | "
              f"{'-' if m is None else f'{m:.3f}'} | {err} | {each or '-'} |")
    first = min(runs, key=lambda r: predicted[r.key][0])
    print(f"\nplanner's first choice among these: ({first.key}) {describe(first.candidate)}")
    if len(got) == len(runs):
        fastest = min(runs, key=lambda r: got[r.key])
        worst = max(runs, key=lambda r: abs(predicted[r.key][0] / got[r.key] - 1))
        err = abs(predicted[worst.key][0] / got[worst.key] - 1)
        within = got[first.key] <= 1.10 * got[fastest.key]
        print(f"measured fastest: ({fastest.key}) {got[fastest.key]:.3f} s/step; the first choice measured "
              f"{got[first.key]:.3f} s/step, {got[first.key] / got[fastest.key] - 1:+.0%} of it: "
              f"{'goal met' if within else 'goal MISSED'} (within 10%)")
        print(f"largest prediction error: ({worst.key}) {err:.0%}: {'goal met' if err <= 0.25 else 'goal MISSED'} "
              "(within 25%)")


if __name__ == "__main__":
    sys.exit(main())
