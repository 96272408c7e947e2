"""What "it learned" means for the runs that assert it (greedy held-out reward: the fraction of correct continuation
tokens; random guessing scores about 1/15)."""

# examples/tiny-grpo.yaml's 40 steps (tests/trainer/test_end_to_end.py), and the async and one_step_off runs of the same task
# (tests/trainer/test_async_rollout.py, tests/trainer/test_one_step_off.py): at least 0.6, a gain of at least 0.4 over the untrained
# policy
LEARNED_MIN, LEARNED_GAIN = 0.6, 0.4

# the algorithm examples' learning runs (tests/algorithms/test_algorithm_examples.py) and the megatron pipeline-parallel example
# (tests/engines/test_megatron_example.py): at least 0.4, a gain of at least 0.3
EXAMPLES_LEARNED_MIN, EXAMPLES_LEARNED_GAIN = 0.4, 0.3
