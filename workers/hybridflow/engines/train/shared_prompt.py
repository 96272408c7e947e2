"""Shared-prompt packing: the rows of a micro-batch that share a prompt (a GRPO-style group, sampled n times) run as
one sequence, the prompt once and then each response, instead of n sequences that repeat the prompt.

A packed sequence is the (left-padded) prompt followed by one slot per response, each slot as wide as the
micro-batch's responses. Its attention mask lets a response token see the prompt and the tokens before it in its own
slot only, and its position ids restart after the prompt in every slot, so each response token is computed exactly as
in its own unshared row: same context, same rotary positions. The output at the prompt's last position (the logit of
every response's first token) is computed once and read by each response; gradients reach the prompt positions once,
summed over the group, by autograd through the same indexing.

Only attention backends that take an arbitrary mask can run this (`sdpa` and `cpu_attention.ATTENTION` as a boolean
mask, `eager` as an additive one); anything else runs unshared, with the reason logged once per process.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.data.packing import padded_positions, prompt_groups
from hybridflow.engines.train.cpu_attention import ATTENTION
from hybridflow.logs import say_once
from hybridflow.single_controller.batch import Batch

log = logging.getLogger(__name__)

# HF attention implementations that take a custom 4D mask (ATTENTION: sdpa's, its backward in fp32 on CPU)
MASK_KINDS = {"sdpa": "bool", ATTENTION: "bool", "eager": "additive"}


@dataclass(frozen=True)
class PackedGroups:
    """A micro-batch as shared-prompt sequences (S of them, T = P + slots x R tokens each), and where each row's
    outputs are read: `keep` are the positions whose outputs anything needs (the same in every sequence, so the
    model's `logits_to_keep` takes them), `source[b, j]` the index, into the (S x len(keep)) kept outputs, of the
    output that predicts response token j of row b."""

    input_ids: torch.Tensor  # (S, T)
    position_ids: torch.Tensor  # (S, T)
    allowed: torch.Tensor  # (S, 1, T, T) bool: query t may attend key u
    keep: torch.Tensor  # (K,) long
    source: torch.Tensor  # (B, R) long


def attention_allowed(real: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """(S, 1, T, T) bool from each position's realness (S, T) and segment (T,): 0 for the prompt, k for slot k.
    A real query sees the real keys at or before it that are in the prompt or in its own slot; every position sees
    itself, so that no row of the softmax is empty (a padding position's output is never read)."""
    T = segment.shape[0]
    causal = torch.ones(T, T, dtype=torch.bool, device=real.device).tril()
    same = (segment[None, :] == 0) | (segment[None, :] == segment[:, None])
    allowed = causal & same & real[:, :, None] & real[:, None, :]
    return (allowed | torch.eye(T, dtype=torch.bool, device=real.device))[:, None]


def shared_layout(batch: Batch) -> PackedGroups | None:
    """The packed layout of a micro-batch in which some rows share a prompt; None when none do."""
    groups = prompt_groups(batch)
    return pack_groups(batch, groups) if len(groups) < len(batch) else None


def pack_groups(batch: Batch, groups: list[list[int]]) -> PackedGroups:
    """The shared-prompt layout of `batch` (left-padded prompts (B, P), right-padded responses (B, R), attention
    mask over both), one sequence per group of rows with the same prompt."""
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    slots = max(len(g) for g in groups)
    S, T = len(groups), P + slots * R
    dev = batch["input_ids"].device
    first = torch.tensor([g[0] for g in groups], device=dev)
    mask = batch["attention_mask"]
    ids = torch.zeros(S, T, dtype=torch.long, device=dev)
    real = torch.zeros(S, T, dtype=torch.bool, device=dev)
    pos = torch.zeros(S, T, dtype=torch.long, device=dev)
    ids[:, :P] = batch["prompts"][first]
    real[:, :P] = mask[first, :P].bool()
    prompt_len = mask[first, :P].sum(1)
    pos[:, :P] = padded_positions(mask[first, :P])
    steps = torch.arange(R, device=dev)
    keep = torch.cat([torch.tensor([P - 1], device=dev),
                      (P + torch.arange(slots, device=dev)[:, None] * R + steps[None, 1:] - 1).flatten()])
    K = keep.shape[0]
    source = torch.zeros(len(batch), R, dtype=torch.long, device=dev)
    for s, rows in enumerate(groups):
        for k, b in enumerate(rows):
            at = P + k * R
            ids[s, at: at + R] = batch["responses"][b]
            real[s, at: at + R] = mask[b, P:].bool()
            pos[s, at: at + R] = prompt_len[s] + steps
            source[b, 0] = s * K
            source[b, 1:] = s * K + 1 + k * (R - 1) + steps[:-1]
    segment = torch.cat([torch.zeros(P, dtype=torch.long, device=dev),
                         torch.arange(1, slots + 1, device=dev).repeat_interleave(R)])
    return PackedGroups(ids, pos, attention_allowed(real, segment), keep, source)


def mask_for(model: nn.Module, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask in the form the model's attention implementation takes."""
    if MASK_KINDS[attention_backend(model)] == "bool":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                      torch.finfo(dtype).min)


def attention_backend(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None))


def can_share(model: nn.Module) -> bool:
    """Whether `model` can run packed groups; says once per process why not when it cannot."""
    backend = attention_backend(model)
    if backend in MASK_KINDS:
        return True
    say_once(log, f"shared-prompt packing is off: the model's attention implementation '{backend}' takes no custom "
             f"mask (it works with {' or '.join(MASK_KINDS)}); rows of a group run unshared")
    return False


def packed_outputs(model: nn.Module, packed: PackedGroups, keep_arg: bool = True) -> torch.Tensor:
    """The model's outputs (logits, or a value head's) that predict each response token: (B, R, ...), read from the
    packed sequences. `keep_arg`: the model takes `logits_to_keep` (a causal LM), so only the kept positions go
    through its head."""
    dtype = next(model.parameters()).dtype
    kwargs = {"logits_to_keep": packed.keep} if keep_arg else {}
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                attention_mask=mask_for(model, packed.allowed, dtype), use_cache=False, **kwargs).logits
    if not keep_arg:
        out = out[:, packed.keep]
    # index_select rather than indexing: the same rows, and its backward adds them back with index_add_ instead of
    # an accumulating index_put_ (which sorts): on CPU, half the time over a (B, R, vocabulary) gradient
    rows = out.flatten(0, 1).index_select(0, packed.source.flatten())
    return rows.view(*packed.source.shape, *out.shape[2:])
