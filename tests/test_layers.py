"""The code's shape, kept: the import-linter contracts of pyproject.toml (layers that import only downward, the
operator importing only `hybridflow.api`, torch-free packages staying torch-free), files small enough to read, and
engines reached through their registries and Protocols only (no engine-name comparisons, no attribute probing)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT

RUNTIME = ROOT / "workers" / "hybridflow"
MAX_LINES = 450


def _runtime_sources() -> list[Path]:
    return sorted(p for p in RUNTIME.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_import_contracts_hold(tmp_path):
    """`lint-imports` over pyproject.toml's [tool.importlinter] contracts (run as the CI would, from the repo root;
    a fresh cache so an earlier graph cannot hide a new import)."""
    run = subprocess.run([sys.executable, "-c", "import sys, importlinter.cli as c; sys.exit(c.lint_imports("
                          f"config_filename='pyproject.toml', cache_dir={str(tmp_path)!r}, no_logo=True))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "broken" in run.stdout and " 0 broken" in run.stdout, run.stdout[-2000:]


def test_every_contract_names_modules_that_exist():
    """A contract over a renamed package would pass vacuously: each module it names must import."""
    import importlib
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    names: set[str] = set()
    for contract in config["contracts"]:
        for key in ("layers", "source_modules", "modules"):
            for entry in contract.get(key, []):
                names.update(n.strip().removeprefix("(").removesuffix(")") for n in entry.split("|"))
    assert names
    for name in sorted(n for n in names if n.startswith("hybridflow")):
        importlib.import_module(name)


@pytest.mark.parametrize("path", _runtime_sources(), ids=lambda p: str(p.relative_to(RUNTIME)))
def test_runtime_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES}): split it by job"


@pytest.mark.parametrize("path", sorted((ROOT / "operator" / "hybridflow_operator").glob("*.py")), ids=lambda p: p.name)
def test_operator_modules_stay_small(path):
    """The operator's modules too (issue 53): each file one job, small enough to read."""
    test_runtime_modules_stay_small(path)


def _engine_names() -> set[str]:
    from hybridflow.api.engines import ROLLOUT_ENGINES, TRAIN_ENGINES

    return set(TRAIN_ENGINES.names()) | set(ROLLOUT_ENGINES.names())


def _mentions_engine(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "engine" or isinstance(n, ast.Name) and n.id == "engine"
               for n in ast.walk(node))


def _engine_name_comparisons(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines comparing something called `engine` with a registered engine's name (==, !=, in)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            strings = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)
                       and isinstance(c.value, str)}
            if strings & names and any(_mentions_engine(s) for s in sides):
                found.append(node.lineno)
    return found


def _engine_probes(tree: ast.AST) -> list[int]:
    """Lines calling hasattr/getattr on something that is an engine (its expression names an engine or rollout)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            target = ast.unparse(node.args[0]) if node.args else ""
            if "engine" in target or "rollout" in target:
                found.append(node.lineno)
    return found


def test_no_engine_kind_is_compared_by_name_outside_the_registry():
    names = _engine_names()
    found = {}
    for path in _runtime_sources():
        if path == RUNTIME / "api" / "engines.py":
            continue
        lines = _engine_name_comparisons(ast.parse(path.read_text()), names)
        if lines:
            found[str(path.relative_to(RUNTIME))] = lines
    assert not found, f"engine kinds compared by name (use the kind's registered facts): {found}"


def test_engines_are_never_probed_for_attributes():
    found = {str(p.relative_to(RUNTIME)): lines for p in _runtime_sources()
             if (lines := _engine_probes(ast.parse(p.read_text())))}
    assert not found, f"hasattr/getattr on engines (declare it in the engine's Protocol): {found}"


def test_the_checks_see_what_they_forbid():
    """The two AST checks above, on code that does what they forbid (so a check that finds nothing is not blind)."""
    names = _engine_names()
    bad = ast.parse("if spec.rollout.engine == 'vllm':\n    pass\nok = fmt == 'hf'\nx = engine in ('megatron',)\n")
    assert _engine_name_comparisons(bad, names) == [1, 4]
    probe = ast.parse("if hasattr(self.engine, 'gather_tp'):\n    pass\ngetattr(model, 'lm_head', None)\n"
                      "getattr(self.rollout, 'model')\n")
    assert _engine_probes(probe) == [1, 4]


# tests/ mirrors the code: a directory of tests per package or top-level module (tests/<package>/ for
# workers/hybridflow/<package>/ or <package>.py, and
# tests/operator/ for the operator), beside these that are not tests of one package.
TEST_DIRS_OF_NO_PACKAGE = {"gpu": "the GPU suite (bench/gpu_check.sh)", "support_tests": "tests of test support",
                           "support": "what tests share", "kube": "the Kubernetes doubles"}
CROSS_CUTTING_TESTS = {"test_layers.py", "test_docs.py", "test_import_cycles.py", "test_gpu_suite.py"}


def test_the_tests_mirror_the_packages():
    tests = ROOT / "tests"
    packages = {p.name for p in RUNTIME.iterdir() if (p / "__init__.py").is_file()} \
        | {p.stem for p in RUNTIME.glob("*.py")} | {"operator"}  # (a package or a module of the top level)
    strays = {d.name for d in tests.iterdir() if d.is_dir() and any(d.glob("test_*.py"))} \
        - packages - set(TEST_DIRS_OF_NO_PACKAGE)
    assert not strays, f"tests/{sorted(strays)} name no package of workers/hybridflow/ (nor the operator): " \
                       "put a package's tests in tests/<package>/"
    loose = {p.name for p in tests.glob("test_*.py")} - CROSS_CUTTING_TESTS
    assert not loose, f"{sorted(loose)}: tests of one package go in tests/<package>/"
