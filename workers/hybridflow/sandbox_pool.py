"""The job's end of its sandbox pool (hybridflow.agents.server, `hybridflow environments serve`): the replicas, the
sandbox token every request carries, and one request with its failures told apart (a replica that does not answer:
`Unreachable`, which a caller retries elsewhere; one that refuses what no retry mends: `PoolError`).

The pool runs a job's untrusted code (reward functions, tools, environments) in pods that hold none of the job's
credentials; the token here opens that pool and nothing else (it is not the Ray token, which a pod spoofing the
pool's labels would otherwise receive). Its own module below the callers (hybridflow.agents.remote for tools and
sessions, hybridflow.rewards.remote for reward functions), which are siblings and may not import each other.

Standard library HTTP (http.client): nothing beyond what the runtime already needs.
"""
from __future__ import annotations

import http.client
import itertools
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from hybridflow import wire

Info = dict[str, Any]
# What one replica of the pool serves: everything, or one half of a pool split in two (hybridflow.api.agents.
# sandbox_replicas): tools and environments, or reward functions.
SERVES_ALL, SERVES_AGENTS, SERVES_REWARDS = "all", "agents", "rewards"
SERVES = (SERVES_ALL, SERVES_AGENTS, SERVES_REWARDS)
SERVES_ANY = "any"  # pool_from_env: every replica, whatever it serves (which layers they lack)
URLS_ENV = "HYBRIDFLOW_ENVIRONMENT_URLS"  # comma-separated replicas serving tools and environments (the operator's)
# comma-separated replicas scoring reward functions, when the operator set them apart (hybridflow.api.agents.
# rewards_apart); unset: the replicas of URLS_ENV serve reward functions too
REWARD_URLS_ENV = "HYBRIDFLOW_REWARD_URLS"
TOKEN_ENV = "HYBRIDFLOW_SANDBOX_TOKEN"  # the job's sandbox token (set by the operator from the job's Secret)
# Where a rollout's agent endpoint listens on TCP for programs run in the pool (hybridflow.agents.protocol.Listen):
# the pod's address (the operator's downward-API variable) and the ports it may take, "first-last" (unset: one the
# OS chooses); the pool's NetworkPolicy lets its pods reach the gang's pods on those ports only.
POD_IP_ENV, ENDPOINT_PORTS_ENV = "POD_IP", "HYBRIDFLOW_AGENT_ENDPOINT_PORTS"
MARGIN_SECONDS = 10.0  # the network, the sandbox's start and a busy replica, on top of the server's deadline
MAX_ANSWER = 64 << 20  # a reward batch's scores and metrics, a tool's answer or an observation: far less
COOL_DOWN_SECONDS = 30.0  # a replica that did not answer gets no new session for this long (it is being replaced)


def _env_urls(name: str) -> list[str]:
    return [u for u in os.environ.get(name, "").split(",") if u.strip()]


def pool_from_env(serving: str = SERVES_AGENTS) -> "PoolClient | None":
    """This process's sandbox pool when the operator handed it the replicas (None: user code runs on this machine,
    as under `hybridflow run`). `serving`: "agents" (tools and environments), "rewards" (reward functions: the
    replicas set apart for them, else the same ones) or SERVES_ANY (every replica, once: which layers they lack)."""
    agents, rewards = _env_urls(URLS_ENV), _env_urls(REWARD_URLS_ENV)
    urls = {SERVES_AGENTS: agents, SERVES_REWARDS: rewards or agents,
            SERVES_ANY: list(dict.fromkeys(agents + rewards))}[serving]
    return PoolClient(urls, os.environ.get(TOKEN_ENV, "")) if urls else None


