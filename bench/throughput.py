"""Tokens/s and memory of a real RLHF job, today's behaviour against the defaults, in one run.

The job (issue 14): SmolLM2-135M-Instruct, GRPO on the arithmetic task, 16 prompts x 4 responses, ~44-token
prompts, responses up to 32 tokens, no KL (no reference), one epoch over one mini-batch, two CPU ranks.
"baseline" switches every throughput optimisation off through spec fields (fp32 compute, fixed-width micro-batches,
a separate old-log-prob pass, a fixed 1 GiB KV cache, every prompt's rows run unshared, no prefix caching in vLLM,
the C library's malloc instead of tcmalloc); "defaults" leaves them on. With --each, every
optimisation is also measured alone on top of the baseline; with --ablate, the defaults without each one in turn
(`--ablate "shared prompt"`: only that one), which is what each is worth where the others already run. A feature
the defaults leave off is ablated the other way: `--ablate lora` runs the defaults beside the defaults with
spec.training.lora (rank 16 adapters on a frozen base, at 10x the learning rate), so the table compares full
fine-tuning with LoRA: summed peak memory, the bytes each weight sync moves into generation, tokens/s.
`--ablate "one rank"` runs the same cores as one rank of two threads (spec.resourcePools[].devicesPerNode 1,
cpusPerDevice 2) beside the defaults' two ranks of one thread; `"one rank kept gathered"` the same with
keepGatheredForBackward and reduceGradientsPerStep forced on (auto leaves them off on one rank).

Prints per run: tokens/s (prompt + response tokens of the batch / iteration seconds, the paper's definition), seconds
per stage, peak memory per rank (max) and summed over ranks, the weight sync's bytes (into generation, and gathered
from other ranks), and the actor update's and the old-log-prob pass's FLOP/s over this machine's matmul peak, which
the bench measures itself (one thread's on every core the job computes on, in the dtype each run computes in; 6N
FLOPs a token, with LoRA 4N + 2 x the adapters': its frozen base has no weight gradients). Those count the batch's
tokens, every row's prompt (throughput-equivalent): with shared prompts the ranks compute a group's prompt once, so
the ratio is not an MFU and can pass 1. The job's own MFU (its step records' `mfu`: the tokens computed, over the
peaks its ranks measured) comes beside them.
Then the ratio defaults / baseline.

With --gpu (bench/gpu_check.sh): one GPU rank, a 0.5B-class Qwen2-style model built from its config (random
weights, the synthetic increment task), 64 prompts x 4 responses.

Prints first what the CPU can do (AVX-512, native bf16) and the compute dtype `auto` chose on it.

With --model qwen2-0.5b the CPU job's actor is a random Qwen2-0.5B-shaped model (bench/model_dirs.py). With --trl,
TRL's GRPOTrainer then runs the same job on the same model directory (bench/trl_grpo.py, in its own venv .venv-trl:
`bash bench/trl_venv.sh`), and a side-by-side table prints tokens/s and summed peak memory, ours (the defaults) / TRL.

Usage: python bench/throughput.py [--steps 4] [--each] [--ablate [NAME ...]] [--gpu] [--model {smollm2,qwen2-0.5b}]
       [--trl] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))

from hybridflow.capacity import SMOLLM2_PARAMS, tiny_params  # noqa: E402
from hybridflow.flops import forward_flops, matmul_peak_flops, training_flops  # noqa: E402
from hybridflow.api import TinyModel  # noqa: E402
from hybridflow.profiling import PREFIX, profile_report  # noqa: E402

RANKS = 2
JOB = {
    "apiVersion": "hybridflow.io/v1alpha1",
    "kind": "RLHFJob",
    "metadata": {"name": "throughput"},
    "spec": {
        "algorithm": {"name": "grpo", "klCoef": 0.0},
        "models": {"actor": {"source": "smollm2"}, "reference": False},
        "data": {"task": "arithmetic", "trainPrompts": 512, "evalPrompts": 16},
        "rollout": {"engine": "vllm", "responsesPerPrompt": 4, "maxPromptLength": 48, "maxResponseLength": 32},
        "training": {"microBatchSize": 8, "actorLr": 2e-6},
        "trainer": {"promptsPerStep": 16, "eval": False, "saveFreq": 0},
        "resourcePools": [{"name": "default", "devicesPerNode": RANKS}],
        "metrics": {"port": 0},
    },
}
# Each optimisation as the spec fields that switch it off (today's behaviour).
OPTIMISATIONS = {
    "on-policy old log-probs": {"training": {"onPolicyOldLogProbs": False}},
    "dynamic batch size": {"training": {"dynamicBatchSize": False}},
    "bf16 compute": {"training": {"computeDtype": "float32"}},
    "job-sized KV cache": {"rollout": {"kvCacheGib": 1}},
    "shared prompt": {"training": {"sharedPrompt": False}},
    "prefix caching": {"rollout": {"prefixCaching": False}},
    "tcmalloc": {"resourcePools": {"allocator": "system"}},  # every pool
    "keep gathered for backward": {"training": {"keepGatheredForBackward": "off"}},
    "reduce gradients per step": {"training": {"reduceGradientsPerStep": "off"}},
    "skip zero-advantage rows": {"training": {"skipZeroAdvantageRows": False}},
    "fp32 attention backward": {"training": {"fp32AttentionBackward": "off"}},
}
# Each feature the defaults leave off, as the spec fields that switch it on (issue 54: LoRA against full fine-tuning,
# at the ~10x learning rate LoRA wants).
ONE_RANK = {"devicesPerNode": 1, "cpusPerDevice": RANKS}  # every pool: the same cores as one rank
FEATURES = {
    "lora": {"training": {"lora": {"rank": 16, "alpha": 32}, "actorLr": 2e-5}},
    # the same cores as one rank of RANKS threads: no gathers, one runtime and one vLLM engine instead of RANKS
    "one rank": {"resourcePools": ONE_RANK},
    # one rank with FSDP2's bf16 copies of the weights kept through the update (where it computes in bf16 from fp32
    # masters, each gather is a cast): fewer casts for the whole model in bf16 held through it
    "one rank kept gathered": {"resourcePools": ONE_RANK,
                               "training": {"keepGatheredForBackward": "on", "reduceGradientsPerStep": "on"}},
}
# --ablate NAME: the run beside the defaults, named "<how> NAME", and the patch that makes it
ABLATIONS = ({n: ("without", patch) for n, patch in OPTIMISATIONS.items()}
             | {n: ("with", patch) for n, patch in FEATURES.items()})
# The step log's weight-sync fields (trainer/generation/weight_sync.py), in MB: into generation, gathered from others
SYNC_FIELDS = {"sync MB into generation (max rank)": "generation_weight_bytes",
               "sync MB gathered (mean rank)": "reshard_bytes"}
STAGES = ("generate", "old_log_prob", "actor_update", "reshard")
# Qwen2-0.5B's shape (494M parameters with its 151k vocabulary; 360M with this 32k one), built from config on the GPU.
GPU_MODEL = {"vocabSize": 32000, "hiddenSize": 896, "intermediateSize": 4864, "numLayers": 24, "numHeads": 14,
             "numKvHeads": 2}
GPU_PATCH = {
    "models": {"actor": {"source": "tiny", "tiny": GPU_MODEL}, "reference": False},
    "data": {"task": "increment", "trainPrompts": 2048, "evalPrompts": 64},
    "rollout": {"maxPromptLength": 64, "maxResponseLength": 128},
    "training": {"microBatchSize": 32},
    "trainer": {"promptsPerStep": 64},
    "resourcePools": [{"name": "default", "devicesPerNode": 1, "device": "gpu", "memoryPerNode": "64Gi"}],
}


def merged(base: dict, *patches: dict) -> dict:
    out = json.loads(json.dumps(base))
    for patch in patches:
        for section, fields in patch.items():
            if isinstance(fields, dict) and isinstance(out["spec"].get(section), list):  # each item of a list
                for item in out["spec"][section]:
                    item.update(fields)
            elif isinstance(fields, dict):
                out["spec"].setdefault(section, {}).update(fields)
            else:
                out["spec"][section] = fields
    return out


def variants(each: bool, gpu: bool, ablate: list[str] | None = None) -> dict[str, dict]:
    """The runs: the baseline and the defaults, or with `ablate` the defaults and the defaults without each named
    optimisation (all of them when the list is empty) or with each named feature."""
    job = merged(JOB, GPU_PATCH) if gpu else JOB
    if ablate is not None:
        unknown = sorted(set(ablate) - set(ABLATIONS))
        if unknown:
            raise SystemExit(f"--ablate: no optimisation or feature {unknown}; there are {sorted(ABLATIONS)}")
        return {"defaults": job} | {f"{ABLATIONS[n][0]} {n}": merged(job, ABLATIONS[n][1])
                                    for n in ablate or OPTIMISATIONS}
    off = list(OPTIMISATIONS.values())
    runs = {"baseline": merged(job, *off), "defaults": job}
    if each:
        for name in OPTIMISATIONS:
            runs[f"only {name}"] = merged(job, *[p for n, p in OPTIMISATIONS.items() if n != name])
    return runs


def run_job(doc: dict, steps: int, work: Path, name: str) -> list[dict]:
    ckpt = work / name.replace(" ", "_")
    doc = merged(doc, {"trainer": {"steps": steps, "checkpointDir": str(ckpt)}})
    path = work / f"{ckpt.name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cmd = [sys.executable, "-m", "hybridflow.cli", "run", str(path), "-q", "--ray-temp-dir",
           tempfile.mkdtemp(prefix="tp", dir=work)]
    print(f"[{name}] running {steps} steps ...", flush=True)
    subprocess.run(cmd, check=True, cwd=work)
    return [json.loads(line) for line in (ckpt / "steps.jsonl").read_text().splitlines()]


def pool_shape(doc: dict) -> tuple[int, int]:
    """The job's ranks and the cores they compute on (ranks x cpusPerDevice; a GPU rank counts one)."""
    pool = doc["spec"]["resourcePools"][0]
    ranks = int(pool.get("devicesPerNode", RANKS))
    return ranks, ranks if pool.get("device") == "gpu" else int(ranks * pool.get("cpusPerDevice", 1))


