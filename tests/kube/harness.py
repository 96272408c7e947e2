"""Pieces the operator tests share: the API server double, the operator as a real `kopf run` process, and a
kubelet *test double* that only writes pod phases (the e2e harness runs pods for real)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from kubernetes import client, config

from hybridflow.api import API_GROUP as GROUP
from hybridflow.api import PLURAL, VERSION


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], Any], timeout: float = 60, what: str | Callable[[], str] = "condition") -> Any:
    """cond()'s first truthy value; `what` may be a function, called only on a timeout (e.g. to show the logs as
    they are then, not as they were when the wait began)."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}; "
                         f"last value: {last!r}")


class Operator:
    """`python -m hybridflow_operator.main` (kopf run) against the double, with its own metrics and liveness ports."""

    def __init__(self, kubeconfig: str, log_path: Path, interval: float = 0.5, verbose: bool = True) -> None:
        self.kubeconfig, self.log_path, self.interval, self.verbose = kubeconfig, log_path, interval, verbose
        self.metrics_port, self.liveness_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Operator":
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, "HYBRIDFLOW_RECONCILE_INTERVAL": str(self.interval),
               "HYBRIDFLOW_OPERATOR_METRICS_PORT": str(self.metrics_port),
               "HYBRIDFLOW_OPERATOR_METRICS_ADDRESS": "127.0.0.1",
               "HYBRIDFLOW_LIVENESS": f"http://127.0.0.1:{self.liveness_port}/healthz"}
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridflow_operator.main",
                                      *(["--verbose"] if self.verbose else [])], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


class Kube:
    """The tests' own API client (the official Python client, as any tool would use); `namespace` is where its
    calls go when they name none."""

    def __init__(self, kubeconfig: str, namespace: str = "default") -> None:
        self.namespace = namespace
        self.api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def jobs(self, namespace: str | None = None) -> list[str]:
        """Names of the RLHFJobs in the namespace."""
        listed = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace or self.namespace, PLURAL)
        return [j["metadata"]["name"] for j in listed.get("items", [])]

    def create_job(self, doc: dict, namespace: str | None = None) -> dict:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace or self.namespace, PLURAL, doc)

    def job(self, name: str, namespace: str | None = None) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace or self.namespace, PLURAL, name)
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise

    def status(self, name: str, namespace: str | None = None) -> dict:
        return (self.job(name, namespace) or {}).get("status") or {}

    def patch_job(self, name: str, patch: dict, namespace: str | None = None) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace or self.namespace, PLURAL, name,
                                                   patch)

    def delete_job(self, name: str, namespace: str | None = None) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace or self.namespace, PLURAL, name)

    def pods(self, job: str, namespace: str | None = None) -> list:
        return self.core.list_namespaced_pod(namespace or self.namespace,
                                             label_selector=f"hybridflow.io/job={job}").items

    def set_pod_phase(self, name: str, phase: str, namespace: str | None = None, exit_code: int | None = None,
                      pod_ip: str | None = None) -> None:
        """The kubelet double: what a kubelet reports, written through the status subresource."""
        status: dict[str, Any] = {"phase": phase}
        if pod_ip:
            status["podIP"] = pod_ip
        if exit_code is not None:
            status["containerStatuses"] = [{"name": "main", "ready": False, "restartCount": 0, "image": "x",
                                            "imageID": "", "state": {"terminated": {"exitCode": exit_code,
                                                                                     "reason": "Error"}}}]
        self.core.patch_namespaced_pod_status(name, namespace or self.namespace, {"status": status})

    def events(self, namespace: str | None = None) -> list:
        return self.core.list_namespaced_event(namespace or self.namespace).items
