"""Where the repository is, for tests wherever they sit under tests/ (a test's own `Path(__file__).parents[1]` is
the repository only from tests/ itself)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
TESTS = ROOT / "tests"  # what a subprocess puts on sys.path to import `support` (and `kube`)
