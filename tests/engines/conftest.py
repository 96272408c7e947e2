"""The engine tests' own fixtures (what every layer shares is in tests/conftest.py)."""
from pathlib import Path

import pytest


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    """support.tiny_actor's tiny model, built for this test (the engine tests' one-rank actor and ragged batch)."""
    from support.tiny_actor import build_tiny_model

    return build_tiny_model(tmp_path / "m")
