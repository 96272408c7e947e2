"""megatron-core GPTModel for Llama/Qwen2-style decoders: its config from an HF config, weight conversion both
ways (and a rank's own shards read straight from HF safetensors files), and the tensor-parallel sharding rules of its
weights.

The sharding rules are the contract between training and everything that moves weights (checkpoints, the
3D-HybridEngine's resharding, export to HF): column-parallel weights split along dim 0, row-parallel along
dim 1, the gated MLP's fc1 splits its gate and up halves separately (each rank holds [gate_r; up_r]), and the
vocabulary (embedding, output layer) is split along dim 0. The fused QKV weight is stored per query group
([q heads of group g; k_g; v_g] for g = 0..G-1), so a dim-0 split hands each rank whole groups.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")
GATED = ("linear_fc1.weight",)


@dataclass(frozen=True)
class DecoderShape:
    """What megatron needs to know about a Llama/Qwen2 decoder."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = False
    tied: bool = True
    rope_base: float = 10000.0
    eps: float = 1e-6
    max_len: int = 2048

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden // self.heads


def shape_from_hf(cfg: Any) -> DecoderShape:
    """An HF LlamaConfig/Qwen2Config as a DecoderShape; other architectures are refused by name."""
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    if cfg.model_type not in ("llama", "qwen2"):
        raise ValueError(f"the megatron engine converts Llama and Qwen2 decoders; this model is {arch} "
                         f"(model_type {cfg.model_type!r}); use spec.training.engine: fsdp")
    rope = getattr(cfg, "rope_parameters", None) or {}
    return DecoderShape(
        vocab=cfg.vocab_size, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads, ffn=cfg.intermediate_size,
        head_dim=getattr(cfg, "head_dim", None) or 0,
        qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        tied=bool(cfg.tie_word_embeddings), rope_base=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 1e4))),
        eps=float(cfg.rms_norm_eps), max_len=int(cfg.max_position_embeddings),
    )


def transformer_config(shape: DecoderShape, dtype: torch.dtype = torch.float32, tp: int | None = None,
                       pp: int | None = None) -> Any:
    """tp/pp default to the sizes megatron's parallel_state was initialised with."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.kv_channels, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=False, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0, layernorm_epsilon=shape.eps,
        tensor_model_parallel_size=tp or _ps_size("tensor"), pipeline_model_parallel_size=pp or _ps_size("pipeline"),
    )


def _ps_size(kind: str) -> int:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return getattr(ps, f"get_{kind}_model_parallel_world_size")()


def build_gpt(cfg: Any, shape: DecoderShape, pg_collection: Any = None, pre_process: bool = True,
              post_process: bool = True) -> torch.nn.Module:
    """`pg_collection` lets a second model (the generation engine) use process groups other than training's."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not torch.cuda.is_available():
        from hybridflow.engines.train.megatron_cpu import apply_cpu_fallbacks

        apply_cpu_fallbacks()
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=shape.vocab,
                    max_sequence_length=shape.max_len, position_embedding_type="rope",
                    share_embeddings_and_output_weights=shape.tied, rotary_base=shape.rope_base,
                    pre_process=pre_process, post_process=post_process, pg_collection=pg_collection)


# --- HF <-> megatron (full, unsharded tensors) ------------------------------------------------------------------

_LAYER_RENAMES = {  # plain one-to-one names inside a layer: HF -> megatron
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: DecoderShape) -> torch.Tensor:
    """HF's q, k and v rows (weights, biases, or a LoRA's lora_B) as megatron's linear_qkv holds them: per query
    group, [that group's q heads; its k; its v] (the inverse of `megatron_to_hf_items`' split)."""
    G, D = shape.kv_heads, shape.kv_channels
    per_group = shape.heads // G
    rest = q.shape[1:]
    return torch.cat([q.reshape(G, per_group * D, *rest), k.reshape(G, D, *rest), v.reshape(G, D, *rest)],
                     dim=1).reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: DecoderShape) -> dict[str, torch.Tensor]:
    """Whatever part of the model `hf` holds (a pipeline stage's layers, or the whole model): callers that need all
    of it check the result against their own parameters."""
    out = {}
    for a, b in (("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
                 ("model.norm.weight", "decoder.final_layernorm.weight")) + (
                    () if shape.tied else (("lm_head.weight", "output_layer.weight"),)):
        if a in hf:
            out[b] = hf[a]
    layers = sorted({int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")})
    for i in layers:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for a, b in _LAYER_RENAMES.items():
            out[m + b] = hf[h + a]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            *(hf[f"{h}self_attn.{x}_proj.weight"] for x in "qkv"), shape)
        if shape.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(*(hf[f"{h}self_attn.{x}_proj.bias"] for x in "qkv"),
                                                                 shape)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], shape: DecoderShape) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_megatron; also what a generation engine that speaks HF names (vLLM) is fed."""
    return dict(megatron_to_hf_items(mg.items(), shape))


def megatron_to_hf_items(items: Any, shape: DecoderShape):
    """Streaming form: converts each (name, tensor) as it arrives, so a bucketed reshard never holds two copies."""
    G, D = shape.kv_heads, shape.kv_channels
    per_group = shape.heads // G
    back = {b: a for a, b in _LAYER_RENAMES.items()}
    for name, t in items:
        if name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", t
            if shape.tied:
                yield "lm_head.weight", t
        elif name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", t
        elif name == "output_layer.weight":
            yield "lm_head.weight", t
        else:
            _, _, i, rest = name.split(".", 3)
            h = f"model.layers.{i}."
            if rest in back:
                yield h + back[rest], t
            elif rest.startswith("self_attention.linear_qkv."):
                kind = rest.rsplit(".", 1)[1]
                g = t.reshape(G, (per_group + 2) * D, *t.shape[1:])
                q, k, v = g.split([per_group * D, D, D], dim=1)
                for x, part in zip("qkv", (q, k, v)):
                    yield f"{h}self_attn.{x}_proj.{kind}", part.reshape(-1, *t.shape[1:])
            elif rest == "mlp.linear_fc1.weight":
                gate, up = t.chunk(2)
                yield h + "mlp.gate_proj.weight", gate
                yield h + "mlp.up_proj.weight", up
            else:
                raise KeyError(f"no HF name for megatron parameter {name}")


def global_layer_name(name: str, offset: int) -> str:
    """A pipeline stage numbers its layers from 0; the whole model's name of local layer i is layer i + offset."""
    if not name.startswith("decoder.layers.") or not offset:
        return name
    i = int(name.split(".")[2])
    return name.replace(f"decoder.layers.{i}.", f"decoder.layers.{i + offset}.", 1)


