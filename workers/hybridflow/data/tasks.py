"""Prompt sets generated from a seed, so a job needs no dataset download and held-out prompts never leak into training.

A task yields (prompt token ids, ground truth) pairs; the ground truth is what the task's reward rule checks.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from hybridflow.rewards.rules import successor


@dataclass(frozen=True)
class Sample:
    prompt: list[int]
    truth: Any
    data_source: str = ""  # verl's reward arguments: which data set the sample is from, and anything else it carries
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    # the prompt as the data gives it, before the chat template (a string, or chat messages as verl's prompt column):
    # what a user's agent program reads as sample["prompt"] and sends in its own calls
    raw_prompt: Any = None


def increment_samples(n: int, vocab: int, prompt_len: int, seed: int) -> list[Sample]:
    """Counting sequences `s, s+1, ...` over ids 1..vocab-1 (wrapping); the response should keep counting."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(2, max(2, prompt_len))
        tok = rng.randint(1, vocab - 1)
        prompt = [tok]
        for _ in range(length - 1):
            tok = successor(tok, vocab)
            prompt.append(tok)
        out.append(Sample(prompt, vocab, "increment"))
    return out


def arithmetic_samples(n: int, seed: int, encode: Callable[[str], list[int]], max_operand: int = 9) -> list[Sample]:
    """'What is a + b?' in the model's chat format; the truth is a + b."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        text = f"What is {a} + {b}? Answer with the number only."
        out.append(Sample(encode(text), a + b, "arithmetic", raw_prompt=text))
    return out


# Three worked examples before each question of the products task: how a tool is called and its answer read back.
# A 135M model does not call tools from their description alone (its tool-call rate is ~0 with none and with one
# example, ~0.7 with three: measured on SmolLM2-135M-Instruct, 24 samples at temperature 1).
def _worked(a: int, b: int) -> list[dict[str, str]]:
    call = '{"name": "calculator", "arguments": {"expression": "%d * %d"}}' % (a, b)
    return [{"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "user", "content": f"<tool_response>\n{a * b}\n</tool_response>"},
            {"role": "assistant", "content": f"{a * b}"}]


TOOL_EXAMPLES = [*_worked(12, 34), *_worked(271, 45), *_worked(806, 17)]


def products_samples(n: int, seed: int, encode: Callable[[Any], list[int]]) -> list[Sample]:
    """'What is a * b?' with a of 3 digits and b of 2: a product a small model cannot do in its head, so it
    learns to call a tool (after worked examples in the prompt); the truth is a * b."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        messages = [*TOOL_EXAMPLES, {"role": "user", "content": f"What is {a} * {b}?"}]
        out.append(Sample(encode(messages), a * b, "products", raw_prompt=messages))
    return out


def split_train_eval(samples: list[Sample], n_eval: int) -> tuple[list[Sample], list[Sample]]:
    """Held-out prompts are chosen so that none of them appears (as the same ids) in the training set."""
    eval_set = samples[:n_eval]
    seen = {tuple(s.prompt) for s in eval_set}
    train = [s for s in samples[n_eval:] if tuple(s.prompt) not in seen]
    return train, eval_set


class PromptStream:
    """Deterministic epoch-shuffled batches with a resumable position (saved in checkpoints)."""

    def __init__(self, samples: Sequence[Sample], batch_size: int, seed: int, position: int = 0) -> None:
        if len(samples) < batch_size:
            raise ValueError(f"{len(samples)} prompts cannot fill a batch of {batch_size}")
        self.samples, self.batch_size, self.seed, self.position = samples, batch_size, seed, position

    def _order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.samples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def next_batch(self) -> list[Sample]:
        per_epoch = len(self.samples) // self.batch_size
        epoch, k = divmod(self.position, per_epoch)
        order = self._order(epoch)
        self.position += 1
        return [self.samples[i] for i in order[k * self.batch_size : (k + 1) * self.batch_size]]
