"""What the scenarios ask of the cluster, phrased once."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-grpo-k8s.yaml"
PVC = ROOT / "e2e" / "manifests" / "pvc.yaml"


def pod_ip(kube, name: str, namespace: str = "default") -> str | None:
    try:
        pod = kube.core.read_namespaced_pod(name, namespace)
    except Exception:
        return None
    return pod.status.pod_ip if pod.status else None


def live_pod_names(kube, job: str) -> list[str]:
    return sorted(p.metadata.name for p in kube.pods(job) if not p.metadata.deletion_timestamp)


def job_variant(tmp: Path, name: str, **changes) -> Path:
    """The example under another name (and its own checkpoint claim), with spec sections overridden."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["kubernetes"]["checkpointPvc"] = f"{name}-checkpoints"
    for section, values in changes.items():
        doc["spec"].setdefault(section, {}).update(values)
    pvc = yaml.safe_load(PVC.read_text())
    pvc["metadata"]["name"] = f"{name}-checkpoints"
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all([pvc, doc], sort_keys=False))
    return path


def step_log(world, job: str) -> list[int]:
    """Steps recorded in the job's step log on its checkpoint volume, in order."""
    path = world.workdir / "volumes" / "default" / f"{job}-checkpoints" / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def prom_value(resp: dict) -> float | None:
    result = resp.get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None
