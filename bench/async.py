"""Synchronous, one-step-off and asynchronous RL (issue 26) on the same tiny job, in one run, side by side.

The job is examples/tiny-grpo.yaml (tiny Qwen2-style policy, GRPO on the increment task, vLLM generation, FSDP2
actor), run through the real CLI, one Ray per run, in these placements (--modes picks some):
  a  sync, colocated on one pool of 2 ranks (the default: generation and training take turns on the same ranks)
  b  sync, 1 trainer rank + 1 rollout rank (weights streamed to the rollout pool after every update)
  c  one_step_off, 1 + 1 (batch k+1 generates while batch k trains)
  d  async, maxStaleness 2, 1 + 1 (a producer keeps generating into a queue)
  e  async, maxStaleness 2, partialRolloutTokens 2, 1 + 1
Per mode: steps/s and tokens/s over the steps after the first 2 (warm-up), the ratio to (a), each side's idle
fraction, staleness, weight-sync seconds and bytes per sync, held-out reward before/after (greedy, 64 prompts).
This machine is noisy (and a 2-core one runs both sides of an "apart" job on the same cores): compare within one
invocation, not across them.

Then a PROJECTION: the modes' iteration formulas applied, first to the stage times measured here (a check of the
formulas against what was measured), then to a 7B actor on 8/64/512 H100-class GPUs, with every assumption printed.
That part is arithmetic from a cost model, not a measurement. `project` is a pure function
(tests/support_tests/test_bench_async.py).

Usage: python bench/async.py [--steps 40] [--modes abcde] [--gpus 8,64,512] [--rollout-share 0.5]
                             [--dry-run] [--json OUT] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))

from hybridflow.flops import forward_flops, training_flops  # noqa: E402

WARMUP = 2  # the first steps pay one-off costs (vLLM's first calls, the async queue filling)
APART = {"resourcePools": [{"name": "trainer", "devicesPerNode": 1}, {"name": "rollout", "devicesPerNode": 1}],
         "placement": {"actor": "trainer", "rollout": "rollout"}}


@dataclass(frozen=True)
class Mode:
    title: str
    formula: str  # its key in FORMULAS
    patch: dict[str, Any]  # spec sections that differ from examples/tiny-grpo.yaml


MODES = {
    "a": Mode("sync colocated 2", "sync colocated", {"rollout": {"mode": "sync"}}),
    "b": Mode("sync 1+1", "sync apart", {"rollout": {"mode": "sync"}, **APART}),
    "c": Mode("one_step_off 1+1", "one_step_off", {"rollout": {"mode": "one_step_off"}, **APART}),
    "d": Mode("async s=2 1+1", "async", {"rollout": {"mode": "async", "maxStaleness": 2}, **APART}),
    "e": Mode("async s=2 partial", "async", {"rollout": {"mode": "async", "maxStaleness": 2,
                                                         "partialRolloutTokens": 2}, **APART}),
}


# -- the cost model (pure) ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stages:
    """Seconds of one step's work on each side: `sync` is one whole weight transfer, `swap` the part of it an
    overlapped (async) transfer still exposes: putting the received copy in place."""
    generate: float
    train: float
    sync: float
    swap: float = 0.0


def _in_turn(s: Stages, staleness: int) -> float:
    """sync, colocated (the same devices take turns: nobody idles, the reshard is paid) or apart (each side waits
    for the other): the placements differ in their stage times, not in how the stages add up."""
    return s.generate + s.train + s.sync


def _one_step_off(s: Stages, staleness: int) -> float:
    return max(s.generate, s.train) + s.sync  # overlapped; the transfer sits between two steps on both sides


def _async(s: Stages, staleness: int) -> float:
    if staleness < 1:  # nothing may be generated ahead of the weights: it degenerates to sync apart
        return _in_turn(s, staleness)
    return max(s.generate + s.swap, s.train, s.sync)  # the transfer is a pipeline stage of its own


FORMULAS: dict[str, Callable[[Stages, int], float]] = {
    "sync colocated": _in_turn, "sync apart": _in_turn, "one_step_off": _one_step_off, "async": _async,
}
FORMULA_TEXT = {
    "sync colocated": "gen(all G) + train(all G) + reshard (no idle side; the context switch is not counted)",
    "sync apart": "gen(Gr) + train(Gt) + sync (each side idles while the other works)",
    "one_step_off": "max(gen, train) + sync (both sides stop for the transfer between steps)",
    "async": "max(gen + swap, train, sync) for maxStaleness >= 1 (the transfer overlaps both sides, a pipeline "
             "stage of its own that the staleness bound absorbs; the rollout side pays the swap; maxStaleness 0 is "
             "sync apart)",
}
OFF_POLICY = {"one_step_off", "async"}  # the trainer runs its own old-log-prob pass (trainer/step.py)


@dataclass(frozen=True)
class Workload:
    """One RL step of a 7B actor; the batch shape follows the HybridFlow paper's evaluation (1024 prompts,
    1024-token prompts and responses)."""
    params: float = 7e9
    sequences: int = 1024
    prompt_tokens: int = 1024
    response_tokens: int = 1024
    forward_passes: int = 1  # besides the update: the reference model's log-probs
    weight_bytes_per_param: int = 2  # bf16 weights travel


@dataclass(frozen=True)
class Cluster:
    """H100-class numbers, all assumptions (none measured here)."""
    peak_flops: float = 989e12  # H100 SXM dense bf16
    mfu: float = 0.35  # training
    decode_tokens_per_s_per_gpu: float = 2500.0  # vLLM-class 7B decode at large batch, long tail included
    decode_step_s: float = 0.02  # one decode step; a response's steps are serial, a floor on generation
    reshard_bytes_per_s: float = 300e9  # colocated: all-gather over NVLink inside a node (3D-HybridEngine)
    link_bytes_per_s: float = 25e9  # apart: trainer -> rollout pool, one 200 Gb/s-class link, pipelined broadcast
    hbm_bytes_per_s: float = 3.35e12  # async: the received copy put in place


def split_gpus(gpus: int, rollout_share: float) -> tuple[int, int]:
    """(trainer GPUs, rollout GPUs) of an apart placement; both sides need one at least."""
    if gpus < 2:
        raise ValueError(f"--gpus: {gpus} GPUs cannot be split into a trainer and a rollout side; give 2 or more")
    if not 0.0 < rollout_share < 1.0:
        raise ValueError(f"--rollout-share {rollout_share}: give the rollout side's fraction, between 0 and 1")
    rollout = min(gpus - 1, max(1, round(gpus * rollout_share)))
    return gpus - rollout, rollout


def stage_times(w: Workload, c: Cluster, train_gpus: int, rollout_gpus: int, colocated: bool,
                off_policy: bool) -> Stages:
    """The cost model's seconds per stage for one placement."""
    tokens = w.sequences * (w.prompt_tokens + w.response_tokens)
    passes = w.forward_passes + (1 if off_policy else 0)
    flops = training_flops(int(w.params), tokens) + passes * forward_flops(int(w.params), tokens)
    train = flops / (train_gpus * c.mfu * c.peak_flops)
    generate = max(w.sequences * w.response_tokens / (rollout_gpus * c.decode_tokens_per_s_per_gpu),
                   w.response_tokens * c.decode_step_s)
    weights = w.params * w.weight_bytes_per_param
    sync = weights / (c.reshard_bytes_per_s if colocated else c.link_bytes_per_s)
    return Stages(generate, train, sync, swap=weights / c.hbm_bytes_per_s)


