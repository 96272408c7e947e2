"""The environment pool over real HTTP on 127.0.0.1 with real sandboxes: the job's token or nothing runs, tool calls
and guess_number sessions through the client, sessions spread over replicas and kept on theirs, a replica that dies
or restarts loses its sessions (SessionLost), and the client counts its requests per replica. One replica runs as
`hybridflow environments serve` in a process of its own, killed with SIGKILL."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from hybridflow.agents.local import EnvironmentCode, LocalSessions, LocalTools
from hybridflow.agents.protocol import SessionLost
from hybridflow.agents.registry import ENVIRONMENTS, TOOLS
from hybridflow.agents.remote import PoolClient, PoolError, RemoteSessions, RemoteTools
from hybridflow.agents.server import PoolServer, PoolService
from support.paths import ROOT as REPO

TOKEN = "test-token-" + "x" * 40


class RecordingTools(LocalTools):
    """The real LocalTools, remembering which calls reached it (to show a refused request ran nothing)."""

    def __init__(self) -> None:
        super().__init__({"calculator": TOOLS["calculator"], "python": TOOLS["python"]}, timeout_seconds=10)
        self.calls: list[str] = []

    def call(self, name, arguments, session=None):
        self.calls.append(name)
        return super().call(name, arguments, session)


def _server(tools: LocalTools | None = None, port: int = 0, **limits) -> PoolServer:
    sessions = LocalSessions(EnvironmentCode(target=ENVIRONMENTS["guess_number"]), step_timeout_seconds=10)
    server = PoolServer(PoolService(tools or RecordingTools(), sessions, **limits), TOKEN, "127.0.0.1", port)
    server.start()
    return server


@pytest.fixture
def servers():
    made: list[PoolServer] = []

    def make(**kw) -> PoolServer:
        made.append(_server(**kw))
        return made[-1]

    yield make
    for s in made:
        try:
            s.stop()
        except OSError:
            pass


def _post(url: str, body: dict, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _metrics(url: str) -> str:
    return urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()


def _sample(secret: int) -> dict:
    return {"prompt": "Guess my number between 1 and 10.", "ground_truth": secret, "data_source": "test",
            "extra_info": {}}


def test_a_request_without_the_jobs_token_is_refused_and_runs_nothing(servers):
    tools = RecordingTools()
    server = servers(tools=tools)
    for token in (None, "wrong", TOKEN + "x", ""):
        code, body = _post(f"{server.url}/v1/tools/call", {"name": "calculator", "arguments": {"expression": "1+1"}},
                           token)
        assert code == 401, (token, body)
        code, _ = _post(f"{server.url}/v1/sessions", {"sample": _sample(3)}, token)
        assert code == 401
    assert tools.calls == []
    assert server.service.sessions._open == {}  # no sandbox was started for a session either
    text = _metrics(server.url)  # unauthenticated: counts only
    assert "hybridflow_environment_refused_requests_total 8.0" in text
    assert 'hybridflow_environment_requests_total{' not in text
    assert urllib.request.urlopen(f"{server.url}/healthz", timeout=5).read() == b"ok\n"
    with pytest.raises(PoolError, match="refused the job's sandbox token"):
        RemoteTools(PoolClient([server.url], "wrong")).call("calculator", {"expression": "1+1"})
    # the right token: the same call runs
    code, body = _post(f"{server.url}/v1/tools/call", {"name": "calculator", "arguments": {"expression": "6*7"}},
                       TOKEN)
    assert (code, body["text"], tools.calls) == (200, "42", ["calculator"])


def test_bad_requests_name_the_field(servers):
    server = servers()
    code, body = _post(f"{server.url}/v1/tools/call", {"name": "calculator"}, TOKEN)
    assert code == 400 and "arguments" in body["error"]
    code, body = _post(f"{server.url}/v1/sessions/nope/step", {"action": "5"}, TOKEN)
    assert code == 404 and "no session nope" in body["error"]


def test_tool_calls_and_a_guess_number_session_through_the_client(servers):
    server = servers()
    client = PoolClient([server.url], TOKEN)
    tools, sessions = RemoteTools(client, 10), RemoteSessions(client, 10)
    result = tools.call("calculator", {"expression": "123 * 45"})
    assert (result.text, result.error) == ("5535", None)
    printed = tools.call("python", {"code": "print(sum(range(10)))"})
    assert printed.text.strip() == "45" and printed.error is None
    unknown = tools.call("nope", {})
    assert unknown.error and "no tool named 'nope'" in unknown.text

    sid, first = sessions.open(_sample(7))
    assert first.text == "" and not first.done and sid.startswith("0:")
    assert sessions.step(sid, "I guess 5").text == "Higher."
    assert tools.call("calculator", {"expression": "7"}, session=sid).text == "7"  # on the session's replica
    last = sessions.step(sid, "7")
    assert (last.text, last.done, last.reward) == ("Correct!", True, pytest.approx(0.8))
    assert sessions.open_counts() == {server.url: 0}
    assert "hybridflow_environment_open_sessions 0.0" in _metrics(server.url)
    assert client.request_counts() == {server.url: 7}
    text = _metrics(server.url)
    assert 'hybridflow_environment_requests_total{code="200",kind="step"} 2.0' in text
    assert 'hybridflow_environment_requests_total{code="200",kind="tool"} 4.0' in text


def test_sessions_spread_over_replicas_and_stay_on_theirs(servers):
    a, b = servers(), servers()
    client = PoolClient([a.url, b.url], TOKEN)
    sessions = RemoteSessions(client, 10)
    opened = [sessions.open(_sample(secret))[0] for secret in (2, 3, 4, 5)]
    assert sessions.open_counts() == {a.url: 2, b.url: 2}
    assert sorted(s.split(":")[0] for s in opened) == ["0", "0", "1", "1"]
    for sid in opened:  # each session's steps reach the replica that holds its environment (else: 404)
        assert sessions.step(sid, "1").text == "Higher."
    for server, index in ((a, "0"), (b, "1")):
        mine = [s for s in opened if s.startswith(index + ":")]
        assert f'kind="step"}} {float(len(mine))}' in _metrics(server.url)
        assert "hybridflow_environment_open_sessions 2.0" in _metrics(server.url)
    assert client.request_counts() == {a.url: 4, b.url: 4}
    sessions.close(opened[0])
    sessions.close(opened[0])  # idempotent
    again, _ = sessions.open(_sample(9))  # the replica with fewer open sessions gets the next one
    assert again.split(":")[0] == opened[0].split(":")[0]
    sessions.shutdown()
    assert sessions.open_counts() == {a.url: 0, b.url: 0}
    for server in (a, b):
        assert "hybridflow_environment_open_sessions 0.0" in _metrics(server.url)


def test_a_session_nobody_steps_is_closed_and_a_full_replica_passes_new_ones_on(servers):
    """The rollout that opened a session can die without closing it: the replica ends it once it has been idle
    for its limit (a session stepped in time lives on). A replica at its most sessions answers 503 and the client
    opens the session on the next one; with every replica full, the error says so."""
    a = servers(idle_seconds=1.0, max_sessions=1)
    b = servers(max_sessions=1)
    sessions = RemoteSessions(PoolClient([a.url, b.url], TOKEN), 10)
    first, _ = sessions.open(_sample(50))
    second, _ = sessions.open(_sample(60))
    assert {first.split(":")[0], second.split(":")[0]} == {"0", "1"}  # one on each: the full one passed it on
    with pytest.raises(PoolError, match="every environment replica holds its most sessions"):
        sessions.open(_sample(70))
    on_a = first if first.startswith("0:") else second
    deadline = time.monotonic() + 10
    while "hybridflow_environment_reaped_sessions_total 1.0" not in _metrics(a.url):
        assert time.monotonic() < deadline, _metrics(a.url)
        time.sleep(0.1)
    assert "hybridflow_environment_open_sessions 0.0" in _metrics(a.url)
    with pytest.raises(SessionLost, match="no longer knows"):
        sessions.step(on_a, "10")
    again, _ = sessions.open(_sample(80))  # room again on the replica that reaped
    assert again.startswith("0:")
    for _ in range(3):  # stepped more often than its idle limit: never reaped
        assert sessions.step(again, "10").text == "Higher."
        time.sleep(0.4)
    assert "hybridflow_environment_reaped_sessions_total 1.0" in _metrics(a.url)
    deadline = time.monotonic() + 10  # left alone after its steps: idle from the last one, then reaped too
    while "hybridflow_environment_reaped_sessions_total 2.0" not in _metrics(a.url):
        assert time.monotonic() < deadline, _metrics(a.url)
        time.sleep(0.1)
    sessions.shutdown()


def test_a_restarted_replica_answers_404_and_the_client_raises_session_lost(servers):
    first = servers()
    port = first.server_address[1]
    client = PoolClient([first.url], TOKEN)
    sessions = RemoteSessions(client, 10)
    sid, _ = sessions.open(_sample(4))
    first.stop()
    servers(port=port)  # the same address, a new process's sessions: the old id is unknown there
    sid2, _ = sessions.open(_sample(9))  # the new replica serves new episodes (its first session, as sid was)
    with pytest.raises(SessionLost, match="no longer knows"):
        sessions.step(sid, "4")  # never taken for the new replica's session of the same number
    assert sessions.step(sid2, "9").done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec_file(tmp_path: Path) -> Path:
    doc = yaml.safe_load((REPO / "examples" / "smollm2-arithmetic.yaml").read_text())
    doc["spec"]["rollout"]["agent"] = {"environment": "guess_number", "tools": ["calculator"], "maxTurns": 4}
    doc["spec"]["environments"] = {"replicas": 2}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(doc))
    return path


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
        try:
            if urllib.request.urlopen(f"{url}/healthz", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")


def test_a_killed_replica_process_loses_its_sessions_the_other_goes_on(servers, tmp_path):
    """`hybridflow environments serve` as its own process, SIGKILLed mid-episode: its sessions raise SessionLost
    (refused connections), new sessions and sessionless tool calls go to the replica that is left."""
    in_thread = servers()
    port = _free_port()
    cli = [sys.executable, "-m", "hybridflow.cli", "environments", "serve", "--spec", str(_spec_file(tmp_path)),
           "--port", str(port), "--address", "127.0.0.1"]
    proc = subprocess.Popen(cli, env={**os.environ, "HYBRIDFLOW_SANDBOX_TOKEN": TOKEN}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        client = PoolClient([url, in_thread.url], TOKEN)
        sessions, tools = RemoteSessions(client, 10), RemoteTools(client, 10)
        on_proc, _ = sessions.open(_sample(6))
        on_thread, _ = sessions.open(_sample(6))
        assert (on_proc[0], on_thread[0]) == ("0", "1")
        assert sessions.step(on_proc, "3").text == "Higher."
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        with pytest.raises(SessionLost, match="did not answer"):
            sessions.step(on_proc, "6")
        with pytest.raises(SessionLost):
            tools.call("calculator", {"expression": "1+2"}, session=on_proc)
        assert tools.call("calculator", {"expression": "1+2"}).text == "3"  # on to the live replica
        assert sessions.step(on_thread, "6").done
        assert sessions.open_counts() == {url: 0, in_thread.url: 0}
        # the episode lost on the dead replica starts again on the live one, though the dead one now holds fewer
        # sessions: a replica that just failed gets no new session (its cool-down)
        retried = [sessions.open(_sample(6))[0] for _ in range(3)]
        assert [sid[0] for sid in retried] == ["1"] * 3, retried
        assert all(sessions.step(sid, "6").done for sid in retried)
        counts, failures = client.request_counts(), client.failure_counts()
        assert counts[url] >= 4 and failures[url] >= 2 and failures[in_thread.url] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_refuses_to_start_without_the_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDFLOW_SANDBOX_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "hybridflow.cli", "environments", "serve", "--spec",
                          str(_spec_file(tmp_path)), "--port", "0"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "HYBRIDFLOW_SANDBOX_TOKEN" in out.stderr


class SlowStartingSessionsDouble:
    """Stands for sandboxed sessions whose start takes a while (a sandbox's start-up): every open waits for
    `release`, so the opens a replica's request threads run at once overlap."""

    def __init__(self) -> None:
        import threading

        self.release, self.started, self.ids = threading.Event(), threading.Semaphore(0), iter(range(100))

    def open(self, sample):
        from hybridflow.agents.protocol import Observation

        self.started.release()
        self.release.wait(10)
        return f"s{next(self.ids)}", Observation("ready")

    def close(self, session):
        pass


def test_concurrent_opens_never_pass_the_replicas_session_cap():
    """The cap counts sessions whose sandbox is still starting: of five opens at once on a replica holding at most
    two, two open and three are refused (Full: the client passes them on), however the starts interleave."""
    import threading

    from hybridflow.agents.server import Full

    sessions = SlowStartingSessionsDouble()
    service = PoolService(None, sessions, max_sessions=2)
    results: list = []

    def open_one():
        try:
            results.append(service.open({"sample": {"prompt": "p"}})["session"])
        except Full as err:
            results.append(err)

    threads = [threading.Thread(target=open_one) for _ in range(5)]
    for t in threads:
        t.start()
    for _ in range(2):
        assert sessions.started.acquire(timeout=5)  # two starts under way...
    time.sleep(0.2)  # ...while the other three ask
    sessions.release.set()
    for t in threads:
        t.join(10)
    opened = [r for r in results if isinstance(r, str)]
    assert len(opened) == 2 and len(results) == 5, results
    assert all("holds 2 open sessions, its most" in str(r) for r in results if not isinstance(r, str)), results
    assert service._opening == 0 and len(service._local) == 2
