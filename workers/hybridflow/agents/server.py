"""The sandbox pool's HTTP server: one replica's tools, environment sessions (hybridflow.agents.local's sandboxes),
agent program runs (hybridflow.agents.pool_programs) and reward function (hybridflow.rewards.sandbox's workers)
offered to the job over the network, as `hybridflow environments serve` runs it in a sandbox pod: on Kubernetes the
job's untrusted code runs only there, in pods that hold none of its credentials.

Every request but GET /healthz and GET /metrics carries the job's sandbox token (`Authorization: Bearer <token>`,
compared in constant time; not the Ray token); without it the answer is 401 and nothing runs. /metrics says how many requests of each kind came
and how many sessions are open, nothing a caller sent: it stays unauthenticated so that a scraper needs no job's
token, and the job's NetworkPolicy admits only the job's own pods to these pods anyway.

A session the rollout stops stepping (its rollout worker was killed, its episode's driver crashed) is closed once
it has been idle for `idle_seconds` (default 30 min: longer than any wait for the model's next turn), so that a
long job's lost episodes do not keep sandboxes alive until the pod ends; at most `max_sessions` are open at once
(503 above that: the client tries another replica). A session is closed, stepped or not, once it is
`max_session_seconds` old (default 4 h); a step of it then answers 410 with why, and its episode ends reported.

Each connection's reads and writes time out after `request_seconds` (default 60 s: a client that sends half a
request and stalls loses its connection, not a thread for ever); a Content-Length that is not a non-negative integer
is refused (400); a tool's answer or an observation larger than MAX_REPLY is not sent: the call answers an error,
the episode ends with one.

Session ids carry this process's random boot id, so an id handed out before a restart is unknown afterwards (404:
the client's SessionLost) instead of naming a new session that happens to reuse its number.

    GET    /v1/sandbox                                             -> {how, missing: [[layer, why], ...]}
    POST   /v1/tools/call             {name, arguments, session?}  -> ToolResult
    POST   /v1/rewards/score          {data_sources, solutions, ground_truths, extra_infos}
                                       -> {scores, extras, errors: [{index, error}]}
    POST   /v1/sessions               {sample}                     -> {session, observation}
    POST   /v1/sessions/<id>/step     {action}                     -> Observation
    DELETE /v1/sessions/<id>                                       -> {}
    POST   /v1/programs/run           {sample, endpoint, token}    -> ProgramResult (hybridflow.agents.pool_programs)
"""
from __future__ import annotations

import hmac
import logging
import re
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hybridflow.agents.local import EnvironmentLoadError
from hybridflow.agents.pool_metrics import PoolMetrics
from hybridflow.agents.pool_programs import PoolPrograms
from hybridflow.sandbox_pool import SERVES_ALL
from hybridflow.agents.protocol import Info, Observation, Sessions, Tools, ToolResult
from hybridflow import wire

log = logging.getLogger("hybridflow.agents.server")

IDLE_SESSION_SECONDS = 1800.0
MAX_SESSIONS = 1024
MAX_BODY = 8 << 20  # a request larger than this is refused (413): samples and actions are text of a few KiB
MAX_REPLY = 4 << 20  # a tool's answer or an observation larger than this (as JSON) is refused with why, not sent
MAX_SESSION_SECONDS = 4 * 3600.0  # a session older than this is closed, like an idle one
REQUEST_SECONDS = 60.0  # a connection that sends (or takes) nothing for this long is dropped
CONTENT_LENGTH = re.compile(r"^[0-9]{1,12}$")
SESSION_PATH = re.compile(r"^/v1/sessions/([A-Za-z0-9._-]{1,128})(/step)?$")


class BadRequest(ValueError):
    """The request's JSON lacks a field or has one of the wrong type; the message names it."""

    code = 400


class TooLarge(BadRequest):
    code = 413


class NotServed(LookupError):
    """The job has no tools, or no environment, for this request."""


class Full(RuntimeError):
    """This replica holds its most sessions: the client opens the session on another replica."""


class Expired(LookupError):
    """The session was closed at its maximum lifetime (410: its episode ends, reported; not a lost replica)."""