def endpoint_ports_from_env() -> tuple[int, int] | None:
    """ENDPOINT_PORTS_ENV's range (None when unset); ValueError naming it when it is no "first-last" range."""
    given = os.environ.get(ENDPOINT_PORTS_ENV, "").strip()
    if not given:
        return None
    first, sep, last = given.partition("-")
    if not (first.isdigit() and (last or first).isdigit()) or (sep and not last):
        raise ValueError(f"{ENDPOINT_PORTS_ENV}={given!r}: expected a port range, first-last")
    ports = (int(first), int(last or first))
    if not 0 < ports[0] <= ports[1] <= 65535:
        raise ValueError(f"{ENDPOINT_PORTS_ENV}={given!r}: expected ports 1-65535, the first at most the last")
    return ports


class PoolError(RuntimeError):
    """The pool refused the request for what no retry elsewhere mends (a wrong token, a bad request): the job
    stops, saying why."""


class Unreachable(Exception):
    """The replica did not answer (refused, reset, timed out)."""


@dataclass(frozen=True)
class Replica:
    """One replica: where it is (`http://host:port`)."""

    url: str

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"sandbox replica URL {self.url!r}: expected http://host:port")
        return parts.hostname, parts.port or 80


def parse_urls(urls: str | list[str]) -> list[str]:
    """The replicas of URLS_ENV (comma-separated) or a list; at least one."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip().rstrip("/") for u in items if u.strip()]
    if not out:
        raise ValueError(f"no sandbox pool replica URLs were given ({URLS_ENV})")
    for u in out:
        Replica(u).host_port  # noqa: B018 - validates the URL now, naming it, rather than at the first call
    return out


class PoolClient:
    """The replicas, the token, and the request counts: what RemoteTools and RemoteSessions share."""

    def __init__(self, urls: str | list[str], token: str) -> None:
        if not token:
            raise ValueError(f"the sandbox pool needs the job's sandbox token ({TOKEN_ENV}); none was given")
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
        """(status, JSON body) from replica `index`; Unreachable when it does not answer."""
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
            raw = resp.read(MAX_ANSWER + 1)  # the replica runs user code: its answer is bounded here too
        except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, cut short
            with self._lock:
                self._failures[replica.url] += 1
                self._failed_at[index] = time.monotonic()
            raise Unreachable(f"sandbox replica {replica.url} did not answer {method} {path}: "
                               f"{type(err).__name__}: {err}") from None
        finally:
            conn.close()
        if len(raw) > MAX_ANSWER:
            raise PoolError(f"sandbox replica {replica.url} answered {method} {path} with more than {MAX_ANSWER} "
                            "bytes")
        try:
            out = wire.decode(raw) if raw else {}
        except wire.WireError:
            out = {"error": raw[:200].decode(errors="replace")}
        if resp.status == 401:
            raise PoolError(f"sandbox replica {replica.url} refused the job's sandbox token (401): the pool and the "
                            f"job's other pods must share its {TOKEN_ENV}")
        return resp.status, out

    def missing_layers(self, timeout: float = 5.0) -> tuple[dict[str, str], int]:
        """({layer: why} that some answering replica's sandboxes lack (GET /v1/sandbox), how many replicas
        answered); a replica that does not answer yet tells nothing."""
        out: dict[str, str] = {}
        answered = 0
        for index in range(len(self.replicas)):
            try:
                code, body = self.request(index, "GET", "/v1/sandbox", None, timeout)
            except Unreachable:
                continue
            answered += code == 200
            for item in (body.get("missing") or []) if code == 200 else []:
                if isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item):
                    out.setdefault(item[0][:64], item[1][:500])
        return out, answered

    def request_counts(self) -> dict[str, int]:
        """Requests sent to each replica (by URL) since this client was made, answered or not."""
        with self._lock:
            return {r.url: self._counts[r.url] for r in self.replicas}

    def failure_counts(self) -> dict[str, int]:
        """Requests each replica did not answer."""
        with self._lock:
            return {r.url: self._failures[r.url] for r in self.replicas}


def unexpected(url: str, what: str, code: int, out: Info) -> PoolError:
    return PoolError(f"sandbox replica {url} answered {what} with {code}: {out.get('error', out)}")
