"""The operator under load: N RLHFJobs created at once against the kube-apiserver double, then idle, then deleted.

Prints create-to-children latency (ConfigMap, Service and every pod of the gang exist), how many jobs were started
more than once (more than one `Created` event, or more pod creations than the gang has), idle operator CPU per job
at the reconcile interval, delete-to-gone latency, peak RSS of the operator process, and API requests against TCP
connections (one reused client vs a client per call).

    python bench/operator_scale.py --jobs 100 --interval 5

Two more cases count the operator's API requests in the double's request log over a steady window (issue 24, N8):

    python bench/operator_scale.py --case suspended --suspended-jobs 5000 --interval 5 --window 60
        N jobs created suspended: once all are Suspended, the operator's requests per second (and its CPU), then
        how long a resumed job takes to get its pods
    python bench/operator_scale.py --case waiting --waiting-jobs 10 --interval 0.5 --window 60
        N jobs whose checkpoint PVC does not exist: after their first tick, requests per job per tick, POSTs, and
        how many were answered 409 (a create of what exists)

The double (kmock, with tests/kube/apiserver_double.py's index and matching) costs the same per request however
many objects it holds and requests it has served; it runs in this process, so its CPU is not counted as the
operator's. The operator is a real `kopf run` process; pods never run (no kubelet): a second phase marks them
Running so that jobs are Running while idle. The machine's load average is printed with each case: the operator
and the double share its cores with whatever else runs.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kube.apiserver_double import RunningApiServer  # noqa: E402
from kube.harness import Kube, Operator, wait_for  # noqa: E402

TINY = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())


def job_doc(name: str, **run_policy: object) -> dict:
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name, "namespace": "default"}
    doc["spec"]["metrics"]["port"] = 0  # no driver to poll: idle cost is the operator's own
    if run_policy:
        doc["spec"]["runPolicy"] = dict(run_policy)
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
    ap.add_argument("--case", choices=["scale", "suspended", "waiting", "all"], default="scale")
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--interval", type=float, default=None,
                    help="operator reconcile interval (s); product default 5 (waiting case: 0.5 unless given)")
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument("--suspended-jobs", type=int, default=5000)
    ap.add_argument("--waiting-jobs", type=int, default=10)
    ap.add_argument("--window", type=float, default=60.0, help="steady window (s) the requests are counted over")
    ap.add_argument("--settle-timeout", type=float, default=1800.0, help="most seconds to wait for all Suspended")
    args = ap.parse_args()
    import hybridflow_operator

    print(f"operator code: {Path(hybridflow_operator.__file__).parent}")
    rc = 0
    for case, fn, interval in (("scale", scale_case, 5.0), ("suspended", suspended_case, 5.0),
                               ("waiting", waiting_case, 0.5)):
        if args.case in (case, "all"):
            load = os.getloadavg()
            print(f"== {case} (load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
            rc |= fn(args, args.interval if args.interval is not None else interval)
            load = os.getloadavg()
            print(f"== {case} done (load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})", flush=True)
    return rc


OPERATOR_AGENTS = ("kopf", "hybridflow-operator")  # User-Agents of the operator's requests (kopf's and ours)


def operator_requests(api: RunningApiServer, start: int, end: int | None = None) -> list:
    return [r for r in api.handler.log[start:end] if r.agent.startswith(OPERATOR_AGENTS)]


def breakdown(requests: list) -> str:
    counts = Counter(f"{r.method} {r.plural or '-'}{f' {r.status}' if r.status and r.status >= 400 else ''}"
                     for r in requests)
    return ", ".join(f"{k}: {v}" for k, v in counts.most_common(8)) or "none"


def timer_ticks(op: Operator, start: int) -> int:
    """kopf's timer runs logged since the log offset `start` (INFO: one line per tick, resting or not)."""
    return op.log()[start:].count("Timer 'reconcile' succeeded.")


def cpu_seconds(pid: int) -> float:
    return sum(psutil.Process(pid).cpu_times()[:2])