def _field(body: Info, name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in body:
        raise BadRequest(f"the request has no field '{name}'")
    value = body[name]
    if not isinstance(value, kind):
        raise BadRequest(f"field '{name}' must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


class PoolService:
    """What the endpoints do, apart from HTTP: the boot-scoped session ids over one Tools and one Sessions."""

    def __init__(self, tools: Tools | None, sessions: Sessions | None,
                 idle_seconds: float = IDLE_SESSION_SECONDS, max_sessions: int = MAX_SESSIONS,
                 rewards: Callable[[Info], Info] | None = None, layers: Info | None = None,
                 max_session_seconds: float = MAX_SESSION_SECONDS, max_reply: int = MAX_REPLY,
                 serves: str = SERVES_ALL, programs: PoolPrograms | None = None) -> None:
        """None: the job has no tools, no environment, or no reward function, or this replica does not serve them
        (`serves`, a replica of a pool split in two: hybridflow.api.agents.rewards_apart); its requests answer 404,
        naming which. `rewards` scores one batch (hybridflow.rewards.remote.serve_rewards: the body of POST
        /v1/rewards/score in, its answer out); it is called one batch at a time, as its worker pool is one."""
        self.tools, self.sessions, self.rewards, self.serves = tools, sessions, rewards, serves
        self.programs = programs  # the job's agent program (None: it has none, or this replica serves rewards only)
        # what GET /v1/sandbox answers: this replica's sandbox, {"how", "missing": [[layer, why], ...]}
        self.layers = layers or {"how": "", "missing": []}
        self._scoring = threading.Lock()
        self.idle_seconds, self.max_sessions = idle_seconds, max_sessions
        self.max_session_seconds, self.max_reply = max_session_seconds, max_reply
        self._opened: dict[str, float] = {}  # our session id -> when it was opened (its lifetime's start)
        self._expired: dict[str, None] = {}  # the latest sessions closed at their lifetime (a step answers 410)
        self.boot = secrets.token_hex(6)
        self._local: dict[str, str] = {}  # our session id -> the Sessions' own
        # our session id -> when it was opened or its last step ended; a session in a step is not in it (not idle)
        self._used: dict[str, float] = {}
        self._opening = 0  # sessions whose sandbox is starting: they count against max_sessions already
        self._lock = threading.Lock()
        self.metrics = PoolMetrics()

    def call_tool(self, body: Info) -> Info:
        name = _field(body, "name", str)
        arguments = _field(body, "arguments", dict)
        session = body.get("session")
        if self.tools is None:
            raise NotServed(self._apart("tools") or
                            "this job offers no tools (spec.rollout.agent.tools and toolsFile are unset)")
        out = self.tools.call(name, arguments, session if isinstance(session, str) else None).to_json()
        size = len(wire.encode(out))
        if size > self.max_reply:
            why = f"the {name} tool's answer is {size} bytes, more than the {self.max_reply} a reply may hold"
            return ToolResult(f"Error: {why}.", error=why).to_json()
        return out

    def score(self, body: Info) -> Info:
        if self.rewards is None:
            raise NotServed(self._apart("reward functions") or
                            "this job has no reward function (spec.models.reward.function is unset)")
        fields = [_field(body, k, list) for k in ("data_sources", "solutions", "ground_truths", "extra_infos")]
        if len({len(f) for f in fields}) != 1:
            raise BadRequest("data_sources, solutions, ground_truths and extra_infos must be lists of one length")
        with self._scoring:
            return self.rewards(body)

    def run_program(self, body: Info) -> Info:
        if self.programs is None:
            raise NotServed(self._apart("agent programs") or "this job has no agent program (spec.rollout.agent."
                            "program is unset)")
        try:
            return self.programs.run(body)
        except ValueError as err:
            raise BadRequest(str(err)) from None

    def _apart(self, what: str) -> str:
        """Why a replica of a split pool refuses `what` ("" when it serves everything)."""
        if self.serves == SERVES_ALL:
            return ""
        return f"this replica serves {self.serves} only, not {what}: the job's sandbox pool keeps reward functions " \
               "apart from the model's code (spec.sandbox.allowPartial)"

    def open(self, body: Info) -> Info:
        sample = _field(body, "sample", dict)
        if self.sessions is None:
            raise NotServed(self._apart("environments") or "this job has no environment (spec.rollout.agent."
                            "environment and environmentFile are unset)")
        with self._lock:  # a slot is taken before the sandbox starts, so concurrent opens never pass the cap
            held = len(self._local) + self._opening
            if held >= self.max_sessions:
                raise Full(f"this replica holds {held} open sessions, its most; open it on another")
            self._opening += 1
        try:
            local, first = self.sessions.open(sample)
        except BaseException:
            with self._lock:
                self._opening -= 1
            raise
        sid = f"{self.boot}.{local}"
        first = self._bounded(local, first, "first observation")
        if first.error or first.done:
            self.sessions.close(local)  # over before its first step (idempotent: a failed reset is closed already)
        with self._lock:
            self._opening -= 1
            if not (first.error or first.done):
                self._local[sid], self._used[sid] = local, time.monotonic()
                self._opened[sid] = self._used[sid]
        self._count_open()
        return {"session": sid, "observation": first.to_json()}

    def known(self, sid: str) -> bool:
        with self._lock:
            return sid in self._local

    def step(self, sid: str, body: Info) -> Info | None:
        """None: no such session (closed, ended, or from before a restart)."""
        action = _field(body, "action", str)
        with self._lock:
            local = self._local.get(sid)
            self._used.pop(sid, None)  # however long the step takes, the reaper leaves it alone
        if local is None:
            if sid in self._expired:
                raise Expired(f"session {sid} was closed at this replica's session lifetime of "
                              f"{self.max_session_seconds:g} s")
            return None
        out = self._bounded(local, self.sessions.step(local, action), "observation")
        with self._lock:
            if out.done:  # LocalSessions closed it
                self._local.pop(sid, None)
                self._opened.pop(sid, None)
            elif sid in self._local:  # not closed meanwhile: idle from the end of this step
                self._used[sid] = time.monotonic()
        if out.done:
            self._count_open()
        return out.to_json()

    def close(self, sid: str) -> bool:
        with self._lock:
            local = self._local.pop(sid, None)
            self._used.pop(sid, None)
            self._opened.pop(sid, None)
        if local is None:
            return False
        self.sessions.close(local)
        self._count_open()
        return True

    def idle_sessions(self) -> list[str]:
        """The sessions nobody has stepped for longer than the idle limit."""
        now = time.monotonic()
        with self._lock:
            return [sid for sid, used in self._used.items() if now - used > self.idle_seconds]

    def expired_sessions(self) -> list[str]:
        """The sessions opened longer ago than the session lifetime, in a step or not."""
        now = time.monotonic()
        with self._lock:
            return [sid for sid, opened in self._opened.items() if now - opened > self.max_session_seconds]

    def reap(self) -> int:
        """Close the idle and the expired sessions; how many were closed (a step racing the close finds its session
        gone: 404, or 410 for an expired one; a step under way when its session expires ends with an error)."""
        expired = [sid for sid in self.expired_sessions() if self._expire(sid)]
        if expired:
            self.metrics.expired.inc(len(expired))
            log.info("closed %d environment session(s) older than %.0f s", len(expired), self.max_session_seconds)
        closed = sum(self.close(sid) for sid in self.idle_sessions())
        if closed:
            self.metrics.reaped.inc(closed)
            log.info("closed %d environment session(s) idle for more than %.0f s", closed, self.idle_seconds)
        return closed + len(expired)

    def _expire(self, sid: str) -> bool:
        with self._lock:
            self._expired[sid] = None
            while len(self._expired) > self.max_sessions:  # remember the latest ones only
                self._expired.pop(next(iter(self._expired)))
        return self.close(sid)

    def _bounded(self, local: str, obs: Observation, what: str) -> Observation:
        """`obs`, or where it is larger than a reply may hold, an error that ends its episode (its session closed)."""
        size = len(wire.encode(obs.to_json()))
        if size <= self.max_reply:
            return obs
        self.sessions.close(local)
        return Observation("", done=True, error=f"the environment's {what} is {size} bytes, more than the "
                                                f"{self.max_reply} a reply may hold")

    def _count_open(self) -> None:
        with self._lock:
            self.metrics.open_sessions.set(len(self._local))

    def shutdown(self) -> None:
        if self.sessions is not None:
            self.sessions.shutdown()
        if self.tools is not None:
            self.tools.close()
        if self.programs is not None:
            self.programs.close()


class _Handler(BaseHTTPRequestHandler):
    server: "PoolServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, code: int, body: Info | bytes, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else wire.encode(body)
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        expected = f"Bearer {self.server.token}"
        return hmac.compare_digest(given.encode(), expected.encode())

    def setup(self) -> None:
        self.timeout = self.server.request_seconds  # StreamRequestHandler.setup: the socket's timeout
        super().setup()

    def _body(self) -> Info:
        given = (self.headers.get("Content-Length") or "0").strip()
        if not CONTENT_LENGTH.match(given):
            raise BadRequest(f"Content-Length must be a non-negative integer, not {given[:40]!r}")
        length = int(given)
        if length > MAX_BODY:
            raise TooLarge(f"the request body is {length} bytes; at most {MAX_BODY}")
        raw = self.rfile.read(length) if length else b"{}"
        try:
            return wire.decode(raw)
        except wire.WireError as err:
            raise BadRequest(f"the request body must be one JSON object: {err}") from None

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(200, b"ok\n", "text/plain")
        elif self.path == "/metrics":
            self._reply(200, self.server.service.metrics.text(), CONTENT_TYPE_LATEST)
        elif self.path == "/v1/sandbox":  # which layers this replica's sandboxes lack: the job's to know
            if self._authorized():
                self._reply(200, self.server.service.layers)
            else:
                self._reply(401, {"error": "missing or wrong token (Authorization: Bearer <the job's sandbox token>)"})
        else:
            self._reply(404, {"error": f"no such endpoint: GET {self.path}"})

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        if not self._authorized():
            self.server.service.metrics.refused.inc()
            self.close_connection = True  # the body is not read: the connection cannot carry another request
            self._reply(401, {"error": "missing or wrong token (Authorization: Bearer <the job's token>)"})
            return
        try:
            body = self._body()
        except BadRequest as err:
            self.close_connection = True  # what is left of the body cannot be told from the next request
            self._reply(err.code, {"error": str(err)})
            return
        route = self._route(method)
        if route is None:
            self._reply(404, {"error": f"no such endpoint: {method} {self.path}"})
            return
        kind, run = route
        try:
            code, out = run(body)
        except BadRequest as err:
            code, out = 400, {"error": str(err)}
        except NotServed as err:
            code, out = 404, {"error": str(err)}
        except Full as err:
            code, out = 503, {"error": str(err)}
        except Expired as err:
            code, out = 410, {"error": str(err)}
        except EnvironmentLoadError as err:
            code, out = 422, {"error": str(err)}
        except Exception as err:  # noqa: BLE001 - one request's failure is its answer, never the server's end
            log.exception("%s %s failed", method, self.path)
            code, out = 500, {"error": f"{type(err).__name__}: {err}"}
        self.server.service.metrics.requests.labels(kind, str(code)).inc()
        self._reply(code, out)

    def _route(self, method: str) -> tuple[str, Callable[[Info], tuple[int, Info]]] | None:
        service = self.server.service
        if method == "POST" and self.path == "/v1/tools/call":
            return "tool", lambda body: (200, service.call_tool(body))
        if method == "POST" and self.path == "/v1/sessions":
            return "open", lambda body: (200, service.open(body))
        if method == "POST" and self.path == "/v1/rewards/score":
            return "reward", lambda body: (200, service.score(body))
        if method == "POST" and self.path == "/v1/programs/run":
            return "program", lambda body: (200, service.run_program(body))
        found = SESSION_PATH.match(self.path)
        if found is None:
            return None
        sid, step = found.group(1), bool(found.group(2))
        gone = {"error": f"no session {sid} here (closed, ended, or opened before this replica restarted)"}
        if method == "POST" and step:
            def run_step(body: Info) -> tuple[int, Info]:
                out = service.step(sid, body)
                return (404, gone) if out is None else (200, out)
            return "step", run_step
        if method == "DELETE" and not step:
            return "close", lambda body: (200, {"closed": service.close(sid)})
        return None


class PoolServer(ThreadingHTTPServer):
    """One replica of the environment pool: a thread per request, so a slow tool or step holds only its caller."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, service: PoolService, token: str, address: str = "127.0.0.1", port: int = 0,
                 request_seconds: float = REQUEST_SECONDS) -> None:
        if not token:
            raise ValueError("the sandbox pool needs the job's sandbox token (HYBRIDFLOW_SANDBOX_TOKEN); none was given")
        self.service, self.token, self.request_seconds = service, token, request_seconds
        self._stopped = threading.Event()
        super().__init__((address, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> threading.Thread:
        """Serve in a background thread (tests, and a process that also waits on signals)."""
        thread = threading.Thread(target=self.serve_forever, name="environment-pool", daemon=True)
        thread.start()
        threading.Thread(target=self._reap_idle, name="environment-pool-reaper", daemon=True).start()
        return thread

    def _reap_idle(self) -> None:
        every = max(0.05, min(60.0, self.service.idle_seconds / 4, self.service.max_session_seconds / 4))
        while not self._stopped.wait(every):
            try:
                self.service.reap()
            except Exception:  # noqa: BLE001 - a failed close is logged; the reaper goes on with the rest next time
                log.exception("closing idle sessions failed")

    def stop(self) -> None:
        """Stop answering, then end every session's sandbox."""
        self._stopped.set()
        self.shutdown()
        self.server_close()
        self.service.shutdown()
