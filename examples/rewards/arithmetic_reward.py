"""A user's reward function for examples/smollm2-arithmetic-reward.yaml, with verl's signature.

It runs in HybridFlow's sandboxed reward workers: a call that raises or hangs scores `errorScore` and is reported
with its sample, instead of stopping training. Extra numeric keys in the returned dict become per-step metrics
(`reward_<key>_mean` in steps.jsonl).
"""
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right sum, 0.1 for a wrong number (the format is right), 0 for no number at all."""
    _, eq, rest = solution_str.partition("=")
    m = re.search(r"-?\d+", rest if eq else solution_str)
    if m is None:
        return {"score": 0.0, "answered": 0.0}
    return {"score": 1.0 if int(m.group()) == int(ground_truth) else 0.1, "answered": 1.0}