def project(formula: str, gpus: int, rollout_share: float, staleness: int = 2, w: Workload = Workload(),
            c: Cluster = Cluster()) -> tuple[Stages, float]:
    """(stage times, iteration seconds) of one mode's formula on `gpus` GPUs."""
    if formula not in FORMULAS:
        raise ValueError(f"unknown formula {formula!r}; one of {sorted(FORMULAS)}")
    if formula == "sync colocated":
        st = stage_times(w, c, gpus, gpus, colocated=True, off_policy=False)
    else:
        st = stage_times(w, c, *split_gpus(gpus, rollout_share), colocated=False, off_policy=formula in OFF_POLICY)
    return st, FORMULAS[formula](st, staleness)


# -- the runs --------------------------------------------------------------------------------------------------

def job_doc(base: dict, key: str, steps: int, ckpt: Path) -> dict:
    """examples/tiny-grpo.yaml with mode `key`'s sections, `steps` steps, no checkpoints but the last, no metrics."""
    mode = MODES[key]
    doc = json.loads(json.dumps(base))
    spec = doc["spec"]
    for section, fields in mode.patch.items():
        if isinstance(fields, dict) and section != "placement":
            spec.setdefault(section, {}).update(fields)
        else:
            spec[section] = fields
    spec["trainer"].update(steps=steps, saveFreq=0, checkpointDir=str(ckpt))
    spec["metrics"] = {"port": 0}
    doc["metadata"]["name"] = f"async-bench-{key}"
    return doc


