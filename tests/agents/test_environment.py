"""The suite runs inside the project's virtualenv and imports nothing from the machine's global site-packages: a
package that only a hand-made environment had (megatron-core, 2026-11-30) must fail here, not on a fresh machine."""
import importlib.util
import os
import site
import sys
import sysconfig
from pathlib import Path

from support.paths import ROOT


def test_runs_in_a_virtualenv():
    assert sys.prefix != sys.base_prefix, f"{sys.executable} is not a virtualenv: run the tests with `make test`"
    expected = os.environ.get("HYBRIDFLOW_VENV")  # set by the Makefile
    if expected:
        assert Path(sys.prefix).resolve() == Path(expected).resolve()


def test_no_module_comes_from_outside_the_venv():
    import hybridflow.trainer.loop  # noqa: F401  the job's runtime, with torch, vLLM, Ray and megatron behind it
    import hybridflow_operator.handlers  # noqa: F401
    import megatron.core  # noqa: F401
    import ray  # noqa: F401
    import vllm  # noqa: F401

    stdlib = Path(sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["stdlib"])
    allowed = [Path(sys.prefix).resolve(), stdlib.resolve(), ROOT]
    global_site = [Path(p).resolve() for p in site.getsitepackages([sys.base_prefix])]
    outside = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not f:
            continue
        p = Path(f).resolve()
        if any(p.is_relative_to(g) for g in global_site) or not any(p.is_relative_to(a) for a in allowed):
            outside.append(f"{name}: {p}")
    assert not outside, "modules imported from outside the venv:\n" + "\n".join(sorted(outside)[:20])


def test_scikit_learn_is_not_installed():
    """transformers imports scikit-learn (and with it scipy) in every process that loads a model class whenever it
    is installed: 1.2 CPU-s of each job worker's start here (a 2-step `hybridflow run` of examples/tiny-grpo.yaml:
    26.2 busy CPU-s with it, 23.8 without). Nothing a job runs uses it; full mlflow brought it, so the tests' MLflow
    server has a venv of its own (.tools/mlflow, see the Makefile)."""
    assert importlib.util.find_spec("sklearn") is None, (
        "scikit-learn is installed in the test venv (by an older `make install`?): `make distclean` and install "
        "again (uninstalling mlflow by hand also removes files that mlflow-skinny shares with it)")
