"""Test support shared by the tests and the benchmarks, kept out of the runtime package: the 3D-HybridEngine's
baselines and synthetic shards (reshard_baselines), the multi-process gloo harness that runs transitions
(reshard_harness) and the megatron-engine step launcher (megatron_launcher); and whatever tests in different files
share (test modules never import each other nor conftest.py): the repository's paths (paths), running the CLI and
example jobs (jobs), subprocesses (processes), learning thresholds (learning), the Helm chart (helm), inputs and
doubles of the engines and agents (megatron_inputs, tiny_actor, agent_doubles), float64 algorithm references
(algorithm_references), the async example's runs (async_runs), greedy checks against HF (hf_greedy) and the
machine's processes (process_watch). Imported as `support` with tests/ on sys.path: pyproject's
`[tool.pytest.ini_options] pythonpath` puts it there for any test directory (bench scripts and e2e/conftest.py insert
it themselves; a test's subprocess gets support.paths.TESTS on its path)."""