def summarise(records: list[dict], dtype: str, peaks: dict[str, float], parameters: int,
              cores: int, trained: int | None = None) -> dict[str, float]:
    # the first step pays one-off costs (first vLLM call, allocator warm-up); a profiled step pays the profiler's
    rec = [r for r in records[1:] if not any(k.startswith(PREFIX) for k in r)] or records[1:] or records
    med = lambda f: statistics.median(f(r) for r in rec)  # noqa: E731
    out = {"tokens/s": med(lambda r: r["throughput_tokens_per_s"]),
           "iteration s": med(lambda r: r["iteration_seconds"])}
    for stage in STAGES:
        out[f"{stage} s"] = med(lambda r: r["stages"].get(stage, 0.0))
    out["peak GB/rank (max)"] = max(r["actor_peak_memory_bytes"] for r in records) / 1e9
    out["peak GB (sum of ranks)"] = max(r["actor_peak_memory_bytes_total"] for r in records) / 1e9
    for key, field in SYNC_FIELDS.items():
        out[key] = med(lambda r: r.get(field, 0.0)) / 1e6
    peak = cores * peaks[dtype]  # the one-thread (or one-GPU) peak on every core the job computes on
    update_flops = lambda r: training_flops(parameters, r["tokens"], trained) / r["stages"]["actor_update"]  # noqa: E731
    out["update FLOP/s / peak (batch tokens)"] = med(update_flops) / peak  # not an MFU: see the module's docstring
    logp = med(lambda r: r["stages"].get("old_log_prob", 0.0))
    out["log-prob FLOP/s / peak (batch tokens)"] = (med(lambda r: forward_flops(parameters, r["tokens"])) / logp / peak
                                                    if logp else 0.0)
    out["update MFU (job's metric)"] = med(lambda r: r["mfu"])
    # the share of rows whose advantages were all zero, left out of the update (training.skipZeroAdvantageRows)
    out["update rows skipped"] = med(lambda r: r.get("update_rows_skipped", 0.0))
    out["reward (last step)"] = records[-1]["reward_mean"]
    return out