def run_job(doc: dict, work: Path, key: str) -> tuple[list[dict], dict, float]:
    ckpt = Path(doc["spec"]["trainer"]["checkpointDir"])
    path = work / f"{key}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cmd = [sys.executable, "-m", "hybridflow.cli", "run", str(path), "-q", "--ray-temp-dir",
           tempfile.mkdtemp(prefix=f"ab{key}", dir=work)]
    print(f"[{key}] {MODES[key].title}: {doc['spec']['trainer']['steps']} steps ...", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=work)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (ckpt / "steps.jsonl").read_text().splitlines()]
    return records, json.loads((ckpt / "summary.json").read_text()), wall


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(records: list[dict], summary: dict, wall: float) -> dict[str, float | None]:
    """One mode's row values from its steps.jsonl and summary.json. Rates are over the steps after WARMUP (steps /
    their summed iteration seconds). A colocated job has no idle side and no stream: those read None."""
    rec = records[WARMUP:] or records
    secs = sum(r["iteration_seconds"] for r in rec)
    get = lambda key: [r[key] for r in rec if key in r]  # noqa: E731
    trained = [sum(v for k, v in r["stages"].items() if k not in ("generate", "reshard")) for r in rec]
    streamed = bool(get("weight_sync_seconds"))
    return {
        "steps/s": len(rec) / secs,
        "tokens/s": sum(r["tokens"] for r in rec) / secs,
        "iteration s (median)": _median(get("iteration_seconds")),
        # apart: the rollout side's busy time (the stage is the trainer's wait); colocated: the stage itself
        "generation s/step": _median(get("rollout_busy_seconds") if streamed else
                                     [r["stages"]["generate"] for r in rec]),
        "trainer waits for batch s": _median([r["stages"]["generate"] for r in rec]),
        "train s/step": _median(trained),
        "sync s/step (trainer)": _median([r["stages"].get("reshard", 0.0) for r in rec]),
        "weight-sync s/sync": _median(get("weight_sync_seconds") if streamed else
                                      [r["stages"].get("reshard", 0.0) for r in rec]),
        "weight-sync MB/sync": _median([b / 1e6 for b in get("weight_sync_bytes" if streamed else "reshard_bytes")]),
        "trainer idle fraction": _median(get("trainer_idle_fraction")),
        "rollout idle fraction": _median(get("rollout_idle_fraction")),
        "staleness mean": statistics.mean(get("staleness_mean")) if get("staleness_mean") else None,
        "staleness max": max(get("staleness_max"), default=None),
        "dropped stale (total)": max(get("dropped_stale_total"), default=None),
        "rollout log-prob gap": _median(get("rollout_log_prob_gap")),
        "reward (last step)": records[-1]["reward_mean"],
        "held-out reward before": summary.get("eval_before"),
        "held-out reward after": summary.get("eval_after"),
        "run wall s (with start-up)": wall,
    }


def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def print_table(results: dict[str, dict[str, float | None]], steps: int) -> None:
    keys = list(results)
    head = {k: f"({k}) {MODES[k].title}" for k in keys}
    width = max(len(h) for h in head.values()) + 2
    label = 30
    print(f"\ntiny-grpo, {steps} steps per mode; rates over steps {WARMUP + 1}..{steps}; '-': not measured in that mode"
          " (colocated: no idle side, no stream)")
    print(f"{'':<{label}}" + "".join(f"{head[k]:>{width}}" for k in keys))
    base = results.get("a")
    for row in next(iter(results.values())):
        print(f"{row:<{label}}" + "".join(f"{_cell(results[k][row]):>{width}}" for k in keys))
        if row in ("steps/s", "tokens/s") and base:
            ratio = {k: results[k][row] / base[row] for k in keys}
            print(f"{'  ' + row + ' vs (a)':<{label}}" + "".join(f"{ratio[k]:>{width - 1}.2f}x" for k in keys))


