"""The rollout's end of the environment pool (hybridflow.agents.server): `RemoteTools` and `RemoteSessions`, the
Protocols of hybridflow.agents.protocol over HTTP to a list of replicas, authenticated with the job's token.

A new session goes to the replica with the fewest sessions this client has open there (ties: the next one in
turn) and stays there: the id handed back is `<replica index>:<the server's id>`. A replica that refuses the
connection, does not answer within the server's own deadline plus MARGIN_SECONDS, or answers 404 for a session this
client opened there (it restarted) raises SessionLost; the rollout starts that episode again elsewhere. A tool call
with a session goes to the session's replica, one without to the next replica in turn (and on to the others if one
is down). `request_counts()` gives the requests sent to each replica, for the job's metrics.

Standard library HTTP (http.client): nothing beyond what the runtime already needs.
"""
from __future__ import annotations

import http.client
import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

from hybridflow.agents.local import EnvironmentLoadError
from hybridflow.agents.protocol import Info, Observation, Places, SessionLost, ToolResult
from hybridflow import wire

if TYPE_CHECKING:
    from hybridflow.api.agents import Agent

MARGIN_SECONDS = 10.0  # the network, the sandbox's start and a busy replica, on top of the server's deadline
# POST /v1/sessions loads the environment (the server's load deadline) and resets it (its step deadline).
LOAD_SECONDS = 60.0


COOL_DOWN_SECONDS = 30.0  # a replica that did not answer gets no new session for this long (it is being replaced)


class PoolError(RuntimeError):
    """The pool refused the request for what no retry elsewhere mends (a wrong token, a bad request): the job
    stops, saying why."""


class _Unreachable(Exception):
    """The replica did not answer (refused, reset, timed out)."""


@dataclass(frozen=True)
class Replica:
    """One replica: where it is (`http://host:port`)."""

    url: str

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"environment replica URL {self.url!r}: expected http://host:port")
        return parts.hostname, parts.port or 80


def parse_urls(urls: str | list[str]) -> list[str]:
    """The replicas of HYBRIDFLOW_ENVIRONMENT_URLS (comma-separated) or a list; at least one."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip().rstrip("/") for u in items if u.strip()]
    if not out:
        raise ValueError("no environment pool replica URLs were given (HYBRIDFLOW_ENVIRONMENT_URLS)")
    for u in out:
        Replica(u).host_port  # noqa: B018 - validates the URL now, naming it, rather than at the first call
    return out


class PoolClient:
    """The replicas, the token, and the request counts: what RemoteTools and RemoteSessions share."""

    def __init__(self, urls: str | list[str], token: str) -> None:
        if not token:
            raise ValueError("the environment pool needs the job's token (RAY_AUTH_TOKEN); none was given")
        self.replicas = [Replica(u) for u in parse_urls(urls)]
        self.token = token
        self._counts: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._failed_at: dict[int, float] = {}  # replica index -> when it last did not answer
        self._lock = threading.Lock()
        self._turn = itertools.count()

    def cooling(self, index: int) -> bool:
        """Whether the replica failed to answer within the last COOL_DOWN_SECONDS (an episode lost on it is started
        again elsewhere, not on the replica that just went away)."""
        with self._lock:
            return time.monotonic() - self._failed_at.get(index, -COOL_DOWN_SECONDS) < COOL_DOWN_SECONDS

    def next_index(self) -> int:
        return next(self._turn) % len(self.replicas)

    def request(self, index: int, method: str, path: str, body: Info | None, timeout: float) -> tuple[int, Info]:
        """(status, JSON body) from replica `index`; _Unreachable when it does not answer."""
        replica = self.replicas[index]
        with self._lock:
            self._counts[replica.url] += 1
        host, port = replica.host_port
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        data = wire.encode(body) if body is not None else b""
        try:
            conn.request(method, path, body=data, headers={
                "Authorization": f"Bearer {self.token}", "Content-Type": "application/json",
                "Content-Length": str(len(data))})
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, cut short
            with self._lock:
                self._failures[replica.url] += 1
                self._failed_at[index] = time.monotonic()
            raise _Unreachable(f"environment replica {replica.url} did not answer {method} {path}: "
                               f"{type(err).__name__}: {err}") from None
        finally:
            conn.close()
        try:
            out = wire.decode(raw) if raw else {}
        except wire.WireError:
            out = {"error": raw[:200].decode(errors="replace")}
        if resp.status == 401:
            raise PoolError(f"environment replica {replica.url} refused the job's token (401): the pool and the "
                            "rollout must share the job's RAY_AUTH_TOKEN")
        return resp.status, out

    def request_counts(self) -> dict[str, int]:
        """Requests sent to each replica (by URL) since this client was made, answered or not."""
        with self._lock:
            return {r.url: self._counts[r.url] for r in self.replicas}

    def failure_counts(self) -> dict[str, int]:
        """Requests each replica did not answer."""
        with self._lock:
            return {r.url: self._failures[r.url] for r in self.replicas}


def _unexpected(url: str, what: str, code: int, out: Info) -> PoolError:
    return PoolError(f"environment replica {url} answered {what} with {code}: {out.get('error', out)}")


def session_id(index: int, server_id: str) -> str:
    return f"{index}:{server_id}"


def split_session(session: str) -> tuple[int, str]:
    index, sep, server_id = session.partition(":")
    if not sep or not index.isdigit():
        raise ValueError(f"{session!r} is not a session id of the environment pool")
    return int(index), server_id


class RemoteTools:
    """Tools run by the pool's replicas."""

    def __init__(self, client: PoolClient, timeout_seconds: float = 10.0) -> None:
        self.client, self.timeout = client, timeout_seconds + MARGIN_SECONDS

    def call(self, name: str, arguments: Info, session: str | None = None) -> ToolResult:
        body: Info = {"name": name, "arguments": arguments}
        if session is not None:
            body["session"] = split_session(session)[1]
            index = split_session(session)[0]
            order = [index]  # the session's replica or none: an episode's calls stay on one replica
        else:
            first = self.client.next_index()
            n = len(self.client.replicas)
            order = [(first + i) % n for i in range(n)]
        errors = []
        for index in order:
            try:
                code, out = self.client.request(index, "POST", "/v1/tools/call", body, self.timeout)
            except _Unreachable as err:
                errors.append(str(err))
                continue
            if code != 200:  # the replica could not run it (a sandbox that did not start): the call's answer
                why = str(_unexpected(self.client.replicas[index].url, f"tool call {name!r}", code, out))
                return ToolResult(f"Error: the {name} tool could not run: {why}.", error=why)
            return ToolResult.from_json(out)
        raise SessionLost("; ".join(errors))

    def close(self) -> None:
        """Nothing lives between calls."""

    def request_counts(self) -> dict[str, int]:
        """Requests sent to each replica by this client (tools and sessions together, when they share it)."""
        return self.client.request_counts()


