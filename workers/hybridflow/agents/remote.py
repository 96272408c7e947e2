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

import threading
from collections import Counter
from urllib.parse import quote

from hybridflow.agents.local import LOAD_SECONDS, EnvironmentLoadError
from hybridflow.agents.protocol import AgentSettings, Info, Observation, Places, SessionLost, ToolResult
from hybridflow.sandbox_pool import MARGIN_SECONDS, PoolClient, PoolError, Unreachable, unexpected


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
            except Unreachable as err:
                errors.append(str(err))
                continue
            if code != 200:  # the replica could not run it: the call's answer, the pool's failure (not the tool's)
                why = str(unexpected(self.client.replicas[index].url, f"tool call {name!r}", code, out))
                return ToolResult(f"Error: the {name} tool could not run: {why}.", error=why, unavailable=True)
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
        # POST /v1/sessions loads the environment (the server's load deadline) and resets it (its step deadline)
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
            except Unreachable as err:
                raise SessionLost(str(err)) from None
            if code != 503:
                break
            full.append(str(unexpected(url, "a new session", code, out)))
        else:
            raise PoolError("every environment replica holds its most sessions: " + "; ".join(full))
        if code == 422:
            raise EnvironmentLoadError(str(out.get("error")))
        if code != 200:
            raise unexpected(url, "a new session", code, out)
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
        except Unreachable as err:
            self.close(session)  # a timed-out step's session may live on: its replica is told to end it
            raise SessionLost(str(err)) from None
        if code == 404:
            self._forget(session)
            raise SessionLost(f"environment replica {url} no longer knows session {session} (it restarted)")
        if code != 200:  # the replica could not step it: the episode ends on that error, reported as the pool's
            self.close(session)
            return Observation("", done=True, error=str(unexpected(url, f"a step of session {session}", code, out)),
                               unavailable=True)
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
        except (Unreachable, PoolError):
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


def remote_places(agent: AgentSettings, client: PoolClient) -> Places:
    """The job's tools and environment sessions in its sandbox pool (None for what the job has not), sharing
    one client: its request counts cover both."""
    tools = RemoteTools(client, agent.tool_timeout_seconds) if agent.tools or agent.tools_file else None
    sessions = RemoteSessions(client, agent.step_timeout_seconds) if agent.has_environment else None
    return Places(tools, sessions, client.request_counts)
