"""Training progress for the job's status, read from the driver's own Prometheus endpoint.

Why the operator polls instead of the driver writing status: the driver then needs no Kubernetes client, no
credentials and no RBAC at all (its pods run with no service-account token), the numbers are exactly what
Prometheus and Grafana show, and a wedged driver cannot corrupt the job object. The cost is one small HTTP GET
per job per reconcile interval, done only while the job is Running.
"""
from __future__ import annotations

import http.client
import ipaddress
import math
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

MAX_BYTES = 1 << 20  # the driver's exposition is a few KiB
MAX_VALUE = 1e15
WANTED = {
    "hybridflow_step": "step",
    "hybridflow_steps_target": "totalSteps",
    "hybridflow_throughput_tokens_per_second": "tokensPerSecond",
    "hybridflow_last_checkpoint_step": "lastCheckpointStep",
    "hybridflow_eta_seconds": "etaSeconds",
}


def parse_progress(text: str, job_name: str) -> dict[str, Any]:
    """Status fields from an exposition; only samples labelled with this job count. The text comes from a pod the
    job's author controls: garbage yields nothing, and NaN, infinities and negatives are ignored."""
    out: dict[str, Any] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = WANTED.get(s.name)
                if not key or s.labels.get("rlhfjob") != job_name:
                    continue
                if not math.isfinite(s.value) or s.value < 0 or s.value > MAX_VALUE:
                    continue
                out[key] = round(s.value, 1) if key == "tokensPerSecond" else int(s.value)
    except (ValueError, TypeError, IndexError, KeyError):  # the parser's ways of saying "not an exposition"
        return out
    return out


def merge_progress(status: dict[str, Any], progress: dict[str, Any], checkpoint_dir: str, now_iso: str) -> None:
    """Fold progress into status; the checkpoint time moves only when a newer checkpoint appears."""
    ck = progress.pop("lastCheckpointStep", None)
    status.update(progress)
    if ck and ck != status.get("lastCheckpointStep"):
        status["lastCheckpointStep"] = ck
        status["lastCheckpoint"] = f"{checkpoint_dir.rstrip('/')}/step_{ck:08d}"
        status["lastCheckpointTime"] = now_iso


def fetch(host: str, port: int, deadline: float = 2.0, max_bytes: int = MAX_BYTES) -> str | None:
    """GET http://host:port/metrics within `deadline` seconds in total (not per read), at most `max_bytes`, no
    redirects followed (a 3xx is no answer): whatever the job's pod serves, a reconcile tick stays short and the
    operator talks to nobody but that pod. `host` must be an IP address (the pod's)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    end = time.monotonic() + deadline
    conn = http.client.HTTPConnection(host, port, timeout=deadline)
    try:
        conn.request("GET", "/metrics", headers={"Accept": "text/plain"})
        sock = conn.sock  # http.client drops its reference once the response says the connection closes
        sock.settimeout(max(0.01, end - time.monotonic()))
        resp = conn.getresponse()
        if resp.status != 200:
            return None
        chunks, size = [], 0
        while size <= max_bytes:
            left = end - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(left)
            chunk = resp.read1(65536)
            if not chunk:
                return b"".join(chunks).decode("utf-8", errors="replace")
            chunks.append(chunk)
            size += len(chunk)
        return None  # larger than any exposition of ours: not one
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()
