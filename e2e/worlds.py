"""The two places the scenarios run, behind one interface: `LocalWorld` (the doubles, inside the e2e namespaces)
and `RealCluster` (whatever KUBECONFIG points at, e.g. kind with the CPU worker image). Scenarios only call what
is here, plus `world.kube` (the official Python client) and `world.local` for the checks only a local run can make
(processes and pod sandboxes on this machine)."""
from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from kube.apiserver_double import RunningApiServer
from kubernetes.client.rest import ApiException
from kube.harness import Kube, Operator, free_port, wait_for

from hybridflow.models.builders import IMAGE_MODELS, SMOLLM2_DIR

from e2e.dns import ClusterDNS, resolv_conf
from e2e.kubelet import KubeletDouble
from e2e.netns import GATEWAY, PodNetwork


OPERATOR_METRICS_PORT = 8080  # the chart's metrics.port default (helm/hybridflow/values.yaml)


class _Kubectl:
    kubeconfig: str

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        out = subprocess.run(["kubectl", *args], env={**os.environ, "KUBECONFIG": self.kubeconfig},
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode:
            raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out


class LocalWorld(_Kubectl):
    local = True

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        handler = logging.FileHandler(workdir / "kubelet.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger("kubelet-double").addHandler(handler)
        logging.getLogger("kubelet-double").setLevel(logging.INFO)
        self.kubeconfig = str(workdir / "kubeconfig")
        hosts, resolv = workdir / "hosts", workdir / "resolv.conf"
        hosts.write_text("127.0.0.1 localhost\n")
        resolv.write_text(resolv_conf(GATEWAY))
        for src, dst in ((hosts, "/etc/hosts"), (resolv, "/etc/resolv.conf")):  # cluster DNS, namespace-wide
            subprocess.run(["mount", "--bind", str(src), dst], check=True)
        os.makedirs("/run/netns", exist_ok=True)  # pod sandboxes' handles stay in this mount namespace, not the host's
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run/netns"], check=True)
        # "The image" is this machine's environment; what the worker image bakes in at build time (converted models)
        # lives in a directory of this run, mounted where the image has it (see bake_models).
        self._made_dirs = _make_mount_point(IMAGE_MODELS)
        (workdir / "image-models").mkdir()
        subprocess.run(["mount", "--bind", str(workdir / "image-models"), str(IMAGE_MODELS)], check=True)
        self.net = PodNetwork()
        self.api = RunningApiServer(self.kubeconfig).__enter__()
        self.kube = Kube(self.kubeconfig)
        self.operator = Operator(self.kubeconfig, workdir / "operator.log").start()
        self.kubelet = KubeletDouble(self.kube, self.net, workdir, hosts).start()
        self.dns = ClusterDNS(lambda: self.kubelet.names, GATEWAY).start()
        wait_for(lambda: self.api.watching("rlhfjobs"), 60, "kopf's watch on rlhfjobs")

    def close(self) -> None:
        self.dns.stop()
        self.kubelet.stop()
        self.operator.stop()
        self.api.__exit__(None, None, None)
        subprocess.run(["umount", "/etc/hosts", "/etc/resolv.conf", str(IMAGE_MODELS)], check=False)
        for d in reversed(self._made_dirs):
            try:
                d.rmdir()
            except OSError:
                pass

    def bake_models(self) -> None:
        """What the CPU worker image's build does (images/worker-cpu/Dockerfile): SmolLM2 converted into
        IMAGE_MODELS, so pods read it instead of each converting it at start. Copied from the test suite's model
        cache when it has it (HYBRIDFLOW_TEST_MODEL_CACHE, which `make test` shares), else converted once."""
        import shutil

        if (IMAGE_MODELS / SMOLLM2_DIR / "config.json").is_file():
            return
        cached = Path(os.environ.get("HYBRIDFLOW_TEST_MODEL_CACHE") or "/nonexistent") / SMOLLM2_DIR
        if (cached / "config.json").is_file():  # files with the modes the build gives them, not the cache's copies'
            shutil.copytree(cached, IMAGE_MODELS / SMOLLM2_DIR, copy_function=shutil.copyfile)
        else:
            subprocess.run([sys.executable, "-c", "from hybridflow.models.builders import IMAGE_MODELS, build_smollm2; "
                            "build_smollm2(IMAGE_MODELS)"], check=True, capture_output=True, timeout=600)

    # --- what scenarios do and read ---

    def restart_operator(self) -> None:
        """SIGKILL the operator mid-flight and start a new one (as a Deployment would)."""
        watches = self.api.watches("rlhfjobs")
        self.operator.stop(kill=True)
        self.operator = Operator(self.kubeconfig, self.workdir / "operator.log").start()
        wait_for(lambda: self.api.watches("rlhfjobs") > watches, 60, "the new operator's watch")

    def kill_pod_processes(self, pod: str, namespace: str = "default") -> None:
        assert self.kubelet.kill_processes(namespace, pod) > 0, f"{pod} had no processes"

    def freeze_pod(self, pod: str, namespace: str = "default") -> None:
        assert self.kubelet.stop_processes(namespace, pod) > 0, f"{pod} had no processes"

    def pod_running(self, pod: str, namespace: str = "default") -> bool:
        return self.kubelet.running(pod, namespace)

    def evict_pod(self, pod: str, namespace: str = "default") -> None:
        """What the Eviction API does (a drain, a preemption), which the API server double lacks: the pod gets a
        DisruptionTarget condition and a graceful deletion; the kubelet double stops it, and the object goes once
        its processes are gone (the kubelet's final delete)."""
        now = datetime.datetime.now(datetime.timezone.utc)
        self.kube.core.patch_namespaced_pod_status(pod, namespace, {"status": {"conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
             "message": "Eviction API: evicting", "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}]}})
        deadline = (now + datetime.timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.kube.core.patch_namespaced_pod(pod, namespace, {"metadata": {"deletionTimestamp": deadline}})
        wait_for(lambda: not self.kubelet.running(pod, namespace), 60, f"{pod} stopped")
        try:
            self.kube.core.delete_namespaced_pod(pod, namespace)
        except ApiException as err:
            if err.status != 404:  # the operator, restarting the gang, may have deleted it first
                raise

    def logs(self, pod: str, namespace: str = "default") -> str:
        return self.kubelet.logs(namespace, pod)

    def step_log(self, job: str, namespace: str = "default", claim: str | None = None) -> list[int]:
        return [r["step"] for r in self.step_records(job, namespace, claim)]

    def step_records(self, job: str, namespace: str = "default", claim: str | None = None) -> list[dict]:
        claim = claim or f"{job}-checkpoints"
        path = self.workdir / "volumes" / namespace / claim / namespace / job / "steps.jsonl"
        return _records(path.read_text() if path.exists() else "")

    def fill_volume(self, claim: str, files: dict[str, bytes], namespace: str = "default") -> None:
        """Files into a PersistentVolumeClaim (created by the caller): here, the directory that backs it."""
        root = self.workdir / "volumes" / namespace / claim
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)

    def metrics_targets(self, job: str, namespace: str = "default") -> dict[str, str]:
        """Scrape targets: the job's current head (after a gang restart, the newest one) and the operator."""
        head = current_head(self.kube, job, namespace)
        head_ip = wait_for(lambda: _pod_ip(self.kube, head, namespace), 60, f"{head} pod IP")
        return {"driver": f"{head_ip}:8000", "operator": f"127.0.0.1:{self.operator.metrics_port}"}

    def leftovers(self, job: str, namespace: str = "default") -> list[str]:
        """Pod sandboxes and processes of the job's pods still on this machine."""
        import psutil

        out = [f"netns {n}" for n in self.net.namespaces() if n.startswith(f"{namespace}.{job}-")]
        for p in psutil.process_iter(["pid", "environ"]):
            try:
                pod = (p.info["environ"] or {}).get("POD_NAME", "")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if pod.startswith(f"{job}-"):
                out.append(f"pid {p.info['pid']} of pod {pod}")
        return out


class RealCluster(_Kubectl):
    """A cluster with the chart installed (`helm install hybridflow helm/hybridflow`) and the worker image loaded."""

    local = False

    def __init__(self, workdir: Path, kubeconfig: str, operator_namespace: str = "default") -> None:
        self.workdir, self.kubeconfig, self.operator_namespace = workdir, kubeconfig, operator_namespace
        self.kube = Kube(kubeconfig)
        self._forwards: list[subprocess.Popen] = []

    def close(self) -> None:
        for p in self._forwards:
            p.terminate()

    def bake_models(self) -> None:
        """The worker image converted its models when it was built (images/worker-cpu/Dockerfile)."""

    def restart_operator(self) -> None:
        sel = "app.kubernetes.io/name=hybridflow,app.kubernetes.io/component=operator"
        self.kubectl("-n", self.operator_namespace, "delete", "pod", "-l", sel, "--grace-period=0", "--force")
        wait_for(lambda: "Running" in self.kubectl("-n", self.operator_namespace, "get", "pod", "-l", sel, "-o",
                                                   "jsonpath={.items[*].status.phase}", check=False).stdout,
                 180, "the operator's replacement pod")

    def kill_pod_processes(self, pod: str, namespace: str = "default") -> None:
        self.kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", "kill -9 -1", check=False)

    def freeze_pod(self, pod: str, namespace: str = "default") -> None:
        # every process but the exec'd shell, the container's PID 1 last
        self.kubectl("-n", namespace, "exec", pod, "--", "sh", "-c", "kill -STOP -1; kill -STOP 1", check=False)

    def pod_running(self, pod: str, namespace: str = "default") -> bool:
        out = self.kubectl("-n", namespace, "get", "pod", pod, "-o", "jsonpath={.status.phase}", check=False)
        return out.stdout == "Running"

    def evict_pod(self, pod: str, namespace: str = "default") -> None:
        from kubernetes import client

        self.kube.core.create_namespaced_pod_eviction(pod, namespace, client.V1Eviction(
            metadata=client.V1ObjectMeta(name=pod, namespace=namespace)))

    def logs(self, pod: str, namespace: str = "default") -> str:
        return self.kubectl("-n", namespace, "logs", pod, "--all-containers", check=False).stdout

    def step_log(self, job: str, namespace: str = "default", claim: str | None = None) -> list[int]:
        return [r["step"] for r in self.step_records(job, namespace, claim)]

    def fill_volume(self, claim: str, files: dict[str, bytes], namespace: str = "default") -> None:
        """Files into a PersistentVolumeClaim through a throwaway pod that mounts it (`kubectl cp` into it)."""
        import tempfile

        name = f"fill-{claim}-{int(time.time())}"[:63]
        image = "hybridflow/worker-cpu:0.1.0"
        overrides = {"spec": {"restartPolicy": "Never", "containers": [{
            "name": "fill", "image": image, "command": ["sleep", "600"],
            "volumeMounts": [{"name": "v", "mountPath": "/fill"}]}],
            "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": claim}}]}}
        self.kubectl("-n", namespace, "run", name, f"--image={image}", "--restart=Never",
                     f"--overrides={json.dumps(overrides)}")
        try:
            self.kubectl("-n", namespace, "wait", "--for=condition=Ready", f"pod/{name}", "--timeout=180s",
                         timeout=200)
            with tempfile.TemporaryDirectory() as tmp:
                for rel, data in files.items():
                    local = Path(tmp) / rel
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_bytes(data)
                    self.kubectl("-n", namespace, "exec", name, "--", "mkdir", "-p", str(Path("/fill", rel).parent))
                    self.kubectl("-n", namespace, "cp", str(local), f"{name}:/fill/{rel}")
        finally:
            self.kubectl("-n", namespace, "delete", "pod", name, "--wait=false", check=False)

    def step_records(self, job: str, namespace: str = "default", claim: str | None = None) -> list[dict]:
        """Read steps.jsonl from the job's checkpoint claim with a throwaway pod of the worker image."""
        claim = claim or f"{job}-checkpoints"
        name = f"{job}-steplog-{int(time.time())}"
        image = self.kube.job(job, namespace)["spec"].get("kubernetes", {}).get("image", "hybridflow/worker-cpu:0.1.0")
        overrides = {"spec": {"restartPolicy": "Never", "containers": [{
            "name": "cat", "image": image, "command": ["sh", "-c", f"cat /ckpt/{namespace}/{job}/steps.jsonl || true"],
            "volumeMounts": [{"name": "c", "mountPath": "/ckpt"}]}],
            "volumes": [{"name": "c", "persistentVolumeClaim": {"claimName": claim}}]}}
        self.kubectl("-n", namespace, "run", name, f"--image={image}", "--restart=Never",
                     f"--overrides={json.dumps(overrides)}")
        wait_for(lambda: self.kubectl("-n", namespace, "get", "pod", name, "-o", "jsonpath={.status.phase}",
                                      check=False).stdout in ("Succeeded", "Failed"), 180, "the step-log reader")
        text = self.kubectl("-n", namespace, "logs", name).stdout
        self.kubectl("-n", namespace, "delete", "pod", name, "--wait=false", check=False)
        return _records(text)

    def metrics_targets(self, job: str, namespace: str = "default") -> dict[str, str]:
        """Port-forwards to the job's current head and the operator (new ones on every call: heads change)."""
        driver, operator = free_port(), free_port()
        for target, port, ns in ((f"pod/{current_head(self.kube, job, namespace)}", f"{driver}:8000", namespace),
                                 ("svc/hybridflow-metrics", f"{operator}:{OPERATOR_METRICS_PORT}", self.operator_namespace)):
            self._forwards.append(subprocess.Popen(
                ["kubectl", "-n", ns, "port-forward", target, port], env={**os.environ, "KUBECONFIG": self.kubeconfig},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return {"driver": f"127.0.0.1:{driver}", "operator": f"127.0.0.1:{operator}"}

    def leftovers(self, job: str, namespace: str = "default") -> list[str]:
        return []  # processes and sandboxes live on the nodes; the pods being gone is what the API can show


def _make_mount_point(target: Path) -> list[Path]:
    """Create a mount point and the parents it lacks; returns what was created (to remove after the run)."""
    missing = []
    p = target
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir()
    return list(reversed(missing))


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def current_head(kube, job: str, namespace: str = "default") -> str:
    """The head pod of the job's current gang generation (`-g<restarts>`): a gang restart replaces the head."""
    st = (kube.job(job, namespace) or {}).get("status") or {}
    return f"{job}-head-g{int(st.get('restarts', 0))}"


def _pod_ip(kube, name: str, namespace: str) -> str | None:
    try:
        pod = kube.core.read_namespaced_pod(name, namespace)
    except Exception:
        return None
    return pod.status.pod_ip if pod.status else None
