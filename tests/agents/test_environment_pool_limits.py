"""The sandbox pool's server against callers that do not play along (issue 51, L3): a negative or non-numeric
Content-Length is a 400, a connection that sends half a request and stalls is dropped after the server's timeout, a
session is closed at its maximum lifetime however often it is stepped (its step then answers 410 and the episode
ends reported), a tool's answer or an observation too large to send is an error, not a reply of that size; and the
driver's end of a worker's pipe waits with poll, which works for any fd (select fails at 1024 and above)."""
from __future__ import annotations

import itertools
import os
import resource
import socket
import time

import pytest

from hybridflow import wire
from hybridflow.agents.protocol import Observation, ToolResult
from hybridflow.agents.remote import PoolClient, RemoteSessions, RemoteTools
from hybridflow.agents.server import PoolServer, PoolService

TOKEN = "test-token-" + "y" * 40
HUGE = 5 << 20  # characters: more than MAX_REPLY as JSON


class ToolsDouble:
    def call(self, name, arguments, session=None):
        return ToolResult("x" * HUGE if name == "huge" else f"{name} ok")

    def close(self):
        pass


class SessionsDouble:
    """Sessions that answer at once; the action "huge" answers an observation of HUGE characters."""

    def __init__(self) -> None:
        self.ids, self.closed = itertools.count(), []

    def open(self, sample):
        return f"s{next(self.ids)}", Observation("x" * HUGE if sample.get("huge") else "ready")

    def step(self, session, action):
        return Observation("x" * HUGE if action == "huge" else f"saw {action}")

    def close(self, session):
        self.closed.append(session)

    def shutdown(self):
        pass


@pytest.fixture
def server():
    made = []

    def make(**kw):
        request_seconds = kw.pop("request_seconds", 30.0)
        s = PoolServer(PoolService(ToolsDouble(), SessionsDouble(), **kw), TOKEN, "127.0.0.1", 0,
                       request_seconds=request_seconds)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def _raw(server: PoolServer, data: bytes, wait: float = 10.0) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it (or `wait` passes)."""
    with socket.create_connection(server.server_address[:2], timeout=wait) as conn:
        conn.sendall(data)
        out = b""
        try:
            while chunk := conn.recv(1 << 16):
                out += chunk
        except socket.timeout:
            out += b"<still open>"
        return out


def _request(length: str, body: bytes = b"") -> bytes:
    return (f"POST /v1/tools/call HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode() + body


@pytest.mark.parametrize("length", ["-1", "abc", "1e3", "99999999999999999999"])
def test_a_negative_or_non_numeric_content_length_is_a_400(server, length):
    s = server()
    out = _raw(s, _request(length), wait=5)
    assert out.startswith(b"HTTP/1.1 400"), out[:300]
    assert b"Content-Length must be a non-negative integer" in out


def test_a_client_that_stalls_mid_request_is_dropped_after_the_timeout(server):
    """Half the headers, or the headers and half the body: the connection is closed after request_seconds, and the
    server answers the next client as usual."""
    s = server(request_seconds=0.5)
    for partial in (b"POST /v1/tools/call HTTP/1.1\r\nHost: x\r\n", _request("100", b'{"name": ')):
        t0 = time.monotonic()
        out = _raw(s, partial, wait=8)
        took = time.monotonic() - t0
        assert b"<still open>" not in out and took < 5, (out, took)
    tools = RemoteTools(PoolClient([s.url], TOKEN), 5)
    assert tools.call("calculator", {}).text == "calculator ok"


def test_a_session_is_closed_at_its_lifetime_however_often_it_is_stepped(server):
    s = server(max_session_seconds=1.0)
    sessions = RemoteSessions(PoolClient([s.url], TOKEN), 5)
    sid, first = sessions.open({"prompt": "p"})
    assert first.text == "ready"
    deadline = time.monotonic() + 10
    while True:  # stepped every 0.1 s: never idle, yet closed once a second old
        obs = sessions.step(sid, "1")
        if obs.done:
            break
        assert obs.text == "saw 1" and time.monotonic() < deadline
        time.sleep(0.1)
    assert "410" in obs.error and "session lifetime of 1 s" in obs.error, obs
    assert s.service.sessions.closed == ["s0"]
    text = s.service.metrics.text().decode()
    assert "hybridflow_environment_expired_sessions_total 1.0" in text
    assert "hybridflow_environment_reaped_sessions_total 0.0" in text


def test_a_huge_answer_or_observation_is_refused_not_sent(server):
    s = server()
    client = PoolClient([s.url], TOKEN)
    tool = RemoteTools(client, 5).call("huge", {})
    assert tool.error and "more than the 4194304 a reply may hold" in tool.text and len(tool.text) < 1000
    sessions = RemoteSessions(client, 5)
    sid, _ = sessions.open({"prompt": "p"})
    obs = sessions.step(sid, "huge")
    assert obs.done and "observation is" in obs.error and len(obs.text) == 0, obs.error
    assert s.service.sessions.closed == ["s0"] and not s.service.known(sid.split(":", 1)[1])
    _, first = sessions.open({"prompt": "p", "huge": True})
    assert first.done and "first observation is" in first.error and "s1" in s.service.sessions.closed


def test_the_drivers_end_of_a_pipe_waits_on_any_fd(tmp_path):
    """wire.LineReader on an fd above 1024 (a driver with many sandboxes and connections open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"RLIMIT_NOFILE {hard}: no fd above 1024 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    r, w = os.pipe()
    high = os.dup2(r, 1050)
    try:
        reader = wire.LineReader(high)
        os.write(w, wire.encode({"ok": 1}))
        assert reader.receive(2) == {"ok": 1}
        with pytest.raises(wire.WireTimeout):
            reader.receive(0.2)
        os.close(w)
        w = -1
        with pytest.raises(wire.WireError, match="closed its pipe"):
            reader.receive(2)
    finally:
        for fd in (r, high, w):
            if fd >= 0:
                os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
