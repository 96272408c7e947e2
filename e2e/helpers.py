"""What the scenarios ask of the cluster, phrased once."""
from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-grpo-k8s.yaml"
PVC = ROOT / "e2e" / "manifests" / "pvc.yaml"
# What the fault scenarios measured: a kill -> the next step logged, in seconds, by restart policy (conftest prints
# them at the end of the run, so every CI log shows them).
RECOVERY_SECONDS: dict[str, float] = {}


def live_pod_names(kube, job: str) -> list[str]:
    return sorted(p.metadata.name for p in kube.pods(job) if not p.metadata.deletion_timestamp)


def job_variant(tmp: Path, name: str, **changes) -> Path:
    """The example under another name (with its own checkpoint claim), spec sections overridden; PVC + job."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["kubernetes"]["checkpointPvc"] = f"{name}-checkpoints"
    for section, values in changes.items():
        if isinstance(values, list):  # resourcePools: the list replaced whole
            doc["spec"][section] = values
        else:
            doc["spec"].setdefault(section, {}).update(values)
    pvc = yaml.safe_load(PVC.read_text())
    pvc["metadata"]["name"] = f"{name}-checkpoints"
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all([pvc, doc], sort_keys=False))
    return path


def phase(world, job: str) -> str | None:
    return world.kube.status(job).get("phase")


def prom_value(resp: dict) -> float | None:
    result = resp.get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


def delete_job(world, name: str, check: bool = True, timeout: float = 180) -> None:
    """Delete the job and wait until it, its pods and every process of theirs are gone (`check`: a refused delete
    fails at once)."""
    from kube.harness import wait_for

    world.kubectl("delete", "rlhfjob", name, "--wait=false", check=check)
    wait_for(lambda: world.kube.job(name) is None and not world.leftovers(name), timeout, f"{name} and its pods gone")
