"""Test doubles of the agent loop's policy side: a scripted policy (which turn each episode writes next) and its
character-per-token codec. Shared by tests/agents/test_agents.py, tests/agents/test_agent_bad_input.py and
tests/agents/test_agent_sandbox.py."""
from __future__ import annotations

import threading
import time
from typing import Sequence


class ScriptedPolicyDouble:
    """A test double for the policy's choices (which turn an episode writes next), so that the loop's scheduling
    can be asserted turn by turn; the engine's own behaviour is tested with the real engine below. Each episode's
    turns are text, encoded one character per token (ids = code points), ending with the stop token 0."""

    def __init__(self, turns: dict[int, list[str]]) -> None:
        self.turns, self.calls, self.lock = turns, [], threading.Lock()
        self.done: dict[int, int] = {}

    def generate(self, rows: Sequence[int], contexts, max_tokens):
        with self.lock:
            self.calls.append((time.monotonic(), list(rows)))
        out = []
        for r, m in zip(rows, max_tokens):
            k = self.done.get(r, 0)
            self.done[r] = k + 1
            ids = ([ord(c) for c in self.turns[r][k]] + [0])[:m]  # cut at the turn's budget, as an engine does
            out.append((ids, [-0.5] * len(ids)))
        return out


class CharCodec:
    """Characters as tokens (the double's vocabulary): observations in the plain-text form."""

    stop_token_ids = frozenset({0})

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)

    def observation_ids(self, parts, closed):
        return [ord(c) for _, t in parts for c in f"[{t}]"]
