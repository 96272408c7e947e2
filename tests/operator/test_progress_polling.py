"""The operator's progress poll talks to a pod the job's author controls: whatever it serves (slow drips, huge
bodies, redirects, garbage, NaN), a reconcile tick stays short and nothing but that pod is contacted."""
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridflow_operator.progress import fetch, parse_progress

GOOD = '# TYPE hybridflow_step gauge\nhybridflow_step{rlhfjob="j"} 7.0\n'


class Pod(BaseHTTPRequestHandler):
    mode = "good"
    hits: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        Pod.hits.append((self.server.server_port, self.path))
        if Pod.mode == "redirect":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.other_port}/metrics")
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        if Pod.mode == "good":
            self.wfile.write(GOOD.encode())
        elif Pod.mode == "drip":  # a byte at a time: each read is quick, the whole never ends
            for _ in range(100):
                self.wfile.write(b"#")
                self.wfile.flush()
                time.sleep(0.1)
        elif Pod.mode == "huge":
            for _ in range(64):
                self.wfile.write(b"# " + b"x" * 65536 + b"\n")

    def send_response(self, code, message=None):
        if Pod.mode == "slow-headers":  # the status line and headers a byte at a time: still within the deadline
            for b in b"HTTP/1.0 200 OK\r\nX-Slow: " + b"y" * 100:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.05)
        super().send_response(code, message)

    def log_message(self, *args):
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # the poll hanging up on a drip is the point, not an error
        pass


@pytest.fixture
def pod():
    servers = [QuietServer(("127.0.0.1", 0), Pod) for _ in range(2)]
    servers[0].other_port, servers[1].other_port = servers[1].server_port, servers[0].server_port
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    Pod.hits = []
    try:
        yield servers[0].server_port, servers[1].server_port
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_a_well_behaved_pod_is_read(pod):
    Pod.mode = "good"
    assert parse_progress(fetch("127.0.0.1", pod[0]), "j") == {"step": 7}


@pytest.mark.parametrize("mode", ["drip", "huge", "slow-headers"])
def test_slow_or_huge_answers_end_within_the_deadline(pod, mode):
    Pod.mode = mode
    t0 = time.monotonic()
    assert fetch("127.0.0.1", pod[0], deadline=1.0) is None
    assert time.monotonic() - t0 < 3.0  # the deadline is for the whole answer, not per read


def test_redirects_are_not_followed(pod):
    Pod.mode = "redirect"
    assert fetch("127.0.0.1", pod[0]) is None
    assert [port for port, _ in Pod.hits] == [pod[0]], "the redirect's target was contacted"


def test_only_an_ip_address_is_contacted():
    assert fetch("localhost", 1) is None and fetch("example.com:80@127.0.0.1", 1) is None


@pytest.mark.parametrize("text", [
    "\x00\xff garbage {{{", 'hybridflow_step{rlhfjob="j"} NaN\n', 'hybridflow_step{rlhfjob="j"} +Inf\n',
    'hybridflow_step{rlhfjob="j"} -5\n', 'hybridflow_step{rlhfjob="j} 3\n', "# TYPE x counter\nx_total{a=\"\\q\"} 1\n"])
def test_garbage_and_non_finite_values_give_no_progress(text):
    assert parse_progress(text, "j") == {}


class SlowDrivers(BaseHTTPRequestHandler):
    """A driver that answers GOOD after `delay` seconds; counts the fetches in flight at once."""
    delay, lock, now, most = 0.5, threading.Lock(), 0, 0

    def do_GET(self):  # noqa: N802 - http.server's name
        cls = SlowDrivers
        with cls.lock:
            cls.now += 1
            cls.most = max(cls.most, cls.now)
        time.sleep(cls.delay)
        with cls.lock:
            cls.now -= 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(GOOD.encode())

    def log_message(self, *args):
        pass


def test_the_poller_fetches_at_most_workers_at_once_and_a_tick_never_waits():
    """Issue 24 N8: 12 Running jobs whose drivers each take 0.5 s: a tick hands its fetch over and returns at once
    (it used to wait up to 2 s, holding one of kopf's threads); at most `workers` fetches run at once; each job has
    one fetch in flight, and its next tick gets that answer, only for the same target (pod)."""
    from hybridflow_operator.progress import Poller

    server = QuietServer(("127.0.0.1", 0), SlowDrivers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    poller = Poller(workers=3)
    try:
        t0 = time.monotonic()
        assert [poller.poll(("ns", f"j{i}"), "127.0.0.1", port, "head-g0") for i in range(12)] == [None] * 12
        assert time.monotonic() - t0 < 0.2, "a tick waited for its driver"
        assert poller.in_flight() == 12  # queued or running: one each
        assert poller.poll(("ns", "j0"), "127.0.0.1", port, "head-g0") is None  # still in flight: no second fetch
        deadline = time.monotonic() + 10
        while poller.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert poller.in_flight() == 0 and SlowDrivers.most == 3, SlowDrivers.most
        assert parse_progress(poller.poll(("ns", "j0"), "127.0.0.1", port, "head-g0"), "j")["step"] == 7
        assert poller.poll(("ns", "j1"), "127.0.0.1", port, "head-g1") is None  # a new head: not the old one's
        poller.forget(("ns", "j2"))
        assert poller.poll(("ns", "j2"), "127.0.0.1", port, "head-g0") is None  # forgotten: starts afresh
    finally:
        server.shutdown()
        server.server_close()


def test_the_layers_the_sandbox_pool_lacks_come_from_the_drivers_own_gauge():
    """The driver's JobMetrics gauge, as it serves it, parsed into the layers the operator's SandboxPartial
    condition names; another job's samples and zeros do not count."""
    from prometheus_client import generate_latest

    from hybridflow.metrics import JobMetrics
    from hybridflow_operator.progress import SANDBOX_MISSING

    metrics = JobMetrics("j1")
    for layer in ("network", "processes"):
        metrics.sandbox_missing.labels("j1", layer).set(1)
    metrics.sandbox_missing.labels("j1", "user").set(0)
    metrics.sandbox_missing.labels("other", "filesystem").set(1)
    got = parse_progress(generate_latest(metrics.registry).decode(), "j1")
    assert got[SANDBOX_MISSING] == ["network", "processes"]
    assert SANDBOX_MISSING not in parse_progress(generate_latest(JobMetrics("j1").registry).decode(), "j1")
