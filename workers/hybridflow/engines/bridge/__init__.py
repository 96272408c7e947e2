"""Weight transfer between a training engine and a generation engine: the 3D-HybridEngine's layout arithmetic
(layout), its train -> generate all-gather (reshard.gather_micro_dp) and the process groups a megatron actor needs
for it (hybrid_engine). Baselines, synthetic shards and the multi-process harness that measure it against other
schemes are test support (tests/support/), not runtime."""
