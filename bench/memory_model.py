"""The memory model (hybridflow.memory) against measured per-rank peaks on this machine.

Runs small CPU jobs one after another (`nice -n 5 hybridflow run`, 2 steps each), reads each rank's peak from the
step log (`actor_peak_memory_bytes`: the largest rank's resident high-water mark over the update, which includes
the process runtime: the `cpu` profile's runtime term), and prints predicted against measured and their ratio, side by side.

    .venv/bin/python bench/memory_model.py            # every configuration (about 8 minutes on 2 cores)
    .venv/bin/python bench/memory_model.py --predict  # the predictions only
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from hybridflow.api import parse_job
from hybridflow.memory import pool_plans, read_shapes

GIB = 1 << 30
TINY_S = {"vocabSize": 16, "hiddenSize": 64, "numHeads": 2, "numKvHeads": 1, "numLayers": 2}
TINY_L = {"vocabSize": 4096, "hiddenSize": 512, "intermediateSize": 2048, "numHeads": 8, "numKvHeads": 2,
          "numLayers": 8, "tieEmbeddings": False}


def job(name: str, model: dict[str, Any], ranks: int, mbs: int, prompts: int, n: int, lengths: tuple[int, int],
        **training: Any) -> dict[str, Any]:
    """A 2-step GRPO job (the reference on: klCoef > 0) on one CPU pool of `ranks` ranks."""
    task = "increment" if model["source"] == "tiny" else "arithmetic"
    return {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": name}, "spec": {
        "algorithm": {"name": "grpo", "klCoef": 0.001},
        "models": {"actor": model},
        "data": {"task": task, "trainPrompts": 4 * prompts, "evalPrompts": 8},
        "rollout": {"engine": "vllm", "responsesPerPrompt": n, "maxPromptLength": lengths[0],
                    "maxResponseLength": lengths[1]},
        "training": {"microBatchSize": mbs, "actorLr": 1e-6, "computeDtype": "float32", **training},
        "resourcePools": [{"name": "default", "devicesPerNode": ranks}],
        "trainer": {"steps": 2, "promptsPerStep": prompts, "eval": False, "checkpointDir": f"/tmp/{name}"},
        "metrics": {"port": 0}}}


CONFIGS = [
    job("mm-tiny-2r", {"source": "tiny", "tiny": TINY_S}, 2, 64, 32, 8, (8, 6)),
    job("mm-tinyl-1r", {"source": "tiny", "tiny": TINY_L}, 1, 64, 32, 8, (8, 6)),
    job("mm-tinyl-2r-mb16", {"source": "tiny", "tiny": TINY_L}, 2, 16, 32, 8, (8, 6)),
    job("mm-smol-2r-mb8", {"source": "smollm2"}, 2, 8, 8, 4, (48, 12)),
    job("mm-smol-1r-mb4", {"source": "smollm2"}, 1, 4, 8, 4, (48, 12)),
    job("mm-smol-2r-mb16", {"source": "smollm2"}, 2, 16, 16, 4, (48, 12)),
    job("mm-smol-2r-unshared", {"source": "smollm2"}, 2, 8, 8, 4, (48, 12), sharedPrompt=False),
    job("mm-smol-2r-bf16", {"source": "smollm2"}, 2, 8, 8, 4, (48, 12), computeDtype="bfloat16"),
]


def describe(doc: dict[str, Any]) -> str:
    s = doc["spec"]
    model = s["models"]["actor"]
    name = "smollm2" if model["source"] == "smollm2" else f"tiny h{model['tiny']['hiddenSize']}"
    t = s["training"]
    extra = "" if t.get("sharedPrompt", True) else ", unshared"
    return (f"{name}, {s['resourcePools'][0]['devicesPerNode']} ranks, mbs {t['microBatchSize']}, "
            f"{s['trainer']['promptsPerStep']}x{s['rollout']['responsesPerPrompt']}, {t['computeDtype']}{extra}")


def predicted(doc: dict[str, Any]) -> tuple[int, str]:
    """The model's per-rank peak and its phase (the actor's pool, the `cpu` profile's runtime term)."""
    spec = parse_job(doc, doc["metadata"]["name"]).spec
    plan = pool_plans(spec, read_shapes(spec, Path(".")), native_bf16=False)[0]
    return plan.peak, plan.peak_phase


def measured(doc: dict[str, Any], hybridflow: str) -> int | None:
    """The largest rank's peak over the run's steps, from the step log (None, with the error, if the run failed)."""
    ckpt = Path(doc["spec"]["trainer"]["checkpointDir"])
    subprocess.run(["rm", "-rf", str(ckpt)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(doc, f)
        run = subprocess.run(["nice", "-n", "5", hybridflow, "run", f.name, "-q"], capture_output=True, text=True)
    if run.returncode:
        print(f"{doc['metadata']['name']}: exit {run.returncode}: {run.stderr[-600:]}", file=sys.stderr)
        return None
    steps = [json.loads(line) for line in (ckpt / "steps.jsonl").read_text().splitlines()]
    return int(max(s["actor_peak_memory_bytes"] for s in steps))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--predict", action="store_true", help="print the predictions only (runs nothing)")
    p.add_argument("--only", nargs="*", help="configuration names to run")
    args = p.parse_args()
    hybridflow = str(Path(sys.executable).with_name("hybridflow"))
    print("| configuration | phase | predicted (GiB) | measured (GiB) | predicted / measured |")
    print("|---|---|---:|---:|---:|")
    for doc in CONFIGS:
        if args.only and doc["metadata"]["name"] not in args.only:
            continue
        peak, phase = predicted(doc)
        got = None if args.predict else measured(doc, hybridflow)
        ratio = f"{peak / got:.2f}" if got else "-"
        print(f"| {describe(doc)} | {phase} | {peak / GIB:.2f} | {got / GIB if got else 0:.2f} | {ratio} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