@contextlib.contextmanager
def against_double(prefix: str, interval: float,
                   verbose: bool = False) -> Iterator[tuple[RunningApiServer, Operator, Kube]]:
    """The double, a `kopf run` operator whose watch of RLHFJobs is open on it (an object created sooner can be
    missed), and the tests' client: where every case starts. The operator is stopped on the way out."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    kubeconfig = str(work / "kubeconfig")
    with RunningApiServer(kubeconfig) as api:
        op = Operator(kubeconfig, work / "operator.log", interval=interval, verbose=verbose).start()
        try:
            wait_for(lambda: api.watching("rlhfjobs"), 60, "kopf's watch")
            yield api, op, Kube(kubeconfig)
        finally:
            op.stop()


@dataclass
class Window:
    """What the operator did over a steady window: its API requests, CPU seconds, wall seconds and timer ticks."""
    requests: list
    cpu: float
    wall: float
    ticks: int


def steady_window(api: RunningApiServer, op: Operator, seconds: float) -> Window:
    """Watch the operator for `seconds` while nothing else happens (the double's log and the operator's own)."""
    start, c0, w0, l0 = len(api.handler.log), cpu_seconds(op.proc.pid), time.monotonic(), len(op.log())
    time.sleep(seconds)
    end, cpu, wall = len(api.handler.log), cpu_seconds(op.proc.pid) - c0, time.monotonic() - w0
    return Window(operator_requests(api, start, end), cpu, wall, timer_ticks(op, l0))


def suspended_case(args: argparse.Namespace, interval: float) -> int:
    """N jobs created suspended: the operator's steady API requests per second once all are Suspended."""
    n, names = args.suspended_jobs, [f"susp-{i:05d}" for i in range(args.suspended_jobs)]
    with against_double("opscale-susp", interval) as (api, op, kube):
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda name: kube.create_job(job_doc(name, suspend=True)), names))
        created = time.monotonic() - t0

        def suspended() -> int:
            return sum((j.get("status") or {}).get("phase") == "Suspended"
                       for j in api.objects("hybridflow.io/v1alpha1/rlhfjobs", "default"))

        done = 0
        while time.monotonic() - t0 < args.settle_timeout and (done := suspended()) < n:
            time.sleep(2)
        ready = time.monotonic() - t0
        print(f"jobs: {n} created suspended in {created:.1f} s, reconcile interval {interval:g} s; "
              f"{done}/{n} Suspended after {ready:.1f} s")
        time.sleep(2 * interval)  # the last transitions' writes and events settle
        w = steady_window(api, op, args.window)
        print(f"steady, all suspended, {w.wall:.0f} s window: {len(w.requests)} operator API requests = "
              f"{len(w.requests) / w.wall:.1f}/s ({breakdown(w.requests)}); timer ticks {w.ticks / w.wall:.0f}/s "
              f"({w.ticks / (n * w.wall / interval):.2f} of the nominal {n / interval:.0f}/s); "
              f"operator CPU {100 * w.cpu / w.wall:.1f}% of a core")
        # Resume a few: how soon does a suspended job act on the change?
        resumed = names[:10]
        t1 = time.monotonic()
        for name in resumed:
            kube.patch_job(name, {"spec": {"runPolicy": {"suspend": False}}})
        lat: dict[str, float] = {}
        while len(lat) < len(resumed) and time.monotonic() - t1 < 120:
            pods = Counter(p["metadata"]["labels"]["hybridflow.io/job"] for p in api.objects("v1/pods", "default"))
            for name in resumed:
                if name not in lat and pods.get(name) == 2:
                    lat[name] = time.monotonic() - t1
            time.sleep(0.2)
        got = sorted(lat.values())
        print(f"resume -> pods: {len(got)}/{len(resumed)}"
              + (f"; p50 {pct(got, 50):.2f} s, max {got[-1]:.2f} s" if got else ""))
        return 0 if done == n and len(got) == len(resumed) else 1


def waiting_case(args: argparse.Namespace, interval: float) -> int:
    """N jobs waiting for a checkpoint PVC that does not exist: requests per job per tick after the first tick."""
    n, names = args.waiting_jobs, [f"wait-{i:03d}" for i in range(args.waiting_jobs)]
    with against_double("opscale-wait", interval) as (api, op, kube):
        for name in names:
            doc = job_doc(name)
            doc["spec"]["kubernetes"] = {"checkpointPvc": "missing-claim"}
            kube.create_job(doc)
        wait_for(lambda: all((j.get("status") or {}).get("reason") == "InputsMissing"
                             for j in api.objects("hybridflow.io/v1alpha1/rlhfjobs", "default")
                             if j["metadata"]["name"] in names)
                 and len(api.objects("hybridflow.io/v1alpha1/rlhfjobs", "default")) == n, 120, "InputsMissing")
        time.sleep(2 * interval)  # past every job's first tick
        w = steady_window(api, op, args.window)
        reqs, ticks, cpu, wall = w.requests, w.ticks, w.cpu, w.wall  # a tick: the interval plus its own time
        posts = [r for r in reqs if r.method == "POST" and r.plural != "events"]
        conflicts = [r for r in reqs if r.status == 409]
        print(f"jobs: {n} waiting for a missing PVC, reconcile interval {interval:g} s, {wall:.0f} s window, "
              f"{ticks} timer ticks: {len(reqs)} operator API requests = {len(reqs) / max(ticks, 1):.2f} per job "
              f"per tick, {60 * len(reqs) / (n * wall):.1f} per job per minute; child POSTs {len(posts)}, "
              f"answered 409: {len(conflicts)}; operator CPU {100 * cpu / wall:.1f}% of a core")
        print(f"  by request: {breakdown(reqs)}")
        pods = api.objects("v1/pods", "default")
        return 0 if not pods else 1


def scale_case(args: argparse.Namespace, interval: float) -> int:
    n, names = args.jobs, [f"scale-{i:03d}" for i in range(args.jobs)]
    gang = 2  # head + one pool pod in examples/tiny-grpo.yaml
    with against_double("opscale", interval, verbose=True) as (api, op, kube):
        sampler = Sampler(op.proc.pid)
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
        print(f"jobs: {n}, reconcile interval {interval:g} s; all created in {created_all:.1f} s")
        print(f"create -> children: {len(lat)}/{n} complete; p50 {pct(lat, 50):.2f} s, p95 {pct(lat, 95):.2f} s, "
              f"max {lat[-1]:.2f} s")

        # Running: a kubelet would report this; then the operator idles over n Running jobs.
        for p in api.objects("v1/pods", "default"):
            kube.set_pod_phase(p["metadata"]["name"], "Running")
        wait_for(lambda: sum((j.get("status") or {}).get("phase") == "Running"
                             for j in api.objects("hybridflow.io/v1alpha1/rlhfjobs", "default")) == n, 300,
                 "all Running")
        proc = psutil.Process(op.proc.pid)
        time.sleep(interval)  # let the transition's writes settle
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


if __name__ == "__main__":
    sys.exit(main())
