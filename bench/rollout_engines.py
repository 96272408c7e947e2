"""The tiny example with vLLM generation and with the plain HF engine, in one run; prints throughput and the
per-stage breakdown side by side, with the ratio vLLM / HF (>1 means vLLM is larger: faster for tokens/s,
slower for seconds). Usage: python bench/rollout_engines.py [JOB.yaml] [--steps N] [--n N] [--response-length N]"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3  # first steps include compilation and allocator warm-up


def run(job: Path, engine: str, steps: int, work: Path) -> list[dict]:
    ckpt = work / engine
    cmd = [sys.executable, "-m", "hybridflow.cli", "run", str(job), "--engine", engine, "--steps", str(steps),
           "--checkpoint-dir", str(ckpt), "--metrics-port", "0", "-q", "--ray-temp-dir", tempfile.mkdtemp(prefix="rb")]
    subprocess.run(cmd, check=True, cwd=work)
    return [json.loads(line) for line in (ckpt / "steps.jsonl").read_text().splitlines()][WARMUP:]


def summarise(records: list[dict]) -> dict[str, float]:
    keys = ["throughput_tokens_per_s", "generation_tokens_per_s", "iteration_seconds"]
    out = {k: statistics.median(r[k] for r in records) for k in keys}
    for stage in records[0]["stages"]:
        if stage != "checkpoint":
            out[f"{stage} s"] = statistics.median(r["stages"].get(stage, 0.0) for r in records)
    out["reward (last step)"] = records[-1]["reward_mean"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("job", nargs="?", default=str(ROOT / "examples" / "tiny-grpo.yaml"))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--n", type=int, help="responses per prompt (override)")
    ap.add_argument("--response-length", type=int, help="maxResponseLength (override)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        doc = yaml.safe_load(Path(args.job).read_text())
        doc["spec"]["trainer"]["saveFreq"] = 0
        if args.n:
            doc["spec"]["rollout"]["responsesPerPrompt"] = args.n
        if args.response_length:
            doc["spec"]["rollout"]["maxResponseLength"] = args.response_length
        job = work / "job.yaml"
        job.write_text(yaml.safe_dump(doc))
        results = {engine: summarise(run(job, engine, args.steps, work)) for engine in ("vllm", "hf")}
    v, h = results["vllm"], results["hf"]
    print(f"\n{Path(args.job).name}: median over steps {WARMUP + 1}..{args.steps}")
    print(f"{'metric':<28}{'vllm':>12}{'hf':>12}{'vllm/hf':>10}")
    for key in v:
        ratio = v[key] / h[key] if h.get(key) else float("nan")
        print(f"{key:<28}{v[key]:>12.3f}{h.get(key, float('nan')):>12.3f}{ratio:>10.2f}")


if __name__ == "__main__":
    main()
