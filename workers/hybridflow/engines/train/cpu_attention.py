"""The attention a trained HF model runs on CPU: torch's flash-attention kernel forward in the compute dtype, its
backward in fp32 (spec.training.fp32AttentionBackward; issue 57).

Why: on an AMX Xeon torch's CPU flash-attention backward takes 2.4x longer in bf16 than in fp32 (11-12 ms against
4.9 ms for one SmolLM2 layer of a shared-prompt micro-batch, 3 x 9 heads x 176 x 64), so in a bf16 update it took
18% of the time, more than any op but the matmuls. Its forward is fast in bf16. So the forward runs as `sdpa` runs
it and saves the same tensors (query, key, value, output and the row log-sum-exp: what sdpa saves with a mask; without
one, on a grouped-query model, sdpa keeps key and value unrepeated and this repeats them), and the backward upcasts
them, one layer at a time, and runs the kernel's fp32 backward: the same gradients, computed more precisely, then
cast back.

Registered with HF as attention implementation `ATTENTION` (and its mask as sdpa's: a boolean mask, or none with
causal attention); `adopt` switches a model that runs sdpa to it. Anything else (no gradient wanted, a GPU, a KV
cache, dropout, a value head size other than the query's) runs HF's own sdpa path unchanged. In float64 (the
equivalence tests) the backward runs in float64: the same kernel as sdpa's, end to end.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridflow.api.training import LLAMA_PATTERN_FAMILIES

ATTENTION = "hybridflow_cpu_sdpa"
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def backward_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32: bf16 and fp16 go up, fp32 and fp64 stay."""
    return torch.promote_types(dtype, torch.float32)


class FlashWithWideBackward(torch.autograd.Function):
    """Attention over (B, H, T, D) query, key and value (key and value repeated to every head), `mask` additive
    (B or 1, 1, T, T) in the query's dtype or None with `causal`; forward in the inputs' dtype, backward in
    `backward_dtype` of it."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, scale: float | None) -> torch.Tensor:
        out, lse = _flash(query, key, value, 0.0, causal, attn_mask=mask, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse, mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, mask = ctx.saved_tensors
        wide = backward_dtype(query.dtype)
        w = [t.to(wide) for t in (grad, query, key, value, out)]
        mask = None if mask is None else mask.to(wide)
        dq, dk, dv = _flash_backward(*w, lse, 0.0, ctx.causal, attn_mask=mask, scale=ctx.scale)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may attend) as the kernel takes it, 0 or -inf, as torch's sdpa converts one."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature (AttentionInterface): (B, H, T, D) inputs, (B, T, H, D) output."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    T = query.shape[2]
    ours = (query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad and dropout == 0.0
            and key.shape[2] == T and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and kwargs.get("position_bias") is None and kwargs.get("cache") is None)
    if not ours:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    causal = attention_mask is None and T > 1 and (getattr(module, "is_causal", True) if is_causal is None
                                                  else is_causal)
    mask = None if attention_mask is None else additive_mask(attention_mask, query.dtype)
    out = FlashWithWideBackward.apply(query, key, value, mask, causal, scaling)
    return out.transpose(1, 2).contiguous(), None


def adopt(model: nn.Module) -> bool:
    """Switch `model` to `ATTENTION` where it runs HF's sdpa through HF's attention registry and is of a family whose
    attention is plain scaled-dot-product (LLAMA_PATTERN_FAMILIES: no latent or sparse attention, whose models
    check the implementation's name or pass the kernel other shapes); any other keeps its own. Whether it switched."""
    config = getattr(model, "config", None)
    if (getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "model_type", None)
            not in LLAMA_PATTERN_FAMILIES or not getattr(model, "_supports_attention_backend", False)):
        return False
    model.set_attn_implementation(register())
    return True


def register() -> str:
    """`ATTENTION` in HF's registries (idempotent): the attention function, and sdpa's mask builder for it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
