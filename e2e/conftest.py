"""The e2e world: the kube-apiserver double, the operator as a real `kopf run` process, the kubelet double running
pods as processes in their own network namespaces, and a cluster DNS hosts file. Everything runs inside one
user + network + mount + PID namespace that `make e2e` (e2e/run.sh) creates, so nothing started here can outlive
the run: when pytest (PID 1 there) exits, the kernel ends every process left in it."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the API server double and operator harness the operator tests use

from kube.apiserver_double import RunningApiServer  # noqa: E402
from kube.harness import Kube, Operator, wait_for  # noqa: E402

from e2e.dns import ClusterDNS, resolv_conf  # noqa: E402
from e2e.kubelet import KubeletDouble  # noqa: E402
from e2e.netns import GATEWAY, PodNetwork  # noqa: E402

INSIDE = os.environ.get("HF_E2E_NAMESPACE") == "1"


def pytest_configure(config):
    if not INSIDE:
        raise pytest.UsageError("the e2e scenarios run inside their own namespaces: use `make e2e` (e2e/run.sh)")


class World:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        handler = logging.FileHandler(workdir / "kubelet.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger("kubelet-double").addHandler(handler)
        logging.getLogger("kubelet-double").setLevel(logging.INFO)
        self.kubeconfig = str(workdir / "kubeconfig")
        self.hosts = workdir / "hosts"
        self.hosts.write_text("127.0.0.1 localhost\n")
        resolv = workdir / "resolv.conf"
        resolv.write_text(resolv_conf(GATEWAY))
        for src, dst in ((self.hosts, "/etc/hosts"), (resolv, "/etc/resolv.conf")):  # cluster DNS, ns-wide
            subprocess.run(["mount", "--bind", str(src), dst], check=True)
        self.net = PodNetwork()
        self.api = RunningApiServer(self.kubeconfig).__enter__()
        self.kube = Kube(self.kubeconfig)
        self.operator = self.start_operator()
        self.kubelet = KubeletDouble(self.kube, self.net, workdir, self.hosts).start()
        self.dns = ClusterDNS(lambda: self.kubelet.names, GATEWAY).start()

    def start_operator(self) -> Operator:
        op = Operator(self.kubeconfig, self.workdir / "operator.log").start()
        return op

    def restart_operator(self, kill: bool = True) -> None:
        self.operator.stop(kill=kill)
        self.operator = self.start_operator()

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(["kubectl", *args], env={**os.environ, "KUBECONFIG": self.kubeconfig},
                             capture_output=True, text=True, timeout=60)
        if check and out.returncode:
            raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out

    def close(self) -> None:
        self.dns.stop()
        self.kubelet.stop()
        self.operator.stop()
        self.api.__exit__(None, None, None)
        subprocess.run(["umount", "/etc/hosts", "/etc/resolv.conf"], check=False)


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("e2e"))
    try:
        wait_for(lambda: w.api.watching("rlhfjobs"), 60, "kopf's watch on rlhfjobs")
        yield w
    finally:
        w.close()