def actor_params_held(doc: dict):
    """How the job's actor holds its parameters (hybridflow.memory.terms.TrainedParams): trained and frozen."""
    from hybridflow.api import parse_job
    from hybridflow.memory.shapes import read_shapes
    from hybridflow.memory.terms import trained_params

    job = parse_job(doc)
    return trained_params("actor", job.spec, read_shapes(job.spec, ROOT)["actor"], True)


def rank_memory_parts(doc: dict, dtype: str) -> dict[str, float]:
    """What one rank holds by design through the update (whose peak the table shows), in GB, from the job's spec:
    the FSDP shards (fp32 masters, their gradients, AdamW's two moments: of every weight, or with LoRA of the
    adapters, beside the frozen base in the compute dtype). The colocated generation engine keeps nothing of its
    own by design: a CPU vLLM releases its weights and its KV cache for the update, with LoRA too. Peak minus these
    is the runtime (Python, torch, vLLM, Ray) and the activations and allocator slack of the largest micro-batch."""
    from hybridflow.capacity import DTYPE_BYTES

    held = actor_params_held(doc)
    ranks = pool_shape(doc)[0]
    shard = held.trained * 4 / ranks / 1e9
    frozen = {"frozen base": held.frozen * DTYPE_BYTES[dtype] / ranks / 1e9} if held.frozen else {}
    return {"fp32 weight shard": shard, "gradient shard": shard, "AdamW moments": 2 * shard} | frozen


