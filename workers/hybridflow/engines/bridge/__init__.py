"""Weight transfer between a training engine and a generation engine: the transfer a (train, rollout) pair gets
(transfer), the 3D-HybridEngine's layout arithmetic (layout), its train -> generate all-gather
(reshard.gather_micro_dp) and the process groups a megatron actor needs for it (hybrid_engine), and the versioned,
bucketed weight stream to generation replicas on another pool (stream; not wired into a job yet, issue 26).
Baselines, synthetic shards and the multi-process harness that measure it against other schemes are test support
(tests/support/), not runtime."""
