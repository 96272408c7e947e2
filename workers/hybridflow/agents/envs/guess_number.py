"""Guess the number with feedback: the model guesses, the environment answers higher or lower, until it is right or
out of turns. The secret is the sample's ground truth (an int); the reward is 1 for the right guess, less for each
extra turn it took."""
from __future__ import annotations

import re
from typing import Any


class GuessNumber:
    def reset(self, sample: dict[str, Any]) -> str:
        self.secret = int(sample["ground_truth"])
        self.turns = 0
        return ""  # the prompt states the game

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.turns += 1
        found = re.findall(r"-?\d+", action)
        if not found:
            return "Answer with a number.", 0.0, False, {"valid": False}
        guess = int(found[-1])
        if guess == self.secret:
            return "Correct!", max(0.2, 1.0 - 0.2 * (self.turns - 1)), True, {"valid": True}
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False, {"valid": True}