# --- tensor-parallel sharding rules ------------------------------------------------------------------------------

def split_rule(name: str) -> str:
    if name.endswith(GATED):
        return "gated"
    if name.endswith(COLUMN):
        return "column"
    if name.endswith(ROW):
        return "row"
    return "replicated"


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    rule = split_rule(name)
    if rule == "column":
        return full.chunk(tp, dim=0)[rank].clone()
    if rule == "row":
        return full.chunk(tp, dim=1)[rank].clone()
    if rule == "gated":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]]).clone()
    return full.clone()


def shard_dim(name: str) -> int | None:
    """The dim along which the HF tensors that megatron tensor `name` converts to are split over TP ranks (None:
    replicated). Every TP shard is a contiguous block of them along that dim (see `local_shape`)."""
    return {"column": 0, "gated": 0, "row": 1}.get(split_rule(name))


def hf_shard_dim(hf_name: str) -> int | None:
    """The dim along which an HF tensor is cut into TP blocks: block r of every HF tensor of a layer, converted with
    `hf_to_megatron` under `local_shape`, is TP rank r's shard (None: whole on every rank). A rank can so read its
    own blocks from a checkpoint and never hold a whole tensor."""
    if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                         "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                         "mlp.gate_proj.weight", "mlp.up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
        return 0
    if hf_name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        return 1
    return None


def hf_names_of_stage(names: Any, shape: DecoderShape, first: bool, last: bool, layers: range) -> list[str]:
    """The HF tensors a pipeline stage holding `layers` (global numbers) needs: its layers, the embedding on the
    first stage (and on the last as the output layer's tied copy), the final norm and an untied head on the last."""
    out = []
    for n in names:
        if n.startswith("model.layers."):
            keep = int(n.split(".")[2]) in layers
        elif n == "model.embed_tokens.weight":
            keep = first or (last and shape.tied)
        elif n == "model.norm.weight":
            keep = last
        elif n == "lm_head.weight":
            keep = last and not shape.tied
        else:
            keep = False
        if keep:
            out.append(n)
    return out


def read_rank_shards(model_dir: Path, shape: DecoderShape, tp: int, tp_rank: int, first: bool, last: bool,
                     layers: range) -> dict[str, torch.Tensor]:
    """This rank's megatron shards (whole-model names) read straight from the model's safetensors files: only its
    stage's tensors, and of each only its TP block (safetensors slices over mmap), so no rank holds the whole model
    or a whole tensor it shards (`hf_shard_dim`, `local_shape`)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to load into the megatron engine")
    blocks: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in hf_names_of_stage(st.keys(), shape, first, last, layers):
                piece = st.get_slice(name)
                dim = hf_shard_dim(name)
                if dim is None or tp == 1:
                    blocks[name] = piece[:]
                    continue
                size = piece.get_shape()[dim]
                if size % tp:
                    raise ValueError(f"{model_dir}: {name} has {size} rows along dim {dim}, not divisible by "
                                     f"spec.training.tensorParallel = {tp}")
                step = size // tp
                cut = slice(tp_rank * step, (tp_rank + 1) * step)
                blocks[name] = piece[cut] if dim == 0 else piece[:, cut]
    return hf_to_megatron(blocks, local_shape(shape, tp))


def local_shape(shape: DecoderShape, tp: int) -> DecoderShape:
    """The shape of one TP rank's slice of the model: `megatron_to_hf` of a rank's shards under it gives the rank's
    blocks of the HF tensors, and `hf_to_megatron` of such blocks gives the shards back. That holds because a rank's
    QKV shard holds whole query groups (contiguous q/k/v heads), its fc1 shard [gate_r; up_r], its row-parallel
    shards column blocks and its vocabulary shard a row block, each block r of t equal ones (torch.chunk)."""
    return replace(shape, heads=shape.heads // tp, kv_heads=shape.kv_heads // tp, head_dim=shape.kv_channels,
                   ffn=shape.ffn // tp, vocab=shape.vocab // tp)


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard` given consecutive ranks' parts in TP order. Given s consecutive parts out of t, it
    returns the shard of a t/s-way split: how a micro-DP group's training shards become a generation shard."""
    rule = split_rule(name)
    if rule == "column":
        return torch.cat(parts, dim=0)
    if rule == "row":
        return torch.cat(parts, dim=1)
    if rule == "gated":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return parts[0]

