"""A user's reward for examples/word-problems.yaml, with verl's signature.

The ground truth comes from the data's `answer` column (spec.data.answerKey); every other column (`level` here)
arrives in `extra_info`. Extra numeric keys in the returned dict become per-step metrics (`reward_<key>_mean`).
"""
import re

_NUMBER = re.compile(r"-?\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last number of the response is the answer, else 0; `product` tracks the harder kind."""
    numbers = _NUMBER.findall(solution_str)
    correct = float(bool(numbers) and int(numbers[-1]) == int(ground_truth))
    out = {"score": correct, "answered": float(bool(numbers))}
    if extra_info and extra_info.get("level") == "product":
        out["product_correct"] = correct
    return out
