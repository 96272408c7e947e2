"""A user's own environment for multi-turn RL (spec.rollout.agent.environmentFile): guess a whole number with
higher/lower feedback. Standard library only, because it runs inside the sandbox (no network, no files outside
its own /tmp), one instance per episode.

The secret is the row's ground truth (the data's `secret` column, `answerKey`) and the range comes from the row too
(`low`, `high`: columns the prompt does not use reach reset() in `extra_info`), so the data decides the game.

Why this reward: a small model rarely finds the number in a few blind guesses, so a reward for finding it only
would be almost always 0 and GRPO would have nothing to compare. Each step instead earns the share of the range its
feedback rules out (a guess that contradicts earlier feedback rules out nothing), so the episode's summed reward is
the fraction of the range eliminated: 1.0 exactly when the number is found, and more for guesses that use the
feedback.
"""
from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


class Environment:
    """reset(sample) -> first observation; step(action) -> (observation, reward, done, info)."""

    def reset(self, sample: dict[str, Any]) -> str:
        extra = sample.get("extra_info") or {}
        self.low, self.high = int(extra.get("low", 1)), int(extra.get("high", 100))
        self.secret = int(sample["ground_truth"])
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} is outside the row's range {self.low}..{self.high}: fix the "
                             "data file's secret/low/high columns")
        self.lo, self.hi = self.low, self.high  # what the feedback so far still allows
        return ""  # the prompt already states the game

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        found = _NUMBER.search(action)
        if found is None:
            return f"Reply with one whole number from {self.lo} to {self.hi}.", 0.0, False, {"valid": False}
        guess = int(found.group())
        before = self.hi - self.lo + 1
        consistent = self.lo <= guess <= self.hi
        if guess == self.secret:
            self.lo = self.hi = guess
            text, done = "Correct!", True
        elif guess < self.secret:
            self.lo, text, done = max(self.lo, guess + 1), "Higher.", False
        else:
            self.hi, text, done = min(self.hi, guess - 1), "Lower.", False
        reward = (before - (self.hi - self.lo + 1)) / max(1, self.high - self.low)
        return text, reward, done, {"valid": True, "consistent": consistent, "guess": guess}
