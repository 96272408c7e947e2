"""Training progress for the job's status, read from the driver's own Prometheus endpoint.

Why the operator polls instead of the driver writing status: the driver then needs no Kubernetes client, no
credentials and no RBAC at all (its pods run with no service-account token), the numbers are exactly what
Prometheus and Grafana show, and a wedged driver cannot corrupt the job object. The cost is one small HTTP GET
per job per reconcile interval, done only while the job is Running.
"""
from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

WANTED = {
    "hybridflow_step": "step",
    "hybridflow_steps_target": "totalSteps",
    "hybridflow_throughput_tokens_per_second": "tokensPerSecond",
    "hybridflow_last_checkpoint_step": "lastCheckpointStep",
    "hybridflow_eta_seconds": "etaSeconds",
}


def parse_progress(text: str, job_name: str) -> dict[str, Any]:
    """Status fields from an exposition; only samples labelled with this job count."""
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = WANTED.get(s.name)
            if key and s.labels.get("rlhfjob") == job_name:
                out[key] = round(s.value, 1) if key == "tokensPerSecond" else int(s.value)
    return out


def merge_progress(status: dict[str, Any], progress: dict[str, Any], checkpoint_dir: str, now_iso: str) -> None:
    """Fold progress into status; the checkpoint time moves only when a newer checkpoint appears."""
    ck = progress.pop("lastCheckpointStep", None)
    status.update(progress)
    if ck and ck != status.get("lastCheckpointStep"):
        status["lastCheckpointStep"] = ck
        status["lastCheckpoint"] = f"{checkpoint_dir.rstrip('/')}/step_{ck:08d}"
        status["lastCheckpointTime"] = now_iso


def fetch(url: str, timeout: float = 2.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - URL built from the pod IP
            return resp.read().decode()
    except (OSError, ValueError):
        return None
