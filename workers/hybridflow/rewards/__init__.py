"""How responses are scored: rules over token ids (rules: pure functions of prompt ids, response ids and ground
truth -> float in [0, 1]), built-in scorers over decoded text (scorers), and a user's reward function run in
sandboxed workers (sandbox, worker; in the job's sandbox pool: remote) behind one call (text)."""
from hybridflow.rewards.rules import RULES, get_rule

__all__ = ["RULES", "get_rule"]
