"""The paper's evaluation setups (HybridFlow, EuroSys 2025, section 8): PPO with actor, critic, reference and
reward models of one size (Llama 7B, 13B, CodeLlama 34B, Llama 70B), on 16 to 128 A100-80GB (8 per node, NVLink
600 GB/s, 200 Gb/s between nodes), prompts and responses of 1024 tokens, 1024 prompts a step; and the placement the
paper's placement study (section 8.4) reports best, as far as this project could recall it (the paper's text was
not at hand when this was written: see REPORTED)."""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.api import RLHFJob, parse_job
from hybridflow.memory.shapes import ModelShape

# The published config.json shapes (layers, hidden, intermediate, heads, kv heads, head dim, vocabulary).
LLAMA = {
    "7b": ModelShape(32, 4096, 11008, 32, 32, 128, 32000, False, False, "Llama-2-7B (config.json)"),
    "13b": ModelShape(40, 5120, 13824, 40, 40, 128, 32000, False, False, "Llama-2-13B (config.json)"),
    "34b": ModelShape(48, 8192, 22016, 64, 8, 128, 32000, False, False, "CodeLlama-34B (config.json)"),
    "70b": ModelShape(80, 8192, 28672, 64, 8, 128, 32000, False, False, "Llama-2-70B (config.json)"),
}
DEVICES = (16, 32, 64, 96, 128)

# What section 8.4 reports, as recalled (to be checked against the paper): from 16 to 64 GPUs colocating every
# model is best (34B from 32: four 34B models do not fit 16); at 96-128 GPUs the 34B models and at 96 GPUs the 13B models are best split (actor and reference
# on one half, critic and reward on the other); 13B on 128 GPUs is best with the planner's own hybrid placement.
# The placement study covers 13B and 34B; for 7B and 70B the paper gives no per-placement winner ("-").
REPORTED: dict[tuple[str, int], str] = {
    **{("13b", n): "colocate" for n in (16, 32, 64)}, ("34b", 32): "colocate", ("34b", 64): "colocate",
    ("13b", 96): "split", ("13b", 128): "hybrid", ("34b", 96): "split", ("34b", 128): "split",
}


def paper_job(size: str) -> RLHFJob:
    """The paper's PPO job for one model size (the pools are the planner's to choose). Assumed where the paper's
    text was not at hand: mini-batches of 256 prompts (4 updates a step), one epoch, KL in the reward."""
    model = {"source": "path", "path": f"/models/llama-{size}", "dtype": "bfloat16"}
    return parse_job({"metadata": {"name": f"paper-ppo-{size}"}, "spec": {
        "algorithm": {"name": "ppo", "klCoef": 0.01, "klIn": "reward"},
        "models": {"actor": model, "critic": model, "reward": {"type": "model", "model": model}},
        "data": {"source": "files", "train": ["hh-rlhf/train.parquet"]},
        "rollout": {"engine": "vllm", "responsesPerPrompt": 1, "maxPromptLength": 1024, "maxResponseLength": 1024,
                    "gpuMemoryUtilization": 0.5},
        "training": {"miniBatchSize": 256, "ppoEpochs": 1},
        "trainer": {"promptsPerStep": 1024},
        "resourcePools": [{"name": "gpus", "nodes": 2, "devicesPerNode": 8, "device": "gpu",
                           "accelerator": "a100-80gb"}]}})


def paper_shapes(size: str) -> dict[str, ModelShape]:
    s = LLAMA[size]
    return {role: s for role in ("actor", "rollout", "reference", "critic", "cost_critic", "reward")}


@dataclass(frozen=True)
class PaperRow:
    size: str
    devices: int
    pick: str  # the planner's first choice (its label), or why none
    layout: str
    step_seconds: float
    reported: str

    @property
    def agrees(self) -> str:
        if self.reported == "-":
            return "-"
        return "yes" if self.pick.split(" ")[0] == self.reported else "no"
