"""The GPU suite (tests/gpu, `pytest -m gpu`; bench/gpu_check.sh runs it) as far as this machine can check it: its
jobs validate (parse_job: what `bench/gpu_check.sh --dry-run` runs), it collects without importing torch or CUDA,
every test of it is marked `gpu`, and the selections `make test` runs leave it out."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from support.gpu_jobs import every_job, parse

from support.paths import ROOT

GPU_TESTS = ROOT / "tests" / "gpu"


@pytest.mark.parametrize("rollout", ["vllm", "hf"])
def test_every_job_of_the_suite_validates(rollout):
    from hybridflow.capacity import tiny_params

    docs = every_job(rollout, "both" if rollout == "vllm" else "defaults", steps=3)
    jobs = {name: parse(doc) for name, doc in docs.items()}
    engines = {(j.spec.training.engine, j.spec.rollout.engine) for j in jobs.values()}
    assert {("fsdp", rollout), ("megatron", rollout)} <= engines
    assert (("megatron", "megatron") in engines) == (rollout != "vllm")
    throughput = [name for name in docs if name.startswith("throughput-")]
    assert throughput == (["throughput-baseline", "throughput-defaults"] if rollout == "vllm"
                          else ["throughput-defaults"])
    for name, job in jobs.items():
        if name.startswith("throughput-"):
            assert job.spec.resource_pools[0].device == "gpu" and job.spec.rollout.engine == rollout
            assert tiny_params(job.spec.models.actor.tiny) > 450e6, "not Qwen2.5-0.5B-shaped"


def _marks(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            return [ast.unparse(e) for e in getattr(node.value, "elts", [node.value])]
    return []


def test_every_gpu_test_module_is_marked_gpu():
    modules = sorted(GPU_TESTS.glob("test_*.py"))
    assert len(modules) >= 5
    assert {p.name: "pytest.mark.gpu" in _marks(p) for p in modules} == {p.name: True for p in modules}


def _collect(*args: str, torch_free: bool = True) -> list[str]:
    """Node ids pytest collects with `args`, in a fresh process that then says whether torch was imported."""
    code = ("import sys, pytest; rc = pytest.main([*sys.argv[1:], '--collect-only', '-q', '-p', 'no:cacheprovider']);"
            " print('TORCH-IMPORTED' if 'torch' in sys.modules else 'TORCH-NOT-IMPORTED'); sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 5), run.stdout[-3000:] + run.stderr[-2000:]  # 5: nothing selected
    assert "TORCH-NOT-IMPORTED" in run.stdout or not torch_free, run.stdout[-2000:]
    return [ln for ln in run.stdout.splitlines() if "::" in ln]


def test_the_suite_collects_without_torch_and_make_test_leaves_it_out():
    ids = _collect("-m", "gpu", "tests/gpu")
    assert {i.split("::")[1] for i in ids} >= {"test_env", "test_vllm_sync", "test_sleep_wake", "test_nccl",
                                               "test_fp32_master", "test_megatron", "test_megatron_gen",
                                               "test_meta_load", "test_throughput"}
    for selection in ("not slow and not gpu", "slow and not gpu"):  # scripts/run-tests.sh's two runs
        assert _collect("-m", selection, "tests/gpu") == []
    # collected first, the suite's conftest (gpu.conftest: tests/gpu is a package) does not shadow tests/conftest.py
    # (whose fixtures and support imports the other tests use); test_end_to_end, wherever under tests/ it is
    end_to_end = next(ROOT.glob("tests/**/test_end_to_end.py")).relative_to(ROOT)
    _collect("-m", "not slow and not gpu", "tests/gpu", str(end_to_end), torch_free=False)  # no error


def test_gpu_check_sh_dry_run_collects_what_the_device_runs(tmp_path):
    """`bench/gpu_check.sh --dry-run --rollout hf` (the lent device's run): the checks it selects collect, its jobs
    validate; sleep_wake (vLLM's) and megatron with hf generation (left out for the budget) are not selected."""
    import os

    run = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", "--rollout", "hf"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    selected = [ln.split("::")[1] for ln in run.stdout.splitlines() if ln.startswith("tests/gpu/") and "::" in ln]
    assert selected == ["test_env", "test_vllm_sync", "test_nccl", "test_fp32_master", "test_megatron_gen",
                        "test_meta_load", "test_throughput"]
