"""Holding evaluation rows out of a prompt file that has no eval set of its own (spec.data.eval unset): a seeded
choice of spec.data.evalPrompts rows, and no training row that is the same row as a held-out one.

A row is its prompt together with its ground truth and extra info, not its prompt alone: an environment's data often
shares one prompt text ("play") over rows that differ in what the environment gets (the game in the ground truth
and extra info). Held out by prompt, one held-out row would take every such row out of training; held out by
identity, only its copies go. Its extra info's per-row ids (ROW_ID_KEYS: verl's extra_info.index and split, the index
column pandas writes) say where a row is, not what it is: left out, else every row would be unique and an exact copy
of a held-out row (the same prompt and ground truth) would be trained on."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

ROW_ID_KEYS = frozenset({"index", "split", "__index_level_0__"})


@dataclass(frozen=True)
class HeldOut:
    eval_rows: list[int]
    train_rows: list[int]
    usable: int  # the usable rows both came from
    distinct_prompts: int  # of those rows
    copies: int  # training rows removed as copies of a held-out row (beyond the held-out rows themselves)

    def shortfall(self) -> str:
        """Why holding out left few training rows, and what to do: for the message that refuses too few."""
        return (f"; holding out spec.data.evalPrompts = {len(self.eval_rows)} rows for evaluation took "
                f"{len(self.eval_rows) + self.copies} of the {self.usable} usable rows ({self.copies} were copies of "
                f"a held-out row: the same prompt, ground truth and extra info), and those {self.usable} rows share "
                f"{self.distinct_prompts} distinct prompt(s). Give spec.data.eval a set of its own (then no training "
                "row is held out), or lower spec.data.evalPrompts or spec.trainer.promptsPerStep")


def hold_out(rows: Sequence[int], prompt_digests: Sequence[str], identity: Callable[[int], Hashable], n: int,
             seed: int) -> HeldOut:
    """`n` of `rows` (indices into the table; `prompt_digests` by index) for evaluation, chosen with `seed`, and the
    others for training less any with the same `identity` (read only for rows whose prompt is a held-out one's)."""
    order = list(rows)
    random.Random(seed).shuffle(order)
    held = sorted(order[:n])
    held_prompts = {prompt_digests[i] for i in held}
    held_ids = {identity(i) for i in held}
    train = [i for i in rows if prompt_digests[i] not in held_prompts or identity(i) not in held_ids]
    return HeldOut(held, train, len(rows), len({prompt_digests[i] for i in rows}), len(rows) - len(train) - n)