def peaks_by_step(records: list[dict]) -> list[float]:
    """The summed peak after each step: flat from step 2 on when nothing grows (ru_maxrss never falls)."""
    return [r["actor_peak_memory_bytes_total"] / 1e9 for r in records]


BENCH_MODELS = ("smollm2", "qwen2-0.5b")  # bench/model_dirs.py's
MODEL_TITLES = {"smollm2": "SmolLM2-135M", "qwen2-0.5b": "Qwen2-0.5B-shaped (random weights)"}
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


def _model_dirs():
    """bench/model_dirs.py (the bench models' directories), loaded from its file: bench/ is not a package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_model_dirs", ROOT / "bench" / "model_dirs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def with_model(doc: dict, model: str) -> tuple[dict, int]:
    """--model: the job with that bench model as its actor (source: path, its directory, built once), and the
    model's parameter count (for the FLOP/s columns)."""
    dirs = _model_dirs()
    directory = dirs.model_dir(model)
    return merged(doc, {"models": {"actor": {"source": "path", "path": str(directory)}}}), dirs.param_count(directory)


def run_trl(model: str, steps: int) -> dict:
    """bench/trl_grpo.py in .venv-trl on the same model directory; its JSON line."""
    directory = _model_dirs().model_dir(model)
    print(f"[TRL GRPOTrainer] running {steps} steps on {directory} ...", flush=True)
    out = subprocess.run([str(TRL_PYTHON), str(ROOT / "bench" / "trl_grpo.py"), "--steps", str(steps),
                          "--model-dir", str(directory)], check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    return json.loads(next(line for line in reversed(out.stdout.splitlines())
                           if line.startswith('{"bench": "trl_grpo"')))


def trl_side_by_side(ours: dict[str, dict], model: str, steps: int) -> dict:
    """Runs TRL on the same job and prints each of our runs against it: tokens/s (medians of steps 2..N, the same
    definition: prompt + response tokens of the step's batch / its wall seconds) and the summed peak memory (ours:
    the update's peak summed over the ranks; TRL: its one process's, plus its children's)."""
    trl = run_trl(model, steps)
    print(f"\n{MODEL_TITLES[model]} GRPO, 16 prompts x 4, responses <= 32 tokens; medians of steps 2..{steps}; "
          f"TRL {trl['trl']}: one process ({trl['threads']} threads), {trl['generation']}, {trl['dtype']}")
    rows = {f"hybridflow {n}": (r["tokens/s"], r["peak GB (sum of ranks)"]) for n, r in ours.items()}
    width = max(len(n) + 2 for n in rows)
    print(f"{'':<{width}}{'tokens/s':>10}{'/TRL':>8}{'peak GB':>10}{'/TRL':>8}")
    ratio = lambda a, b: f"{a / b:>7.2f}x" if b else f"{'-':>8}"  # noqa: E731
    for name, (speed, memory) in rows.items():
        print(f"{name:<{width}}{speed:>10.1f}{ratio(speed, trl['tokens_per_s_median'])}"
              f"{memory:>10.2f}{ratio(memory, trl['peak_rss_gb'])}")
    print(f"{'TRL':<{width}}{trl['tokens_per_s_median']:>10.1f}{'':>8}{trl['peak_rss_gb']:>10.2f}")
    print("TRL tokens/s by step: " + " ".join(f"{x:.1f}" for x in trl["tokens_per_s"])
          + "; its generate seconds by step: " + " ".join(f"{x:.1f}" for x in trl["generate_seconds"]))
    return trl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out of the medians")
    ap.add_argument("--each", action="store_true", help="also each optimisation alone on top of the baseline")
    ap.add_argument("--ablate", nargs="*", metavar="NAME", help="the defaults against the defaults without each "
                    f"named optimisation (none named: every one); names: {', '.join(OPTIMISATIONS)}; or with each "
                    f"named feature: {', '.join(FEATURES)}")
    ap.add_argument("--gpu", action="store_true", help="one GPU rank and a 0.5B-class model built from config")
    ap.add_argument("--model", choices=BENCH_MODELS, default="smollm2", help="the actor (bench/model_dirs.py): "
                    "SmolLM2-135M-Instruct, the job's own; or a random Qwen2-0.5B-shaped model with SmolLM2's "
                    "tokenizer, written once to ~/.cache/hybridflow-bench (spec.models.actor source: path)")
    ap.add_argument("--trl", action="store_true", help="then TRL's GRPOTrainer on the same job and model directory "
                    "(bench/trl_grpo.py in .venv-trl: `bash bench/trl_venv.sh` creates it) and a side-by-side table "
                    "against the defaults")
    ap.add_argument("--profile", type=int, metavar="STEP", help="profile step STEP of every run (spec.trainer."
                    "profileSteps): its update's and generation's seconds by kind of op, a table per run")
    ap.add_argument("--json", help="write the table here as JSON too")
    args = ap.parse_args()
    if args.gpu and args.model != "smollm2":
        ap.error("--gpu builds its own 0.5B-class model; --model is for the CPU job")
    if args.trl and args.gpu:
        ap.error("--trl runs the CPU job's side by side")
    if args.trl and not TRL_PYTHON.is_file():
        ap.error(f"--trl: no {TRL_PYTHON.relative_to(ROOT)}; create it with `bash bench/trl_venv.sh`")
    device = "gpu" if args.gpu else "cpu"
    torch.set_num_threads(1)  # one thread per rank, as the job's ranks compute
    print(_capabilities(device))
    peaks = {d: matmul_peak_flops(getattr(torch, d), device, seconds=1.0) for d in ("float32", "bfloat16")}
    print(f"matmul peak ({'one GPU' if args.gpu else 'one thread'}): "
          + ", ".join(f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in peaks.items()))
    results, by_step, parts, profiles = {}, {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="throughput") as tmp:
        for name, doc in variants(args.each, args.gpu, args.ablate).items():
            dtype = doc["spec"]["training"].get("computeDtype", "bfloat16" if _bf16_native(device) else "float32")
            params = tiny_params(TinyModel(**_snake(GPU_MODEL))) if args.gpu else SMOLLM2_PARAMS
            if args.model != "smollm2":
                doc, params = with_model(doc, args.model)
            if args.profile:
                doc = merged(doc, {"trainer": {"profileSteps": [args.profile]}})
            records = run_job(doc, args.steps, Path(tmp), name)
            if args.profile:
                profiles[name] = profile_report(records[args.profile - 1])
            held = actor_params_held(doc)
            results[name] = summarise(records, dtype, peaks, params, pool_shape(doc)[1],
                                      held.trained if held.frozen else None)
            by_step[name] = peaks_by_step(records)
            parts[name] = rank_memory_parts(doc, dtype)
    names = list(results)
    base_name = "baseline" if "baseline" in results else names[-1]
    base, new = results[base_name], results["defaults"]
    width = max(len(k) for k in base) + 2
    what = ("0.5B-class model, 64 prompts x 4, responses <= 128 tokens, 1 GPU" if args.gpu else
            f"{MODEL_TITLES[args.model]} GRPO, 16 prompts x 4, responses <= 32 tokens, {RANKS} CPU ranks")
    skipped = f" but the profiled step {args.profile}" if args.profile and args.profile > 1 else ""
    print(f"\n{what}; medians of steps 2..{args.steps}{skipped}")
    col = max(26, *(len(n) + 2 for n in names))
    ratio_name = f"defaults/{base_name}"
    print(f"{'':<{width}}" + "".join(f"{n:>{col}}" for n in names) + f"{ratio_name:>{len(ratio_name) + 2}}")
    for key in base:
        ratio = f"{new[key] / base[key]:.2f}x" if base[key] else "-"
        print(f"{key:<{width}}" + "".join(f"{results[n][key]:>{col}.3f}" for n in names)
              + f"{ratio:>{len(ratio_name) + 2}}")
    print("peak GB (sum of ranks) after each step, a high-water mark: "
          + "; ".join(f"{n} " + " ".join(f"{g:.2f}" for g in by_step[n]) for n in names))
    for n in names:
        held = parts[n]
        rest = results[n]["peak GB/rank (max)"] - sum(held.values())
        print(f"{n}, one rank's peak {results[n]['peak GB/rank (max)']:.2f} GB: "
              + ", ".join(f"{k} {v:.2f}" for k, v in held.items())
              + f"; the rest (runtime, activations, allocator slack) {rest:.2f}")
    for n, text in profiles.items():
        print(f"\n{n}, step {args.profile} profiled (the update and the transition averaged over the ranks, the "
              f"last rank's generation; seconds are the ops' own, 'outside_ops' what no op covers):\n{text}")
    if args.trl:
        trl_side_by_side(results, args.model, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_peak": peaks, "runs": results, "peak_gb_by_step": by_step},
                                              indent=1))


def _capabilities(device: str) -> str:
    """What this machine computes natively, and so what `computeDtype: auto` picks (the job's own rule)."""
    if device == "gpu":
        return f"device: {torch.cuda.get_device_name()}; auto computes in " + (
            "bfloat16" if _bf16_native(device) else "float32")
    flags = set()
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    return (f"CPU: torch capability {torch.backends.cpu.get_cpu_capability()}, AVX-512 "
            f"{'yes' if 'avx512f' in flags else 'no'}, native bf16 (AVX512-BF16 or AMX) "
            f"{'yes' if _bf16_native(device) else 'no'}; auto computes in "
            f"{'bfloat16' if _bf16_native(device) else 'float32'}")


def _bf16_native(device: str) -> bool:
    from hybridflow.engines.precision import native_bf16

    return native_bf16(device)


def _snake(camel: dict) -> dict:
    return {"".join(f"_{c.lower()}" if c.isupper() else c for c in k): v for k, v in camel.items()}


if __name__ == "__main__":
    main()
