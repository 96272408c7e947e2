"""The jobs and model shapes of the GPU suite (tests/gpu), apart from the code that runs them, so that the light
tests validate every one of them here (tests/test_gpu_suite.py, what `bench/gpu_check.sh --dry-run` runs).

Models are built from config (`models.actor.source: tiny`, the `increment` task) or written with random weights
from a published model's shape: nothing is downloaded."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
LR = 0.05  # as tests/trainer/test_weight_sync.py: big steps, so stale generation weights cannot pass for new ones
TINY = {"vocabSize": 16, "hiddenSize": 64, "numHeads": 2, "numKvHeads": 1, "numLayers": 2}  # examples/tiny-grpo
TINY_MEGATRON = {**TINY, "numKvHeads": 2}  # examples/tiny-grpo-megatron
ENGINE_CLASS = {"vllm": "VLLMRollout", "hf": "HFRollout", "megatron": "MegatronRollout"}
GAP_WARN = 0.1  # nats: a post-wake rollout-vs-trainer log-prob gap above this is reported as suspicious

# Qwen2.5-1.5B's config.json (the shape only: random weights): 1,543,714,304 parameters
QWEN25_15B = {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
              "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
              "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
# the CPU smoke run: the same layout, small (6.0 M parameters)
SMALL_LOAD = {**QWEN25_15B, "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 1024,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
LOAD_GOAL = 1.3  # issue 50: a rank's load peak <= 1.3 x M/N (+ the runtime, which torch's allocator does not count)
LOAD_TOLERANCE = 0.15  # measured against predicted, as the memory model's calibration (issue 50, item 4)

# Qwen2.5-0.5B's shape (494,032,768 parameters, tied embeddings) as the tiny source builds it, random weights:
# throughput.py's own --gpu model keeps a 32k vocabulary (360 M parameters)
QWEN25_05B = {"vocabSize": 151936, "hiddenSize": 896, "intermediateSize": 4864, "numLayers": 24, "numHeads": 14,
              "numKvHeads": 2, "tieEmbeddings": True}
# the CPU smoke run: throughput.py's CPU job made small (the tiny model, one rank, the increment task)
SMOKE_PATCH = {
    "models": {"actor": {"source": "tiny", "tiny": dict(TINY)}, "reference": False},
    "data": {"task": "increment", "trainPrompts": 64, "evalPrompts": 8},
    "rollout": {"maxPromptLength": 8, "maxResponseLength": 6},
    "trainer": {"promptsPerStep": 8},
    "resourcePools": [{"name": "default", "devicesPerNode": 1}],
}


def job_doc(engine: str, device: str, steps: int, checkpoint_dir: str, rollout: str = "vllm") -> dict[str, Any]:
    """The suite's RLHFJob: GRPO on the increment task, a tiny model built from config, one rank of `device`.
    tisCap makes the generation engine return its own log-probs, so each step reports the gap between the
    engine's and the trainer's log-probs of the same tokens (rollout_log_prob_gap). The FSDP job's actor says
    dtype bfloat16, as a GPU job does: the compute dtype (fp32_master checks that the master copy, gradients and
    AdamW state stay fp32 all the same)."""
    training: dict[str, Any] = {"engine": engine, "microBatchSize": 64, "actorLr": LR}
    actor: dict[str, Any] = {"source": "tiny", "tiny": dict(TINY_MEGATRON if engine == "megatron" else TINY)}
    if engine == "fsdp":
        actor["dtype"] = "bfloat16"
    if engine == "megatron":
        training["tensorParallel"] = 1
    return {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": f"gpu-check-{engine}" + ("" if rollout == "vllm" else f"-{rollout}")},
        "spec": {
            "algorithm": {"name": "grpo", "klCoef": 0.0, "tisCap": 2.0},
            "models": {"actor": actor},
            "data": {"task": "increment", "trainPrompts": 256, "evalPrompts": 32},
            "rollout": {"engine": rollout, "responsesPerPrompt": 8, "temperature": 1.0, "maxPromptLength": 8,
                        "maxResponseLength": 6},
            "training": training,
            "resourcePools": [{"name": "default", "devicesPerNode": 1, "device": device,
                               "cpusPerDevice": 4 if device == "gpu" else 1,
                               "memoryPerNode": "32Gi" if device == "gpu" else "4Gi"}],
            "trainer": {"steps": steps, "promptsPerStep": 8, "saveFreq": 0, "eval": False,
                        "checkpointDir": checkpoint_dir},
            "metrics": {"port": 0},
        },
    }


def parse(doc: dict[str, Any]):
    from hybridflow.api import parse_job

    return parse_job(doc, f"tests/gpu ({doc['metadata']['name']})")


def throughput_module(rollout: str, runs: str, gpu: bool, smoke: bool = False):
    """bench/throughput.py, loaded as a module and adjusted: its --gpu model Qwen2.5-0.5B-shaped; with a
    generation engine other than vLLM, its job's rollout.engine set to it and the optimisations that only vLLM has
    (a job-sized KV cache, prefix caching: spec fields the other engines ignore) left out of the comparison; with
    runs == "defaults", only the defaults run (no baseline: one job instead of two, for the device's budget);
    `smoke`: its CPU job made small (SMOKE_PATCH)."""
    spec = importlib.util.spec_from_file_location("throughput", ROOT / "bench" / "throughput.py")
    tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp)
    tp.dropped = []
    if gpu:
        tp.GPU_MODEL.clear()
        tp.GPU_MODEL.update(QWEN25_05B)  # GPU_PATCH holds this dict: the job and the MFU's parameter count see it
    elif smoke:
        tp.JOB = tp.merged(tp.JOB, SMOKE_PATCH)
        tp.RANKS = 1
        tp.SMOLLM2_PARAMS = tp.tiny_params(tp.TinyModel(**tp._snake(TINY)))  # what its CPU MFU divides by
    if rollout != "vllm":
        tp.JOB["spec"]["rollout"]["engine"] = rollout
        tp.dropped = [n for n, patch in tp.OPTIMISATIONS.items() if set(patch) == {"rollout"}]
        for n in tp.dropped:
            del tp.OPTIMISATIONS[n]
    if runs == "defaults":
        variants = tp.variants
        tp.variants = lambda *a, **k: {"defaults": variants(*a, **k)["defaults"]}
    return tp


def every_job(rollout: str, runs: str, steps: int) -> dict[str, dict[str, Any]]:
    """Every job the suite would run with `rollout` (the fsdp and megatron jobs on a GPU and on a CPU, megatron
    generation with a rollout other than vLLM, throughput.py's GPU jobs), by name."""
    docs: dict[str, dict[str, Any]] = {}
    for engine, ro in (("fsdp", rollout), ("megatron", rollout),
                       *((("megatron", "megatron"),) if rollout != "vllm" else ())):
        for device in ("gpu", "cpu"):
            docs[f"{engine}-{ro}-{device}"] = job_doc(engine, device, steps, "/tmp/gpu_check_plan", ro)
    tp = throughput_module(rollout, runs, True)
    for name, doc in tp.variants(False, True).items():
        docs[f"throughput-{name}"] = tp.merged(doc, {"trainer": {"steps": steps,
                                                                 "checkpointDir": "/tmp/gpu_check_plan"}})
    return docs
