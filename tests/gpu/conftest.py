"""The GPU suite (`pytest -m gpu tests/gpu`; bench/gpu_check.sh runs it with its settings and limits): every test
here is marked `gpu`, which `make test` deselects. Without a GPU the tests fail (torch sees no CUDA device) unless
GPU_CHECK_CPU=1 asks for the CPU smoke run (one CPU rank: the suite's own code paths on gloo). Nothing here
imports torch or CUDA at collection.

Each test's record (facts, notes, the expectations that failed) goes to OUT/results.jsonl, one JSON line per check
with its outcome; OUT/summary.txt is the table of this run's checks."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_harness, beside this file
from gpu_harness import Record, Settings, settings  # noqa: E402

_RESULTS: list[dict] = []
_SECONDS: dict[str, float] = {}
_PREFLIGHT_FAILED: list[str] = []


@pytest.fixture(scope="session")
def suite() -> Settings:
    return settings()


@pytest.fixture(scope="session", autouse=True)
def _a_gpu_or_the_cpu_smoke_run(suite: Settings) -> None:
    """A GPU check without a GPU fails: it is never passed (nor skipped) by a machine that cannot run it."""
    if suite.cpu:
        return
    import torch

    if not torch.cuda.is_available():
        pytest.fail("torch sees no CUDA device: the GPU suite needs one (GPU_CHECK_CPU=1 runs its CPU smoke run; "
                    "`make test` deselects it with -m 'not gpu')", pytrace=False)


@pytest.fixture(autouse=True)
def _after_the_preflight(request) -> None:
    """When the preflight (test_env) failed, the other checks fail at once instead of each finding it out."""
    if _PREFLIGHT_FAILED and request.node.originalname != "test_env":
        pytest.fail(f"not run: the preflight failed ({_PREFLIGHT_FAILED[0]})", pytrace=False)


@pytest.fixture
def check(request) -> Record:
    """This check's record; its name is the test's, less `test_`; its title the docstring's first line."""
    doc = (request.node.function.__doc__ or "").strip().splitlines()
    rec = Record(request.node.originalname.removeprefix("test_"), doc[0] if doc else "")
    request.node.gpu_record = rec
    return rec


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    _SECONDS[item.nodeid] = _SECONDS.get(item.nodeid, 0.0) + report.duration
    rec: Record | None = getattr(item, "gpu_record", None)
    done = report.when == "call" or (report.when == "setup" and not report.passed)
    if rec is None and report.when == "setup" and not report.passed:  # its fixture failed before the record
        doc = (item.function.__doc__ or "").strip().splitlines()
        rec = Record(item.originalname.removeprefix("test_"), doc[0] if doc else "")
    if rec is None or not done:
        return
    status = "PASS" if report.passed else "FAIL"
    error = None if report.passed else str(report.longrepr)[-4000:]
    if not rec.summary and error:
        rec.summary = error.strip().splitlines()[-1][:300]
    if rec.name == "env" and not report.passed:
        _PREFLIGHT_FAILED.append(rec.summary)
    line = rec.json(status, _SECONDS[item.nodeid], error)
    out = Path(os.environ.get("OUT") or "/tmp/gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(line + "\n")
    _RESULTS.append({"status": status, "check": rec.name, "seconds": _SECONDS[item.nodeid], "title": rec.title,
                     "summary": rec.summary, "notes": rec.notes})


def pytest_sessionfinish(session, exitstatus) -> None:
    """OUT/summary.txt: this run's checks, one row each, with their summaries (only when checks ran)."""
    if not _RESULTS:
        return
    width = max(len(r["check"]) for r in _RESULTS)
    text = [f"{'status':6}  {'check':{width}}  {'s':>6}  what / result"]
    for r in _RESULTS:
        text.append(f"{r['status']:6}  {r['check']:{width}}  {r['seconds']:6.1f}  {r['title']}")
        if r["summary"]:
            text.append(f"{'':6}  {'':{width}}  {'':>6}    {r['summary']}")
        text.extend(f"{'':6}  {'':{width}}  {'':>6}    note: {n}" for n in r["notes"])
    failed = any(r["status"] != "PASS" for r in _RESULTS)
    text.append(f"overall: {'FAIL' if failed or exitstatus else 'PASS'}")
    out = Path(os.environ.get("OUT") or "/tmp/gpu_check")
    (out / "summary.txt").write_text("\n".join(text) + "\n")
    print("\n" + "\n".join(text), flush=True)
