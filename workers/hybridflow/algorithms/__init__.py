"""RL algorithms as plug-ins. Importing this package registers every built-in: add one by writing a module with
`register_algorithm(Algorithm(...))` (and its estimator or loss, if new) and importing it below."""
from hybridflow.algorithms import advantages, corrections, kl, losses  # noqa: F401  (registries of the pieces)
from hybridflow.algorithms import dapo, grpo, ppo, remax, safe_rlhf  # noqa: F401  (the algorithms)
from hybridflow.algorithms.base import ALGORITHMS, Algorithm, register_algorithm  # noqa: F401