def measured_stages(row: dict[str, float | None], colocated: bool) -> Stages:
    """A mode's measured seconds per stage: generation is the rollout side's busy time, sync the trainer's reshard
    (colocated) or the stream's seconds (apart); swap is not measured apart from the sync, taken as 0."""
    sync = row["sync s/step (trainer)"] if colocated else row["weight-sync s/sync"]
    return Stages(row["generation s/step"] or 0.0, row["train s/step"] or 0.0, sync or 0.0)


def print_measured_check(results: dict[str, dict[str, float | None]]) -> None:
    """The formulas on the stage times measured here: each mode's own (did the overlap happen?), and (b)'s for the
    apart modes (what the overlap would give if the stages kept their sync-apart lengths)."""
    print("\nPROJECTION, part 1: the formulas on the stage times measured above, against the measured median "
          "iteration."
          "\n  own: the mode's own gen/train/sync (measured/own near 1: the overlap happened as the formula says);"
          "\n  (b)'s: sync 1+1's stages (one_step_off and async also run an old-log-prob pass, and on a 2-core machine"
          "\n  both sides of an apart job share the cores, so their stages grow: measured/(b)'s shows what that "
          "costs).")
    print(f"{'mode':<24}{'gen s':>8}{'train s':>9}{'sync s':>8}{'own s':>8}{'(b) s':>8}"
          f"{'measured s':>12}{'measured/own':>14}{'measured/(b)':>14}")
    b = results.get("b")
    for key, res in results.items():
        formula = MODES[key].formula
        own = measured_stages(res, formula == "sync colocated")
        it = FORMULAS[formula](own, 2)
        via_b = FORMULAS[formula](measured_stages(b, False), 2) if b and formula != "sync colocated" else None
        got = res["iteration s (median)"] or 0.0
        print(f"({key}) {MODES[key].title:<20}{own.generate:>8.3f}{own.train:>9.3f}{own.sync:>8.3f}{it:>8.3f}"
              f"{_cell(via_b):>8}{got:>12.3f}{got / it if it else float('nan'):>13.2f}x"
              + (f"{got / via_b:>13.2f}x" if via_b else f"{'-':>14}"))


