"""The e2e world. Locally (`make e2e`): the kube-apiserver double, the operator as a real `kopf run` process, the
kubelet double running pods as processes in their own network namespaces, and cluster DNS, all inside one user +
network + mount + PID namespace that e2e/run.sh creates, so nothing started here can outlive the run (pytest is
PID 1 there; when it exits the kernel ends every process left). With KUBECONFIG set: that cluster."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the API server double and operator harness the operator tests use

INSIDE = os.environ.get("HF_E2E_NAMESPACE") == "1"
REAL = os.environ.get("KUBECONFIG")


def pytest_configure(config):
    if not INSIDE and not REAL:
        raise pytest.UsageError("the e2e scenarios run inside their own namespaces: use `make e2e` (e2e/run.sh), "
                                "or set KUBECONFIG to run them against a cluster")


def pytest_sessionstart(session):
    if INSIDE:  # pytest is PID 1 of its PID namespace, where SIGTERM is ignored unless handled
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    from e2e.worlds import LocalWorld, RealCluster

    workdir = tmp_path_factory.mktemp("e2e")
    w = LocalWorld(workdir) if INSIDE else RealCluster(workdir, REAL, os.environ.get("HYBRIDFLOW_NAMESPACE", "default"))
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(autouse=True)
def no_job_outlives_its_scenario(world):
    """A scenario that fails half-way leaves its jobs running (their pods busy, the operator counting them Running):
    they are deleted, and their processes waited for, before the next scenario starts, so that one failure shows as
    one failure (2026-12-05: a job left by the lifecycle scenario made the next one count two Running jobs)."""
    yield
    from e2e.helpers import delete_job, phase

    for name in world.kube.jobs():
        if phase(world, name) not in ("Succeeded", "Failed"):
            delete_job(world, name, check=False)


def pytest_terminal_summary(terminalreporter):
    from e2e.helpers import RECOVERY_SECONDS

    if RECOVERY_SECONDS:
        terminalreporter.write_line("recovery, a kill -> the next step logged: " + "; ".join(
            f"{policy} {seconds:.1f}s" for policy, seconds in RECOVERY_SECONDS.items()))
