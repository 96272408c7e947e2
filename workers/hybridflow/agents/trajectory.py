"""What is trained of an agent program's episode: its calls to the endpoint (hybridflow.agents.endpoint), each the
exact prompt ids the engine read and the completion ids it wrote, assembled into sequences. Pure functions.

`merged` (spec.rollout.agent.trajectory): consecutive calls whose prompts continue each other (each call's prompt
is the previous prompt, the previous completion, then tokens the model did not write: tool answers, user turns)
are one sequence: the first prompt, then each completion (loss mask 1, the engine's log-probs) and the tokens
between calls (mask 0, log-prob 0). A call that does not continue the previous one (the program edited or dropped
earlier messages, or changed its tools) starts a new chain: what the model wrote before it is not in the new
prompt as it wrote it, so the two cannot be one sequence without training text the model did not write.

Which chain is trained: the LAST one. The program's reward judges its final answer, which the last chain holds;
earlier chains are counted (`breaks`, the agent_trajectory_breaks metric) but not trained in this slice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybridflow.agents.loop import Episode


@dataclass(frozen=True)
class Call:
    """One engine call of an episode: the prompt it read, what it wrote, their log-probs (empty when not asked),
    and whether its prompt continues the previous call's (prompt + completion + new tokens)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    extends_previous: bool


def chains(calls: Sequence[Call]) -> list[Episode]:
    """Every chain of `calls`, in order, each an Episode's sequence: its prompt (`prompt_ids`), then tokens with
    their loss mask (1: the model's) and log-probs (the engine's, 0 where it gave none), and its calls (`turns`).
    Raises ValueError when a call says it extends the previous one but its prompt does not start with the previous
    prompt and completion (the endpoint's bug, never the program's)."""
    out: list[Episode] = []
    previous: Call | None = None
    for c in calls:
        if not c.extends_previous or previous is None or not out:
            out.append(Episode(prompt_ids=list(c.prompt_ids)))
        else:
            before = list(previous.prompt_ids) + list(previous.completion_ids)
            if list(c.prompt_ids[: len(before)]) != before:
                raise ValueError("a call marked as extending the previous one does not start with its prompt and "
                                 "completion")
            out[-1].add(c.prompt_ids[len(before):], model=False)
        given = c.log_probs if len(c.log_probs) == len(c.completion_ids) else ()
        out[-1].add(c.completion_ids, model=True, log_probs=given)
        out[-1].turns += 1
        previous = c
    return out


def merged(calls: Sequence[Call]) -> tuple[Episode | None, int]:
    """The trained sequence of an episode (its last chain; None without calls) and its number of breaks."""
    found = chains(calls)
    return (found[-1] if found else None), max(0, len(found) - 1)
