"""Test support shared by the tests and the benchmarks, kept out of the runtime package: the 3D-HybridEngine's
baselines and synthetic shards (reshard_baselines), the multi-process gloo harness that runs transitions
(reshard_harness) and the megatron-engine step launcher (megatron_launcher). Imported as `support` with tests/ on
sys.path, as pytest puts it there (bench scripts insert it themselves)."""
