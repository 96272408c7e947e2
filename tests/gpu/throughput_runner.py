"""bench/throughput.py's main() on the module support.gpu_jobs.throughput_module adjusts (run by
test_gpu_throughput.py in a process of its own, as throughput.py runs):

  python tests/gpu/throughput_runner.py ROLLOUT RUNS SMOKE -- THROUGHPUT_ARGS...

ROLLOUT: the generation engine; RUNS: defaults | both; SMOKE: 1 for the CPU smoke run's small job."""
from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent / "workers"))

from support.gpu_jobs import QWEN25_05B, ROOT, SMOKE_PATCH, throughput_module  # noqa: E402


def main(argv: list[str]) -> None:
    rollout, runs, smoke = argv[0], argv[1], argv[2] == "1"
    rest = argv[argv.index("--") + 1:]
    gpu = "--gpu" in rest
    tp = throughput_module(rollout, runs, gpu, smoke=smoke)
    print(f"throughput.py with rollout.engine {rollout}, runs: {runs}"
          + (f", model Qwen2.5-0.5B-shaped {QWEN25_05B}" if gpu else "")
          + (f", its CPU job made small (CPU smoke run): {SMOKE_PATCH}" if smoke else "")
          + (f"; vLLM-only switches left out: {', '.join(tp.dropped)}" if tp.dropped else ""), flush=True)
    sys.argv = [str(ROOT / "bench" / "throughput.py"), *rest]
    tp.main()


if __name__ == "__main__":
    main(sys.argv[1:])
