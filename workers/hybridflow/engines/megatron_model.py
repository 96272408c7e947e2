"""megatron-core GPTModel for Llama/Qwen2-style decoders, and the tensor-parallel sharding rules of its weights.

The sharding rules are the contract between training and everything that moves weights (checkpoints, the
3D-HybridEngine's resharding, export to HF): column-parallel weights split along dim 0, row-parallel along
dim 1, the gated MLP's fc1 splits its gate and up halves separately (each rank holds [gate_r; up_r]), and the
vocabulary (embedding, output layer) is split along dim 0.
"""
from __future__ import annotations

from typing import Any

import torch

COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")
GATED = ("linear_fc1.weight",)


def transformer_config(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                       dtype: torch.dtype = torch.float32, qkv_bias: bool = True) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv_heads,
        ffn_hidden_size=ffn, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=qkv_bias,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, attention_dropout=0.0,
        hidden_dropout=0.0, layernorm_epsilon=1e-6,
        tensor_model_parallel_size=_tp_size(),
    )


def _tp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def build_gpt(cfg: Any, vocab_size: int, max_len: int, tie_embeddings: bool) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not torch.cuda.is_available():
        from hybridflow.engines.megatron_cpu import apply_cpu_fallbacks

        apply_cpu_fallbacks()
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=vocab_size,
                    max_sequence_length=max_len, position_embedding_type="rope",
                    share_embeddings_and_output_weights=tie_embeddings, rotary_base=10000)


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


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard` given every rank's part in TP order."""
    rule = split_rule(name)
    if rule == "column":
        return torch.cat(parts, dim=0)
    if rule == "row":
        return torch.cat(parts, dim=1)
    if rule == "gated":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return parts[0]
