import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 only (see STACK.md)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Shared across the session so the tiny and SmolLM2 models are built once."""
    return Path(os.environ.get("HYBRIDFLOW_TEST_MODEL_CACHE") or tmp_path_factory.mktemp("models"))


def run_cli(args, cwd, env_extra=None, timeout=900):
    import subprocess

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "hybridflow.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def ray_tmp():
    """Ray's session dir must be short: its socket paths are limited to 107 bytes."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)
