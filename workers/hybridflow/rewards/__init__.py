"""Rule-based rewards: pure functions of (prompt ids, response ids, ground truth) -> float in [0, 1]."""
from hybridflow.rewards.rules import RULES, get_rule

__all__ = ["RULES", "get_rule"]