def print_projection(gpu_counts: list[int], rollout_share: float, staleness: int) -> dict[str, Any]:
    w, c = Workload(), Cluster()
    tokens = w.sequences * (w.prompt_tokens + w.response_tokens)
    lines = [
        "PROJECTION, part 2: ARITHMETIC FROM A COST MODEL, NOT A MEASUREMENT AND NOT A CLAIM. Assumptions:",
        f"  actor: {w.params / 1e9:.0f}B dense, bf16 weights on the wire: 2N = {w.params * 2 / 1e9:.0f} GB per sync",
        f"  step: {w.sequences} sequences x ({w.prompt_tokens} prompt + {w.response_tokens} response) tokens = "
        f"{tokens / 1e6:.2f}M tokens (the HybridFlow paper's evaluation shape)",
        f"  train: 6*N*T (update) + 2*N*T per forward pass ({w.forward_passes}: reference; +1 old-log-prob pass in "
        f"one_step_off/async, as trainer/step.py runs them), / (trainer GPUs x MFU {c.mfu:.0%} x "
        f"{c.peak_flops / 1e12:.0f} TFLOP/s, H100 SXM dense bf16)",
        f"  generate: response tokens / (rollout GPUs x {c.decode_tokens_per_s_per_gpu:.0f} tok/s per GPU, "
        f"vLLM-class 7B decode), at least {w.response_tokens} serial decode steps x {c.decode_step_s * 1e3:.0f} ms; "
        "prefill not counted; replicas of TP 1",
        f"  sync: colocated reshard 2N / {c.reshard_bytes_per_s / 1e9:.0f} GB/s (NVLink all-gather in a node); apart "
        f"2N / {c.link_bytes_per_s / 1e9:.0f} GB/s (one link, pipelined broadcast: independent of the rollout GPU "
        f"count); async swap 2N / {c.hbm_bytes_per_s / 1e12:.2f} TB/s (HBM copy)",
        f"  split: apart modes give {rollout_share:.0%} of the GPUs to rollout (--rollout-share); async maxStaleness "
        f"{staleness}",
        *(f"  {name}: {text}" for name, text in FORMULA_TEXT.items()),
        "  not modelled: stage-time variance and long-tail responses (what async and partial rollouts mostly win on),"
        " the extra step of staleness' effect on learning, memory limits; partial rollouts project as async",
    ]
    print("\n" + "\n".join(lines))
    print(f"{'GPUs':>5}{'trainer+rollout':>17}  {'mode':<16}{'gen s':>9}{'train s':>9}{'sync s':>8}{'iteration s':>13}"
          f"{'vs colocated':>14}")
    out: dict[str, Any] = {}
    for g in gpu_counts:
        t, r = split_gpus(g, rollout_share)
        base = project("sync colocated", g, rollout_share, staleness)[1]
        for formula in FORMULAS:
            st, it = project(formula, g, rollout_share, staleness)
            split = f"{g} shared" if formula == "sync colocated" else f"{t}+{r}"
            print(f"{g:>5}{split:>17}  {formula:<16}{st.generate:>9.2f}{st.train:>9.2f}{st.sync:>8.2f}{it:>13.2f}"
                  f"{base / it:>13.2f}x")
            out[f"{g}/{formula}"] = {**asdict(st), "iteration": it, "speedup": base / it}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="steps per mode; the first 2 are left out of the rates")
    ap.add_argument("--modes", default="abcde", help="which of a b c d e to run (a and b feed the model check)")
    ap.add_argument("--job", default=str(ROOT / "examples" / "tiny-grpo.yaml"), help="the base manifest")
    ap.add_argument("--gpus", default="8,64,512", help="GPU counts to project to")
    ap.add_argument("--rollout-share", type=float, default=0.5, help="fraction of the GPUs apart modes give rollout")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate each mode's job (parse_job) and print the 7B projection; run nothing")
    ap.add_argument("--json", help="write the measured table and the projection here as JSON too")
    ap.add_argument("--keep", help="run in this directory and keep it (default: a temporary one)")
    args = ap.parse_args()
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        ap.error(f"--modes {args.modes!r}: use letters of {''.join(MODES)}")
    if args.steps <= WARMUP:
        ap.error(f"--steps {args.steps}: more than the {WARMUP} warm-up steps are needed")
    try:  # a bad count or share fails before any run
        gpu_counts = [int(g) for g in args.gpus.split(",")]
        for g in gpu_counts:
            split_gpus(g, args.rollout_share)
    except ValueError as e:
        ap.error(f"--gpus {args.gpus!r} / --rollout-share {args.rollout_share}: {e}")
    results: dict[str, dict[str, float | None]] = {}
    base = yaml.safe_load(Path(args.job).read_text())
    if args.dry_run:
        from hybridflow.api import parse_job

        for key in sorted(set(args.modes)):
            spec = parse_job(job_doc(base, key, args.steps, Path(tempfile.gettempdir()) / f"async-bench-{key}")).spec
            print(f"ok  ({key}) {MODES[key].title}: mode {spec.rollout.mode}, pools "
                  + " + ".join(f"{p.name} x {p.world_size}" for p in spec.resource_pools))
    else:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="async-bench") as tmp:
            work = Path(args.keep or tmp)
            work.mkdir(parents=True, exist_ok=True)
            for key in sorted(set(args.modes)):
                doc = job_doc(base, key, args.steps, work / f"run-{key}")
                results[key] = summarise(*run_job(doc, work, key))
        print_table(results, args.steps)
        print(f"(all runs: {time.perf_counter() - t0:.0f} s)")
        print_measured_check(results)
    projection = print_projection(gpu_counts, args.rollout_share, staleness=2)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "projection": projection}, indent=1))


if __name__ == "__main__":
    main()
