"""What the sandbox costs a reward function: the probe (once per process), a worker's start (once per worker per job,
and again after a timeout), and a call, for each kind of sandbox this machine can run side by side with plain
processes (the reward workers before the sandbox: no launcher, no namespaces).
Usage: python bench/sandbox.py [--starts 10] [--calls 2000]   (medians over --starts; calls through one worker)."""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from hybridflow import sandbox
from hybridflow.rewards import sandbox as rs

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n"


def kinds() -> dict[str, sandbox.Layers]:
    bwrap = sandbox.probe(rs.WORKER_CHECK).bwrap
    out = {"plain process (no sandbox)": sandbox.Layers(None, how="plain")}
    cands = [c for c in sandbox.candidates(bwrap) if sandbox.try_layers(c, rs.WORKER_CHECK, sandbox.Limits()) is None]
    out.update({c.how: c for c in cands})
    return out


def _patched(layers: sandbox.Layers):
    """The plain kind: the worker's own command line, started as before the sandbox (no launcher, no bwrap)."""
    if layers.how == "plain":
        return mock.patch.object(sandbox.launcher, "command", lambda argv, *a, **k: list(argv))  # where spawn calls it
    return mock.MagicMock()


def measure(all_layers: dict[str, sandbox.Layers], path: str, starts: int, calls: int) -> dict[str, tuple]:
    """Kinds interleaved round by round (the machine's load moves): median start, median per-call time over
    blocks of 100 calls."""
    start: dict[str, list[float]] = {k: [] for k in all_layers}
    per_call: dict[str, list[float]] = {k: [] for k in all_layers}
    for _ in range(starts):
        for name, layers in all_layers.items():
            with _patched(layers):
                t0 = time.perf_counter()
                fn = rs.RewardFunction(path, workers=1, layers=layers)
                start[name].append(time.perf_counter() - t0)
                fn.close()
    one = (["x"], ["1"], ["1"], [{}])
    fns = {}
    for name, layers in all_layers.items():
        with _patched(layers):
            fns[name] = rs.RewardFunction(path, workers=1, layers=layers)
            fns[name].score(*one)
    try:
        for _ in range(max(1, calls // 100)):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(100):
                    fn.score(*one)
                per_call[name].append((time.perf_counter() - t0) / 100)
    finally:
        for fn in fns.values():
            fn.close()
    return {k: (statistics.median(start[k]), statistics.median(per_call[k])) for k in all_layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--starts", type=int, default=10)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    sandbox.probe.cache_clear()
    layers = sandbox.probe(rs.WORKER_CHECK)
    probe_s = time.perf_counter() - t0
    print(f"probe: {probe_s * 1000:.0f} ms -> {layers.describe()}")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "reward.py"
        path.write_text(REWARD)
        os.chmod(d, 0o755)
        print(f"{'sandbox':48s} {'worker start':>14s} {'per call':>10s}")
        for name, (start, call) in measure(kinds(), str(path), args.starts, args.calls).items():
            print(f"{name:48s} {start * 1000:11.0f} ms {call * 1e6:7.0f} us")


if __name__ == "__main__":
    main()