class RemoteSessions:
    """Environment sessions spread over the pool's replicas, each staying on its replica."""

    def __init__(self, client: PoolClient, step_timeout_seconds: float = 10.0,
                 load_timeout_seconds: float = LOAD_SECONDS) -> None:
        self.client = client
        self.step_timeout = step_timeout_seconds + MARGIN_SECONDS
        self.open_timeout = load_timeout_seconds + step_timeout_seconds + MARGIN_SECONDS
        self._open: dict[str, int] = {}  # session -> replica index
        self._lock = threading.Lock()

    def _preference(self) -> list[int]:
        """The replicas, fewest of this client's open sessions first (cooling ones last); ties go round in turn."""
        n = len(self.client.replicas)
        start = self.client.next_index()
        with self._lock:
            load = Counter(self._open.values())
        order = [(start + i) % n for i in range(n)]
        return sorted(order, key=lambda i: (self.client.cooling(i), load[i]))

    def open(self, sample: Info) -> tuple[str, Observation]:
        """On the preferred replica; one that holds its most sessions (503) passes it to the next."""
        full = []
        for index in self._preference():
            url = self.client.replicas[index].url
            try:
                code, out = self.client.request(index, "POST", "/v1/sessions", {"sample": sample},
                                                self.open_timeout)
            except _Unreachable as err:
                raise SessionLost(str(err)) from None
            if code != 503:
                break
            full.append(str(_unexpected(url, "a new session", code, out)))
        else:
            raise PoolError("every environment replica holds its most sessions: " + "; ".join(full))
        if code == 422:
            raise EnvironmentLoadError(str(out.get("error")))
        if code != 200:
            raise _unexpected(url, "a new session", code, out)
        sid, first = session_id(index, str(out["session"])), Observation.from_json(out["observation"])
        if not (first.done or first.error):
            with self._lock:
                self._open[sid] = index
        return sid, first

    def step(self, session: str, action: str) -> Observation:
        index, server_id = split_session(session)
        url = self.client.replicas[index].url
        with self._lock:
            known = session in self._open
        if not known:
            return Observation("", done=True, error=f"session {session} is closed")
        try:
            code, out = self.client.request(index, "POST", f"/v1/sessions/{quote(server_id, safe='')}/step",
                                            {"action": action}, self.step_timeout)
        except _Unreachable as err:
            self.close(session)  # a timed-out step's session may live on: its replica is told to end it
            raise SessionLost(str(err)) from None
        if code == 404:
            self._forget(session)
            raise SessionLost(f"environment replica {url} no longer knows session {session} (it restarted)")
        if code != 200:  # the replica could not step it: the episode ends on that error, reported
            self.close(session)
            return Observation("", done=True, error=str(_unexpected(url, f"a step of session {session}", code, out)))
        obs = Observation.from_json(out)
        if obs.done:
            self._forget(session)
        return obs

    def _forget(self, session: str) -> bool:
        with self._lock:
            return self._open.pop(session, None) is not None

    def close(self, session: str) -> None:
        if not self._forget(session):
            return
        index, server_id = split_session(session)
        try:
            self.client.request(index, "DELETE", f"/v1/sessions/{quote(server_id, safe='')}", None,
                                min(self.step_timeout, 5.0))  # best effort: a replica gone must not hold the loop
        except (_Unreachable, PoolError):
            pass  # gone with its replica, or refused: nothing of it is left for this client to end

    def shutdown(self) -> None:
        for session in list(self._open):
            self.close(session)

    def request_counts(self) -> dict[str, int]:
        return self.client.request_counts()

    def open_counts(self) -> dict[str, int]:
        """Sessions this client has open on each replica."""
        with self._lock:
            load = Counter(self._open.values())
        return {r.url: load[i] for i, r in enumerate(self.client.replicas)}


def remote_places(agent: "Agent", urls: str | list[str], token: str) -> Places:
    """The job's tools and environment sessions in its environment pool (None for what the job has not), sharing
    one client: its request counts cover both."""
    client = PoolClient(urls, token)
    tools = RemoteTools(client, agent.tool_timeout_seconds) if agent.tools or agent.tools_file else None
    sessions = RemoteSessions(client, agent.step_timeout_seconds) if agent.has_environment else None
    return Places(tools, sessions, client.request_counts)
