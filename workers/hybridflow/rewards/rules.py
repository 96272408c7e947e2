"""Registered reward rules. A rule sees token ids and the sample's ground truth, plus a decoder when the task has
a real tokenizer; it never sees the policy. Adding a rule = one function + one `RULES.add` line (or
`@RULES.register("name")`); the spec validates spec.models.reward.rule and cost.rule against RULES."""
from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from hybridflow.registry import Registry

RewardRule = Callable[[Sequence[int], Sequence[int], Any, Callable[[Sequence[int]], str] | None], float]


def increment(prompt: Sequence[int], response: Sequence[int], truth: Any, decode: Any = None) -> float:
    """Fraction of response tokens that continue the count: each equals successor(previous token).

    truth is the vocabulary size; ids 1..V-1 count up and wrap (0 is padding).
    """
    vocab = int(truth)
    if not response:
        return 0.0
    prev = prompt[-1]
    good = 0
    for tok in response:
        if tok == successor(prev, vocab):
            good += 1
        prev = tok
    return good / len(response)


def successor(tok: int, vocab: int) -> int:
    return tok % (vocab - 1) + 1


_INT = re.compile(r"-?\d+")


def final_answer(text: str) -> int | None:
    """The integer after the first '=' ("3 + 5 = 8" -> 8), else the first integer in the text, else None."""
    _, eq, rest = text.partition("=")
    m = _INT.search(rest if eq else text)
    return int(m.group()) if m else None


def arithmetic_exact(prompt: Sequence[int], response: Sequence[int], truth: Any, decode: Any = None) -> float:
    """1 when the response's final answer (after '=', else its first integer) equals a + b, else 0."""
    if decode is None:
        raise ValueError("the arithmetic_exact rule needs a tokenizer (a model with one, e.g. smollm2)")
    return 1.0 if final_answer(decode(response)) == int(truth) else 0.0


_TOOL_CALL = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.DOTALL)


def final_number_exact(prompt: Sequence[int], response: Sequence[int], truth: Any, decode: Any = None) -> float:
    """1 when the last integer the model wrote outside its tool calls equals the truth (a multi-turn response is
    the model's turns joined: the numbers in its calls are not its answer), else 0."""
    if decode is None:
        raise ValueError("the final_number_exact rule needs a tokenizer (a model with one, e.g. smollm2)")
    found = _INT.findall(_TOOL_CALL.sub(" ", decode(response)).replace(",", ""))
    return 1.0 if found and int(found[-1]) == int(truth) else 0.0


def top_ids(prompt: Sequence[int], response: Sequence[int], truth: Any, decode: Any = None) -> float:
    """Fraction of response tokens among the vocabulary's three highest ids: a cost for the increment task (truth is
    the vocabulary size), which a correct count meets about one token in five; Safe-RLHF keeps it under a limit."""
    vocab = int(truth)
    return sum(tok >= vocab - 3 for tok in response) / len(response) if response else 0.0


RULES: Registry[RewardRule] = Registry("reward rule", plural="rules")
for _rule in (increment, arithmetic_exact, top_ids, final_number_exact):
    RULES.add(_rule.__name__, _rule)
TASK_DEFAULT_RULE = {"increment": "increment", "arithmetic": "arithmetic_exact", "products": "final_number_exact"}


def get_rule(name: str) -> RewardRule:
    return RULES[name]  # an unknown name: "unknown reward rule 'x'; registered rules: ..."
