"""The operator under load: N RLHFJobs created at once against the kube-apiserver double, then idle, then deleted.

Prints create-to-children latency (ConfigMap, Service and every pod of the gang exist), how many jobs were started
more than once (more than one `Created` event, or more pod creations than the gang has), idle operator CPU per job
at the reconcile interval, delete-to-gone latency, peak RSS of the operator process, and API requests against TCP
connections (one reused client vs a client per call).

    python bench/operator_scale.py --jobs 100 --interval 5

The double (kmock) keeps every request in a log, so it slows down as a run goes on: latencies late in a run
include the double's own cost. The operator is a real `kopf run` process; pods never run (no kubelet): a second
phase marks them Running so that jobs are Running while idle.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kube.apiserver_double import RunningApiServer  # noqa: E402
from kube.harness import Kube, Operator, wait_for  # noqa: E402

TINY = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())


def job_doc(name: str) -> dict:
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name, "namespace": "default"}
    doc["spec"]["metrics"]["port"] = 0  # no driver to poll: idle cost is the operator's own
    return doc


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


class Sampler:
    """Peak RSS of the operator process, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.NoSuchProcess:
                return

    def stop(self) -> None:
        self._stop.set()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--interval", type=float, default=5.0, help="operator reconcile interval (s); product default 5")
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    args = ap.parse_args()
    n, names = args.jobs, [f"scale-{i:03d}" for i in range(args.jobs)]
    gang = 2  # head + one pool pod in examples/tiny-grpo.yaml
    work = Path(tempfile.mkdtemp(prefix="opscale"))
    kubeconfig = str(work / "kubeconfig")
    with RunningApiServer(kubeconfig) as api:
        op = Operator(kubeconfig, work / "operator.log", interval=args.interval).start()
        try:
            wait_for(lambda: api.watching("rlhfjobs"), 60, "kopf's watch")
            sampler = Sampler(op.proc.pid)
            kube = Kube(kubeconfig)
            ready: dict[str, float] = {}
            t0 = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda name: kube.create_job(job_doc(name)), names))
            created_all = time.monotonic() - t0
            while len(ready) < n and time.monotonic() - t0 < 300:
                pods = api.objects("v1/pods", "default")
                cms = {c["metadata"]["name"] for c in api.objects("v1/configmaps", "default")}
                svcs = {s["metadata"]["name"] for s in api.objects("v1/services", "default")}
                per_job: dict[str, int] = {}
                for p in pods:
                    job = p["metadata"]["labels"]["hybridflow.io/job"]
                    per_job[job] = per_job.get(job, 0) + 1
                now = time.monotonic() - t0
                for name in names:
                    if name not in ready and per_job.get(name) == gang and f"{name}-spec" in cms \
                            and f"{name}-head" in svcs:
                        ready[name] = now
                time.sleep(0.25)
            lat = sorted(ready.values())
            print(f"jobs: {n}, reconcile interval {args.interval:g} s; all created in {created_all:.1f} s")
            print(f"create -> children: {len(lat)}/{n} complete; p50 {pct(lat, 50):.2f} s, p95 {pct(lat, 95):.2f} s, "
                  f"max {lat[-1]:.2f} s")

            # Running: a kubelet would report this; then the operator idles over n Running jobs.
            for p in api.objects("v1/pods", "default"):
                kube.set_pod_phase(p["metadata"]["name"], "Running")
            wait_for(lambda: sum((j.get("status") or {}).get("phase") == "Running"
                                 for j in api.objects("hybridflow.io/v1alpha1/rlhfjobs", "default")) == n, 300,
                     "all Running")
            proc = psutil.Process(op.proc.pid)
            time.sleep(args.interval)  # let the transition's writes settle
            c0, w0 = sum(proc.cpu_times()[:2]), time.monotonic()
            time.sleep(args.idle_seconds)
            cpu = (sum(proc.cpu_times()[:2]) - c0) / (time.monotonic() - w0)
            print(f"idle: operator CPU {100 * cpu:.1f}% of a core for {n} Running jobs = {100 * cpu / n:.3f}% per job")

            events = [e for e in kube.events() if e.reason == "Created"]
            created = {x: 0 for x in names}
            for e in events:
                created[e.involved_object.name] = created.get(e.involved_object.name, 0) + 1
            posts: dict[str, int] = {}
            for r in api.requests("POST", "pods", "default"):
                job = ((r.data or {}).get("metadata", {}).get("labels") or {}).get("hybridflow.io/job", "?")
                posts[job] = posts.get(job, 0) + 1
            twice = [x for x in names if created[x] > 1 or posts.get(x, 0) > gang]
            print(f"started more than once: {len(twice)} of {n}"
                  + (f" (e.g. {twice[0]}: {created[twice[0]]} Created events, {posts.get(twice[0])} pod POSTs)"
                     if twice else ""))

            t1, gone = time.monotonic(), {}
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(kube.delete_job, names))
            while len(gone) < n and time.monotonic() - t1 < 300:
                live = {j["metadata"]["name"] for j in api.objects("hybridflow.io/v1alpha1/rlhfjobs", "default")}
                now = time.monotonic() - t1
                for name in names:
                    if name not in live and name not in gone:
                        gone[name] = now
                time.sleep(0.25)
            dl = sorted(gone.values())
            print(f"delete -> gone: {len(dl)}/{n}; p50 {pct(dl, 50):.2f} s, p95 {pct(dl, 95):.2f} s, "
                  f"max {dl[-1]:.2f} s; over 10 s: {sum(1 for x in dl if x > 10)}")
            sampler.stop()
            calls = len(api.handler.log)
            print(f"operator peak RSS: {sampler.peak / 2**20:.0f} MiB")
            print(f"API requests (all clients): {calls}; TCP connections: {len(api.handler.peers)}")
            ok = len(lat) == n and not twice and len(dl) == n and dl[-1] < 10
            return 0 if ok else 1
        finally:
            op.stop()


if __name__ == "__main__":
    sys.exit(main())
