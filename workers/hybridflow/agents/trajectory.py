"""What is trained of an agent program's episode: its calls to the endpoint (hybridflow.agents.endpoint), each the
exact prompt ids the engine read and the completion ids it wrote, assembled into sequences. Pure functions.

`spec.rollout.agent.trajectory` says how they become the episode's trained sequences (its rows in the batch):

* `merged`: consecutive calls whose prompts continue each other (each call's prompt is the previous prompt, the
  previous completion, then tokens the model did not write: tool answers, user turns) are one sequence: the first
  prompt, then each completion (loss mask 1, the engine's log-probs) and the tokens between calls (mask 0, log-prob
  0). A call that does not continue the previous one (the program edited or dropped earlier messages, or changed
  its tools) starts a new chain: what the model wrote before it is not in the new prompt as it wrote it, so the two
  cannot be one sequence without training text the model did not write. Every chain is a sequence of its own, in
  order; the breaks between them are counted (the agent_trajectory_breaks metric).
* `per_call`: every call is a sequence of its own: its prompt ids, then its completion ids (all trained).

Either way the program's reward goes on every sequence of its episode (program_loop.assemble).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybridflow.agents.loop import Episode


@dataclass(frozen=True)
class Call:
    """One engine call of an episode: the prompt it read, what it wrote, their log-probs (empty when not asked),
    and whether its prompt continues the previous call's (prompt + completion + new tokens). `cut`: whether its own
    completion was cut by its chain's budget or the context (the endpoint says; None: not told, the `cut` indices
    decide)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    extends_previous: bool
    cut: bool | None = None


def chains(calls: Sequence[Call], cut: frozenset[int] = frozenset()) -> list[Episode]:
    """Every chain of `calls`, in order, each an Episode's sequence: its prompt (`prompt_ids`), then tokens with
    their loss mask (1: the model's) and log-probs (the engine's, 0 where it gave none), and its calls (`turns`).
    Raises ValueError when a call says it extends the previous one but its prompt does not start with the previous
    prompt and completion (the endpoint's bug, never the program's). `cut`: the calls after which their chain ran
    out of its budget or the context (the endpoint's `Ended.cut`): a chain ending on one is truncated."""
    out: list[Episode] = []
    previous: Call | None = None
    for i, c in enumerate(calls):
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
        out[-1].truncated = i in cut
        previous = c
    return out


def per_call(calls: Sequence[Call], cut: frozenset[int] = frozenset()) -> list[Episode]:
    """One sequence per call: the prompt the engine read, then what it wrote (all trained, the engine's log-probs);
    truncated where the call's own completion was cut by its chain's budget or the context (`Call.cut`; where the
    endpoint did not say, `cut`). A call after which a request continuing it was refused is no truncated row here:
    its completion ended as the model ended it (merged marks the chain, which that request would have extended)."""
    out = []
    for i, c in enumerate(calls):
        e = Episode(prompt_ids=list(c.prompt_ids), turns=1, truncated=c.cut if c.cut is not None else i in cut)
        e.add(c.completion_ids, model=True, log_probs=c.log_probs if len(c.log_probs) == len(c.completion_ids) else ())
        out.append(e)
    return out


TRAJECTORIES = {"merged": chains, "per_call": per_call}  # spec.rollout.agent.trajectory -> its sequences


def sequences(calls: Sequence[Call], trajectory: str = "merged",
              cut: frozenset[int] = frozenset()) -> tuple[list[Episode], int]:
    """The trained sequences of an episode (none without calls), in call order, and its number of breaks (calls
    that do not continue the previous one), whichever `trajectory` (merged or per_call) cuts them."""
    breaks = sum(1 for c in list(calls)[1:] if not c.extends_previous)
    return TRAJECTORIES[trajectory](calls, cut), breaks
