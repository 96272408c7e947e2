"""Weight transfer between a training engine and a generation engine: the transfer a (train, rollout) pair gets
(transfer), the 3D-HybridEngine's layout arithmetic (layout), its train -> generate all-gather
(reshard.gather_micro_dp) and the process groups a megatron actor needs for it (hybrid_engine), and the versioned,
bucketed weight stream to generation replicas on another pool (stream: the actor's rank 0 sends, roles.actor, and
each rollout replica receives, roles.rollout, whenever the trainer's weight sync for a rollout pool of its own runs,
hybridflow.trainer.generation).
Baselines, synthetic shards and the multi-process harness that measure it against other schemes are test support
(tests/support/), not runtime."""
