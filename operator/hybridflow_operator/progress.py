"""Training progress for the job's status, read from the driver's own Prometheus endpoint.

Why the operator polls instead of the driver writing status: the driver then needs no Kubernetes client, no
credentials and no RBAC at all (its pods run with no service-account token), the numbers are exactly what
Prometheus and Grafana show, and a wedged driver cannot corrupt the job object. The cost is one small HTTP GET
per job per reconcile interval, done only while the job is Running, by a few threads shared by every job
(`Poller`), never by the job's reconcile tick: a driver that answers slowly (up to `fetch`'s 2 s deadline) holds
none of the threads that reconcile the other jobs.
"""
from __future__ import annotations

import ipaddress
import math
import socket
import threading
import time
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hybridflow.api.names import SANDBOX_MISSING_METRIC

MAX_BYTES = 1 << 20  # the driver's exposition is a few KiB
MAX_VALUE = 1e15
WANTED = {
    "hybridflow_step": "step",
    "hybridflow_steps_target": "totalSteps",
    "hybridflow_throughput_tokens_per_second": "tokensPerSecond",
    "hybridflow_last_checkpoint_step": "lastCheckpointStep",
    "hybridflow_eta_seconds": "etaSeconds",
    "hybridflow_recoveries_total": "recoveries",
    "hybridflow_recovery_seconds": "lastRecoverySeconds",
    "hybridflow_last_iteration_seconds": "lastStepSeconds",  # folded into slowestStepSeconds
}
# The layers the sandbox pool runs user code without (from SANDBOX_MISSING_METRIC): a condition, not a status field.
SANDBOX_MISSING = "sandboxMissing"
ROUNDED = {"tokensPerSecond", "lastRecoverySeconds", "lastStepSeconds"}  # floats, to 0.1; the rest are counts


def parse_progress(text: str, job_name: str) -> dict[str, Any]:
    """Status fields from an exposition; only samples labelled with this job count. The text comes from a pod the
    job's author controls: garbage yields nothing, and NaN, infinities and negatives are ignored."""
    out: dict[str, Any] = {}
    missing: set[str] = set()
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == SANDBOX_MISSING_METRIC and s.labels.get("rlhfjob") == job_name and s.value == 1:
                    missing.add(s.labels.get("layer", "")[:32])
                    continue
                key = WANTED.get(s.name)
                if not key or s.labels.get("rlhfjob") != job_name:
                    continue
                if not math.isfinite(s.value) or s.value < 0 or s.value > MAX_VALUE:
                    continue
                out[key] = round(s.value, 1) if key in ROUNDED else int(s.value)
    except (ValueError, TypeError, IndexError, KeyError):  # the parser's ways of saying "not an exposition"
        return out
    if missing - {""}:
        out[SANDBOX_MISSING] = sorted(missing - {""})[:8]
    return out


def merge_progress(status: dict[str, Any], progress: dict[str, Any], checkpoint_dir: str, now_iso: str) -> None:
    """Fold progress into status; the checkpoint time moves only when a newer checkpoint appears, the progress time
    (the stall clock, gang.stalled) when the step moves, and the slowest step only up. The gang's start-up ends
    (startupTime dropped) at its driver's first step: a driver reports its last step's seconds only once it has
    completed one, while the step it reports before that is the one it resumed from."""
    ck = progress.pop("lastCheckpointStep", None)
    step_seconds = progress.pop("lastStepSeconds", None)
    if step_seconds is not None:
        status["slowestStepSeconds"] = max(step_seconds, status.get("slowestStepSeconds", 0.0))
        if status.pop("startupTime", None) is not None:
            status["lastProgressTime"] = now_iso
    if "step" in progress and progress["step"] != status.get("step"):
        status["lastProgressTime"] = now_iso
    status.update(progress)
    if ck and ck != status.get("lastCheckpointStep"):
        status["lastCheckpointStep"] = ck
        status["lastCheckpoint"] = f"{checkpoint_dir.rstrip('/')}/step_{ck:08d}"
        status["lastCheckpointTime"] = now_iso


def fetch(host: str, port: int, deadline: float = 2.0, max_bytes: int = MAX_BYTES) -> str | None:
    """GET http://host:port/metrics within `deadline` seconds in total, headers included, at most `max_bytes`, no
    redirects followed (a 3xx is no answer): whatever the job's pod serves (a byte every second, forever), a
    reconcile tick stays short and the operator talks to nobody but that pod. `host` must be an IP address (the
    pod's). An HTTP/1.0 request, so the answer is the bytes up to the close: no chunked encoding to trust."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    end = time.monotonic() + deadline
    data = bytearray()
    try:
        with socket.create_connection((host, port), timeout=deadline) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: " + host.encode() + b"\r\nAccept: text/plain\r\n\r\n")
            while True:
                left = end - time.monotonic()
                if left <= 0 or len(data) > max_bytes:
                    return None  # too slow, or larger than any exposition of ours
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    head, sep, body = bytes(data).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/1.") or status[1] != b"200":
        return None
    return body.decode("utf-8", errors="replace")


class Poller:
    """Every job's progress fetches, run by `workers` shared threads: at most that many at once, whatever number of
    jobs run. A tick never waits for its fetch: `poll` hands the job's next fetch over and returns the answer of
    the one before (started one tick earlier), so a job's status shows its driver's numbers of one interval ago."""

    def __init__(self, workers: int = 8) -> None:
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="progress")
        self._lock = threading.Lock()
        self._jobs: dict[Hashable, tuple[Hashable, Future]] = {}  # job -> (what was fetched, its fetch)

    def poll(self, job: Hashable, host: str, port: int, target: Hashable = None) -> str | None:
        """The answer of the job's last fetch, when it is in and was of the same `target` (e.g. the head pod: an
        old head's numbers must not count for a new one), else None; starts the next fetch unless one is still in
        flight (a slow driver has one fetch at a time)."""
        target = (host, port, target)
        with self._lock:
            last = self._jobs.get(job)
            if last is not None and not last[1].done():
                return None
            self._jobs[job] = (target, self._pool.submit(fetch, host, port))
        if last is None or last[0] != target:
            return None
        try:
            return last[1].result()
        except Exception:  # noqa: BLE001 - fetch answers None for what it expects; anything else is no answer too
            return None

    def forget(self, job: Hashable) -> None:
        """The job is not Running (or gone): drop its last answer."""
        with self._lock:
            self._jobs.pop(job, None)

    def in_flight(self) -> int:
        with self._lock:
            return sum(1 for _, f in self._jobs.values() if not f.done())
