"""Token lists <-> the fixed-width tensors that every rank produces, so shards from different ranks concatenate."""
from __future__ import annotations

import torch

from hybridflow.controller.batch import Batch

PAD = 0


def pack_rollout(prompts: list[list[int]], responses: list[list[int]], prompt_width: int, response_width: int) -> dict:
    """Left-pad prompts to `prompt_width`, right-pad responses to `response_width`.

    Returns tensors: prompts (B,P), responses (B,R), input_ids (B,P+R), attention_mask (B,P+R), response_mask (B,R).
    """
    B = len(prompts)
    p_ids = torch.full((B, prompt_width), PAD, dtype=torch.long)
    p_mask = torch.zeros((B, prompt_width), dtype=torch.long)
    r_ids = torch.full((B, response_width), PAD, dtype=torch.long)
    r_mask = torch.zeros((B, response_width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) > prompt_width:
            raise ValueError(f"a prompt of {len(p)} tokens exceeds spec.rollout.maxPromptLength={prompt_width}")
        r = r[:response_width]
        if p:
            p_ids[i, prompt_width - len(p) :] = torch.tensor(p)
            p_mask[i, prompt_width - len(p) :] = 1
        if r:
            r_ids[i, : len(r)] = torch.tensor(r)
            r_mask[i, : len(r)] = 1
    return {
        "prompts": p_ids,
        "responses": r_ids,
        "input_ids": torch.cat([p_ids, r_ids], 1),
        "attention_mask": torch.cat([p_mask, r_mask], 1),
        "response_mask": r_mask,
    }


def pad_log_probs(log_probs: list[list[float]], response_width: int) -> torch.Tensor:
    """Per-token log-probs right-padded with 0 to (B, response_width), aligned with `responses`."""
    out = torch.zeros((len(log_probs), response_width), dtype=torch.float32)
    for i, lp in enumerate(log_probs):
        lp = lp[:response_width]
        if lp:
            out[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out


def unpack_prompts(batch: Batch) -> list[list[int]]:
    P = batch["prompts"].shape[1]
    mask = batch["attention_mask"][:, :P]
    return [row[m.bool()].tolist() for row, m in zip(batch["prompts"], mask)]


def unpack_responses(batch: Batch) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(batch["responses"], batch["response_mask"])]
