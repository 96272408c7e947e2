"""Token lists <-> the fixed-width tensors that every rank produces, so shards from different ranks concatenate."""
from __future__ import annotations

import torch

from hybridflow.single_controller.batch import Batch

PAD = 0


def pack_rollout(prompts: list[list[int]], responses: list[list[int]], prompt_width: int, response_width: int,
                 loss_masks: list[list[int]] | None = None) -> dict:
    """Left-pad prompts to `prompt_width`, right-pad responses to `response_width`.

    Returns tensors: prompts (B,P), responses (B,R), input_ids (B,P+R), attention_mask (B,P+R), response_mask (B,R).
    A multi-turn response holds tokens the model did not write (tools' and environments' answers): `loss_masks`
    marks the model's own, and response_mask is that loss mask (what is trained, what log-probs and advantages are
    taken over), while attention_mask covers every real token. Without `loss_masks` they are the same.
    """
    B = len(prompts)
    p_ids = torch.full((B, prompt_width), PAD, dtype=torch.long)
    p_mask = torch.zeros((B, prompt_width), dtype=torch.long)
    r_ids = torch.full((B, response_width), PAD, dtype=torch.long)
    r_mask = torch.zeros((B, response_width), dtype=torch.long)
    r_loss = torch.zeros((B, response_width), dtype=torch.long) if loss_masks is not None else r_mask
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
            if loss_masks is not None:
                r_loss[i, : len(r)] = torch.tensor(loss_masks[i][: len(r)], dtype=torch.long)
    return {
        "prompts": p_ids,
        "responses": r_ids,
        "input_ids": torch.cat([p_ids, r_ids], 1),
        "attention_mask": torch.cat([p_mask, r_mask], 1),
        "response_mask": r_loss,
    }


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: each real token's index among the real tokens of its row (0 on pads)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def pad_log_probs(log_probs: list[list[float]], response_width: int) -> torch.Tensor:
    """Per-token log-probs right-padded with 0 to (B, response_width), aligned with `responses`."""
    out = torch.zeros((len(log_probs), response_width), dtype=torch.float32)
    for i, lp in enumerate(log_probs):
        lp = lp[:response_width]
        if lp:
            out[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out


def versions_of(response_mask: torch.Tensor, version: int) -> torch.Tensor:
    """Each response token's policy version for responses one version generated whole: (B, R) int64, -1 past a
    response (the rollout log and the staleness rule read these; a partial rollout mixes versions)."""
    real = response_mask.bool()
    return torch.where(real, torch.full(real.shape, version, dtype=torch.int64),
                       torch.full(real.shape, -1, dtype=torch.int64))


def unpack_prompts(batch: Batch) -> list[list[int]]:
    P = batch["prompts"].shape[1]
    mask = batch["attention_mask"][:, :P]
    return [row[m.bool()].tolist() for row, m in zip(batch["prompts"], mask)]


def unpack_responses(batch: Batch) -> list[list[int]]:
    """Each response's own tokens, the model's only (a multi-turn one's turns, joined): what a reward scores."""
    return [row[m.bool()].tolist() for row, m in zip(batch["responses"], batch["response_mask"])]


def response_lengths(batch: Batch) -> torch.Tensor:
    """Each response's length in tokens, its tools' and environments' answers included: the position after its last
    real token (a multi-turn response's loss mask has holes; its attention mask does not)."""
    P = batch["prompts"].shape[1]
    return batch["attention_mask"][:, P:].sum(1)


def unpack_trajectories(batch: Batch) -> list[list[int]]:
    """Each response's every token, the answers of tools and environments between its turns included."""
    return [row[:n].tolist() for row, n in zip(batch["responses"], response_lengths(batch).tolist())]


# --- micro-batches without padding waste ---------------------------------------------------------------------------

WHOLE_SEQUENCE_COLUMNS = ("input_ids", "attention_mask")  # (B, P + R): left-padded prompt, right-padded response


def _response_token_columns(batch: Batch) -> list[str]:
    """Columns with one value per response token (responses, masks, log-probs, advantages, values...)."""
    R = batch["responses"].shape[1]
    return [k for k, v in batch.tensors.items()
            if v.dim() == 2 and v.shape[1] == R and k not in ("prompts", *WHOLE_SEQUENCE_COLUMNS)]


def trim_padding(batch: Batch) -> Batch:
    """The batch cut to its longest prompt and longest response: prompt columns that are padding in every row and
    response columns past every row's end go. Nothing a row attends to changes, so its outputs do not either."""
    P = batch["prompts"].shape[1]
    mask = batch["attention_mask"]
    prompt_len = int(mask[:, :P].sum(1).max()) if len(batch) else 0
    resp_len = max(1, int(response_lengths(batch).max())) if len(batch) else 1
    cut, keep_r = P - prompt_len, resp_len
    tensors = dict(batch.tensors)
    tensors["prompts"] = batch["prompts"][:, cut:]
    for k in WHOLE_SEQUENCE_COLUMNS:
        tensors[k] = batch[k][:, cut: P + keep_r]
    for k in _response_token_columns(batch):
        tensors[k] = batch[k][:, :keep_r]
    return Batch(tensors, batch.non_tensors, dict(batch.meta))


def token_budget_groups(prompt_lens: list[int], response_lens: list[int], max_rows: int,
                        budget: int, slots: list[int] | None = None) -> list[list[int]]:
    """Items grouped into micro-batches, longest first: a group grows while its items x (longest prompt + most
    slots x longest response) stays within `budget` padded tokens, and up to `max_rows` items. An item is a row
    (one slot), or the rows of one prompt packed as one sequence (`slots[i]` responses after the prompt). The
    budget, not a row count, bounds memory, so short rows travel in larger micro-batches and long ones in smaller."""
    slots = slots or [1] * len(prompt_lens)
    order = sorted(range(len(prompt_lens)), key=lambda i: -(prompt_lens[i] + slots[i] * response_lens[i]))
    groups: list[list[int]] = []
    group: list[int] = []
    p_max = r_max = n_max = 0
    for i in order:
        p, r, n = max(p_max, prompt_lens[i]), max(r_max, response_lens[i]), max(n_max, slots[i])
        if group and ((len(group) + 1) * (p + n * r) > budget or len(group) >= max_rows):
            groups.append(group)
            group, p, r, n = [], prompt_lens[i], response_lens[i], slots[i]
        group.append(i)
        p_max, r_max, n_max = p, r, n
    if group:
        groups.append(group)
    return groups


def slots_per_sequence(prompt_len: int, response_len: int) -> int:
    """How many responses one shared-prompt sequence holds: the most k whose sequence's attention, (p + k r)^2
    query-key pairs, stays within twice that of the k rows unshared, k (p + r)^2. Sharing saves most where the
    prompt is long against the responses; past this the quadratic attention costs more than the prompt saves."""
    p, r = max(prompt_len, 0), max(response_len, 1)
    k = 1
    while (p + (k + 1) * r) ** 2 <= 2 * (k + 1) * (p + r) ** 2:
        k += 1
    return k


def prompt_groups(batch: Batch) -> list[list[int]]:
    """Row indices grouped by identical prompt (tokens and padding), groups in order of first appearance, each cut
    into runs of at most `slots_per_sequence` rows: the rows that share one forward of their prompt
    (engines.train.shared_prompt)."""
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    key = torch.cat([batch["prompts"], batch["attention_mask"][:, :P]], 1)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(key.tolist()):
        groups.setdefault(tuple(row), []).append(i)
    k = slots_per_sequence(P, R)
    return [g[i: i + k] for g in groups.values() for i in range(0, len(g), k)]


def computed_tokens(batch: Batch, shared: bool) -> int:
    """The tokens a forward over `batch` computes: every row's prompt and response, or with `shared` each group's
    prompt once (what FLOP/s and MFU count, so that sharing shows as less work rather than as faster hardware)."""
    P = batch["prompts"].shape[1]
    if not shared:
        return int(batch["attention_mask"].sum())
    prompt_lens = batch["attention_mask"][:, :P].sum(1)
    return int(sum(int(prompt_lens[g[0]]) for g in prompt_groups(batch)) + response_lengths(batch).sum())


def micro_batches(batch: Batch, rows: int, dynamic: bool, shared: bool = False) -> list[tuple[list[int], Batch]]:
    """(row indices, micro-batch) pairs covering the batch. Fixed: `rows` rows each, full width. Dynamic: the same
    token budget (rows x full width), filled with length-sorted rows, each micro-batch cut to its own lengths;
    `shared`: filled with whole prompt groups instead, a group costing its prompt once and each response."""
    n = len(batch)
    if not dynamic or "responses" not in batch:
        return [(list(range(i, min(i + rows, n))), batch.index(slice(i, i + rows))) for i in range(0, n, rows)]
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    prompt_lens = batch["attention_mask"][:, :P].sum(1).tolist()
    response_lens = response_lengths(batch).clamp_min(1).tolist()
    units = prompt_groups(batch) if shared else [[i] for i in range(n)]
    packed = token_budget_groups([prompt_lens[u[0]] for u in units], [max(response_lens[i] for i in u) for u in units],
                                 max_rows=n, budget=rows * (P + R), slots=[len(u) for u in units])
    groups = [[i for unit in g for i in units[unit]] for g in packed]
    return [(g, trim_padding(batch.index(torch.tensor(g)))) for g in groups]


def to_count(split: list[tuple[list[int], Batch]], count: int) -> list[tuple[list[int], Batch]]:
    """`split` (micro_batches' pairs) as exactly `count` micro-batches, `count` >= len(split): the one with the
    most rows is halved until there are enough; where every one holds a single row, padding micro-batches make up
    the rest: no rows of their own (empty indices), a copy of the first row to compute, outputs dropped, loss
    weighing nothing. Ranks that shard one model (FSDP) must run equally many forwards, each of which gathers
    every layer over all of them, and dynamic micro-batches cut each rank's own rows by their lengths."""
    out = list(split)
    if count < len(out):
        raise ValueError(f"{len(out)} micro-batches cannot be cut into fewer ({count})")
    while len(out) < count:
        k = max(range(len(out)), key=lambda i: len(out[i][0]))
        idx, mb = out[k]
        if len(idx) < 2:
            first = out[0][1].index(slice(0, 1))
            out += [([], first)] * (count - len(out))
            break
        half = len(idx) // 2
        out[k: k + 1] = [(idx[:half], mb.index(slice(0, half))), (idx[half:], mb.index(slice(half, len(idx))))]
    return out


def merge_rows(parts: list, rows: list[list[int]], response_width: int | None) -> object:
    """The outputs of micro-batches (a tensor or a tuple of tensors each) as one output in the batch's row order;
    per-token outputs of cut micro-batches are padded back to `response_width` with zeros."""
    if not parts:
        return parts
    single = isinstance(parts[0], torch.Tensor)
    columns = list(zip(*[(p,) if single else p for p in parts]))
    order = torch.tensor([i for g in rows for i in g])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    merged = []
    for col in columns:
        if response_width is not None and col[0].dim() == 2:
            col = [torch.nn.functional.pad(t, (0, response_width - t.shape[1])) for t in col]
        merged.append(torch.cat(col)[inverse])
    return merged[0] if single else tuple(merged)
