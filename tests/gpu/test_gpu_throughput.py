"""bench/throughput.py --gpu on a Qwen2.5-0.5B-shaped model (random weights), tokens/s: the baseline and the
defaults (with vLLM), or the defaults only (another generation engine, for the device's budget)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from gpu_harness import Record, Settings, limit

from support.gpu_jobs import ROOT

JOB_MFU = "update MFU (job's metric)"  # bench/throughput.py's row of the step records' `mfu`

pytestmark = [pytest.mark.gpu, limit("T_THROUGHPUT", 205)]


def test_throughput(suite: Settings, check: Record) -> None:
    """bench/throughput.py --gpu: tokens/s of a Qwen2.5-0.5B-shaped model."""
    c = check
    # the table as JSON goes to a temp file, its runs into results.jsonl: OUT holds at most 8 files that come back
    table = Path(tempfile.mkdtemp(prefix="gpu_check_tp")) / "throughput.json"
    cmd = [sys.executable, str(Path(__file__).with_name("throughput_runner.py")), suite.rollout, suite.tp_runs,
           "1" if suite.cpu else "0", "--", "--steps", str(suite.tp_steps), "--json", str(table),
           *([] if suite.cpu else ["--gpu"])]
    print("  " + " ".join(cmd), flush=True)
    try:
        with open(suite.out / "throughput.log", "a") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        c.facts["rc"] = rc
        c.expect(rc == 0, f"bench/throughput.py exited {rc} (its output: throughput.log)")
        assert table.is_file(), f"{table} was not written"
        runs = json.loads(table.read_text())["runs"]
        c.facts["runs"] = runs
        base, new = runs.get("baseline", {}), runs.get("defaults", {})
        c.expect(new.get("tokens/s", 0) > 0, "no tokens/s in the table")
        if suite.tp_runs != "defaults":
            c.expect(base.get("tokens/s", 0) > 0, "no baseline tokens/s in the table")
        model = "CPU smoke run, tiny model" if suite.cpu else "Qwen2.5-0.5B-shaped"
        c.summary = (f"{model}, {suite.rollout} generation, median of steps 2..{suite.tp_steps}: defaults "
                     f"{new.get('tokens/s', 0):.0f} tok/s, iteration {new.get('iteration s', float('nan')):.2f} s "
                     f"(generate {new.get('generate s', 0):.2f}, update {new.get('actor_update s', 0):.2f}), update "
                     f"MFU {new.get(JOB_MFU, float('nan')):.3f}, peak "
                     f"{new.get('peak GB/rank (max)', float('nan')):.1f} GB/rank")
        if base.get("tokens/s"):
            c.summary += (f"; baseline {base['tokens/s']:.0f} tok/s ({new.get('tokens/s', 0) / base['tokens/s']:.2f}x, "
                          f"peak {base.get('peak GB/rank (max)', float('nan')):.1f} GB/rank)")
    finally:
        shutil.rmtree(table.parent, ignore_errors=True)
    c.verdict()
