"""The OpenAI-compatible endpoint that a job's agent programs (spec.rollout.agent.program) call for one rollout:
HTTP on a Unix socket (the program's sandbox has no network, the socket is bound into it) and, for programs run in
the sandbox pool (`listen`), on TCP at the pod's address, which the pool's replica relays their sockets to; serving

    POST /v1/chat/completions, POST /v1/completions, GET /v1/models

Each episode has its own bearer token (`open(row)`), accepted until `end(token)`, which returns the episode's
calls (hybridflow.agents.trajectory.Call) and which of them ran out (Ended; `close(token)`: the calls alone); a
request without a live token answers 401, on either listener. The socket lies in a private temporary directory
that other users may traverse but not list, and is itself connectable by any user (the sandbox runs as another uid):
the token is the authentication (hybridflow.agents.unix_http serves both).

Exact token capture: a chat request whose messages are the episode's previous request's messages, then the
assistant message the endpoint returned for it (its content and tool calls, unchanged), then new messages, is
that previous prompt's ids + the ids the engine wrote + the new messages rendered as the codec renders answers
after a model turn (ObservationCodec.observation_ids): the model's own text is never tokenized again. Any other
request is rendered fresh by the chat template (a break: Call.extends_previous false). A completion request
continues the previous one when its prompt is the previous prompt + the returned text + more text (or, with token
ids, the previous ids + the completion ids + more ids).

Budget: an episode's chain (the calls that continue each other) holds at most `max_tokens` tokens after its first
prompt, as run_episodes' episodes do, and each completion at most `max_tokens_per_turn`. A request past the budget,
or past `max_turns` calls, gets an empty completion with finish_reason "length" (no engine call): a program that
checks finish_reason stops there, and one that does not cannot run the job out of tokens. A call's completion is also
at most `max_context` (the engine's context: maxPromptLength + maxResponseLength) less its prompt's length, and a
prompt of `max_context` tokens or more answers 400 (OpenAI's code context_length_exceeded), as do token ids outside
the vocabulary: no request reaches the engine with what the engine would refuse. A chain that runs out (a
completion cut by the chain's budget or the context, or a request continuing the chain refused for either) is
marked at its last recorded call (Ended.cut): the row trained from it is truncated, as run_episodes marks an
episode that ran out of its tokens (a turn's cap or max_turns is no such end, there or here).

Connections: at most `max_connections` at once (one more: 503, closed); a request's token is checked right after
its headers, before its body (401, the body unread); a body is at most MAX_BODY bytes (413), in within BODY_SECONDS
(408); a connection whose body went unread is closed.
A closed or spent (`max_turns`) episode's request is answered before anything is rendered, and a request's text is
at most CHARS_PER_TOKEN characters per token of `max_context` (else 400) before it is tokenized.

Scheduling: only the thread that calls `pump` ever calls the engine; requests of concurrent episodes that arrive
within GATHER_SECONDS of the first share one call (Model.generate). The requests of one episode are served one at
a time (its chain is a sequence). A request whose episode closed while it waited (its program ran out of time) is
dropped before the engine call, answered 503. What is honoured of a request: hybridflow.agents.openai_wire.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from hybridflow.agents import openai_wire as wire
from hybridflow.agents.codec import ObservationCodec
from hybridflow.agents.loop import GATHER_SECONDS, Model
from hybridflow.agents.protocol import Listen
from hybridflow.agents.toolcalls import tool_call_text
from hybridflow.agents.trajectory import Call
from hybridflow.agents.unix_http import Listeners

log = logging.getLogger("hybridflow.agents.endpoint")

MAX_BODY = 8 << 20
REQUEST_SECONDS = 60.0  # a connection that sends nothing for this long is dropped
BODY_SECONDS = 30.0  # a request's whole body must arrive within this long of its headers
MAX_CONNECTIONS = 256  # connections served at once (each holds a thread)
CHARS_PER_TOKEN = 64  # a text of more characters than this per token of the context cannot fit it


@dataclass(frozen=True)
class EndpointSettings:
    max_tokens: int  # a chain's tokens after its first prompt
    max_tokens_per_turn: int | None = None
    max_turns: int = 4
    model_name: str = "policy"
    gather_seconds: float = GATHER_SECONDS  # after the first request, how long the pump waits for others
    max_context: int | None = None  # the engine's context length (prompt + completion); None: not bounded here
    max_connections: int = MAX_CONNECTIONS


@dataclass
class _Previous:
    """What a continuing request must repeat: the last request (chat: its messages and tools; completion: its
    prompt), what it was answered, and the ids."""

    chat: bool
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    reply: wire.Reply
    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass
class _Episode:
    row: int
    calls: list[Call] = field(default_factory=list)
    previous: _Previous | None = None
    chain_start: int = 0  # the length of the chain's first prompt
    chain: int = 0  # the chain the episode's requests are in (a break starts the next)
    recorded_chain: int = -1  # the chain of the last recorded call
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    cut: set[int] = field(default_factory=set)  # Ended.cut


@dataclass(frozen=True)
class Ended:
    """An ended episode's calls, and `cut`: the indices of the calls after which their chain ran out of its budget
    or the engine's context (the call's completion cut there, or the next request continuing it refused)."""

    calls: list[Call]
    cut: frozenset[int] = frozenset()


@dataclass
class _Pending:
    """One engine call waiting for the pump: its episode, context and budget; then its answer."""
    episode: _Episode
    context: list[int]
    budget: int
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[list[int], list[float]] | None = None
    error: str | None = None


class Endpoint:
    """One rollout's endpoint: start it, `open` a token per episode, run `pump` on the engine's thread until the
    programs end, `close` each token, `stop` it (also as a context manager). `listen`: its TCP listener too (`url`)."""

    def __init__(self, codec: ObservationCodec, settings: EndpointSettings, listen: Listen | None = None) -> None:
        self.codec, self.settings = codec, settings
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()
        self._codec_lock = threading.Lock()  # a fast tokenizer's state is not safe to share between threads
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self.engine_calls = 0  # Model.generate calls so far (concurrent episodes' requests share them)
        self._stopped = False
        self._dir = tempfile.mkdtemp(prefix="hybridflow-endpoint-")
        os.chmod(self._dir, 0o711)  # the sandbox's uid may reach the socket by name, not list the directory
        self.socket_path = os.path.join(self._dir, "openai.sock")
        self.vocab = len(codec.tokenizer)  # token ids the engine accepts: [0, vocab)
        self.max_chars = min(MAX_BODY, CHARS_PER_TOKEN * (settings.max_context or MAX_BODY))
        try:
            self._servers = Listeners(self.socket_path, _handler(self), settings.max_connections, listen)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.url = self._servers.url  # "http://host:port" of the TCP listener (None: the socket alone)

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """No more requests; waiting ones answer 503; the socket and its directory go."""
        self._stopped = True
        self._servers.stop()
        while True:
            try:
                p = self._queue.get_nowait()
            except queue.Empty:
                break
            p.error = "the endpoint stopped"
            p.done.set()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- episodes --------------------------------------------------------------------------------------------------

    def open(self, row: int) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._episodes[token] = _Episode(row)
        return token

    def end(self, token: str) -> Ended:
        """The episode's calls and which ran out; its token is refused from now on, and a call in flight is not
        recorded (calls are recorded under the same lock: each is in the list returned or never recorded)."""
        with self._lock:
            e = self._episodes.pop(token, None)
            if e is None:
                return Ended([])
            e.closed = True
            return Ended(list(e.calls), frozenset(e.cut))

    def close(self, token: str) -> list[Call]:
        return self.end(token).calls

    def episode(self, authorization: str | None) -> _Episode | None:
        given = (authorization or "").removeprefix("Bearer ").strip()
        with self._lock:
            for token, e in self._episodes.items():  # constant-time comparison, as the pool's server does
                if hmac.compare_digest(token.encode(), given.encode()):
                    return e
        return None

    # -- the engine's thread ---------------------------------------------------------------------------------------

    def pump(self, model: Model, timeout: float) -> int:
        """Wait up to `timeout` for a request, gather others for `gather_seconds`, answer them with one engine call;
        how many the engine answered. A request of a closed episode is dropped (503). An engine error answers them 503
        and is raised (the rollout fails)."""
        try:
            batch = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return 0
        deadline = time.monotonic() + self.settings.gather_seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                batch.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        for p in batch:
            if p.episode.closed:  # its program ended while it waited: nobody reads the answer
                p.error = "the episode ended"
                p.done.set()
        batch = [p for p in batch if not p.episode.closed]
        if not batch:
            return 0
        try:
            outs = model.generate([p.episode.row for p in batch], [p.context for p in batch],
                                  [p.budget for p in batch])
        except BaseException as err:
            for p in batch:
                p.error = f"the engine failed: {type(err).__name__}"
                p.done.set()
            raise
        self.engine_calls += 1
        for p, out in zip(batch, outs):
            p.result = out
            p.done.set()
        return len(batch)

    def _generate(self, e: _Episode, context: list[int], budget: int) -> tuple[list[int], list[float]]:
        p = _Pending(e, context, budget)
        self._queue.put(p)
        while not p.done.wait(0.5):
            if self._stopped:  # put after stop() emptied the queue: nobody will answer it
                raise wire.ApiError(503, "the endpoint stopped", kind="server_error")
        if p.result is None:
            raise wire.ApiError(503, p.error or "no answer", kind="server_error")
        tokens, log_probs = p.result
        tokens = tokens[:budget]
        return tokens, list(log_probs[: len(tokens)])

    # -- requests (handler threads) --------------------------------------------------------------------------------

    def _budget(self, e: _Episode, prompt_ids: list[int], asked: int | None) -> tuple[int, int]:
        """What this call may write: the chain's budget, the context's room, the turn's and the request's caps (past
        max_turns no call gets here: _may_call answers it first); and the first two's minimum, the chain's room."""
        left = self.settings.max_tokens - (len(prompt_ids) - e.chain_start)
        room = min(left, left if self.settings.max_context is None else self.settings.max_context - len(prompt_ids))
        return max(0, min(room, self.settings.max_tokens_per_turn or left, asked or left)), room

    def _ran_out(self, e: _Episode, extends: bool) -> None:
        """A request continuing e's chain is refused for its budget or the context: the chain ends at its last
        recorded call."""
        with self._lock:
            if extends and e.calls and e.recorded_chain == e.chain and not e.closed:
                e.cut.add(len(e.calls) - 1)

    def _may_call(self, e: _Episode) -> bool:  # False: past max_turns; a closed episode is refused
        if e.closed:
            raise wire.ApiError(401, "the episode ended: its token is no longer accepted", kind="authentication_error")
        return len(e.calls) < self.settings.max_turns

    def _bound_text(self, e: _Episode, extends: bool, chars: int, param: str) -> None:  # before it is tokenized
        try:
            wire.bound_text(chars, self.max_chars, self.settings.max_context, param)
        except wire.ApiError:
            self._ran_out(e, extends)
            raise

    def chat(self, e: _Episode, req: wire.ChatRequest) -> dict[str, Any]:
        with e.lock:
            if not self._may_call(e):  # no engine call: nothing is rendered
                return wire.chat_response(wire.Reply("", "", [], "length"), self.settings.model_name, 0, 0)
            prev = e.previous
            extends = (prev is not None and prev.chat and prev.tools == req.tools and prev.messages is not None
                       and len(req.messages) > len(prev.messages)
                       and req.messages[: len(prev.messages)] == prev.messages
                       and wire.same_as_returned(req.messages[len(prev.messages)], prev.reply))
            if extends and prev is not None and prev.messages is not None:
                new = req.messages[len(prev.messages) + 1:]
                self._bound_text(e, True, wire.text_size(new), "messages")
                closed = bool(prev.completion_ids) and prev.completion_ids[-1] in self.codec.stop_token_ids
                with self._codec_lock:
                    after = self.codec.observation_ids([(m["role"], self._text(m)) for m in new], closed)
                prompt_ids = prev.prompt_ids + prev.completion_ids + after
            else:
                self._bound_text(e, False, wire.text_size(req.messages, req.tools), "messages")
                with self._codec_lock:
                    prompt_ids = self.codec.prompt_ids(req.messages, req.tools)
            tokens, log_probs, r = self._call(e, prompt_ids, req.max_tokens, extends, "messages")
            e.previous = _Previous(True, req.messages, req.tools, None, r, prompt_ids, tokens)
            return wire.chat_response(r, self.settings.model_name, len(prompt_ids), len(tokens))

    @staticmethod
    def _text(m: dict[str, Any]) -> str:
        """A new message as the codec shows it: an assistant message the program wrote keeps its calls as text."""
        return m["content"] + "".join(tool_call_text(c["function"]["name"], c["arguments"])
                                      for c in m.get("tool_calls") or [])

    def completion(self, e: _Episode, req: wire.CompletionRequest) -> dict[str, Any]:
        with e.lock:
            if not self._may_call(e):  # no engine call: nothing is tokenized
                return wire.completion_response("", "length", self.settings.model_name, 0, 0)
            prev = e.previous
            extends, prompt_ids = False, []
            if prev is not None and not prev.chat and isinstance(req.prompt, list) and isinstance(prev.prompt, list):
                before = prev.prompt + prev.completion_ids
                extends = req.prompt[: len(before)] == before and len(req.prompt) >= len(before)
                prompt_ids = prev.prompt_ids + prev.completion_ids + req.prompt[len(before):] if extends else []
            elif prev is not None and not prev.chat and isinstance(req.prompt, str) and isinstance(prev.prompt, str):
                before_text = prev.prompt + prev.reply.text
                extends = req.prompt.startswith(before_text)
                if extends:
                    self._bound_text(e, True, len(req.prompt) - len(before_text), "prompt")
                    with self._codec_lock:
                        more = self.codec.text_ids(req.prompt[len(before_text):])
                    prompt_ids = prev.prompt_ids + prev.completion_ids + more
            if not extends:
                self._bound_text(e, False, len(req.prompt) if isinstance(req.prompt, str) else 0, "prompt")
                with self._codec_lock:
                    prompt_ids = list(req.prompt) if isinstance(req.prompt, list) else self.codec.text_ids(req.prompt)
            tokens, log_probs, r = self._call(e, prompt_ids, req.max_tokens, extends, "prompt")
            e.previous = _Previous(False, None, None, req.prompt, r, prompt_ids, tokens)
            return wire.completion_response(r.text, "stop" if r.finish_reason == "stop" else "length",
                                            self.settings.model_name, len(prompt_ids), len(tokens))

    def _call(self, e: _Episode, prompt_ids: list[int], asked: int | None, extends: bool,
              param: str) -> tuple[list[int], list[float], wire.Reply]:
        try:
            wire.check_context(len(prompt_ids), self.settings.max_context, param)  # what the engine would refuse
        except wire.ApiError:
            self._ran_out(e, extends)
            raise
        if not extends:
            e.chain_start, e.chain = len(prompt_ids), e.chain + 1
        budget, room = self._budget(e, prompt_ids, asked)
        if budget <= 0:
            if room <= 0:
                self._ran_out(e, extends)
            return [], [], wire.Reply("", "", [], "length")
        tokens, log_probs = self._generate(e, prompt_ids, budget)
        closed = bool(tokens) and tokens[-1] in self.codec.stop_token_ids
        with self._lock:  # ordered with end(): recorded only while the episode is open
            if not e.closed:  # it extends the last recorded call only if that call is in its chain
                cut = not closed and len(tokens) >= room  # it wrote up to the chain's budget or the context
                e.calls.append(Call(list(prompt_ids), list(tokens), list(log_probs), e.recorded_chain == e.chain, cut))
                e.recorded_chain = e.chain
                if cut:  # Ended.cut; Call.cut: its own completion (per_call marks no call for a refusal after it)
                    e.cut.add(len(e.calls) - 1)
        with self._codec_lock:
            text = self.codec.decode(tokens)
        return tokens, log_probs, wire.reply(text, closed)


def _handler(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_SECONDS
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            log.debug(format, *args)

        def address_string(self) -> str:  # a Unix socket's peer has no address
            return "unix" if isinstance(self.client_address, (str, bytes)) else str(self.client_address[0])

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _answer(self, post: bool) -> None:
            self.unread = post  # a body not read (refused first): the connection cannot carry another request
            try:
                status, body = 200, self._route(post)
            except wire.ApiError as err:
                status, body = err.status, err.body()
            except Exception as err:  # noqa: BLE001 - the program gets a 500, the endpoint goes on
                log.exception("agent endpoint request failed")
                status, body = 500, wire.ApiError(500, f"{type(err).__name__}: {err}", kind="server_error").body()
            self.close_connection = self.close_connection or self.unread
            try:
                self._send(status, body)
            except (ConnectionError, TimeoutError):  # the program went (its time ran out): nobody reads the answer
                self.close_connection = True

        def _route(self, post: bool) -> dict[str, Any]:
            e = endpoint.episode(self.headers.get("Authorization"))
            if e is None:  # before the body: a request without a token costs no read
                raise wire.ApiError(401, "no valid token: each episode's bearer token is accepted while its program "
                                         "runs", kind="authentication_error")
            path = self.path.split("?", 1)[0].rstrip("/")
            if not post and path == "/v1/models":
                return wire.models_response(endpoint.settings.model_name)
            if post and path == "/v1/chat/completions":
                return endpoint.chat(e, wire.parse_chat(self._body()))
            if post and path == "/v1/completions":
                return endpoint.completion(e, wire.parse_completion(self._body(), endpoint.vocab))
            raise wire.ApiError(404, f"no such endpoint: {self.command} {path}")

        def _body(self) -> bytes:
            length = self.headers.get("Content-Length", "0")
            if not length.isdigit():
                raise wire.ApiError(400, "Content-Length must be a non-negative integer")
            if int(length) > MAX_BODY:
                raise wire.ApiError(413, f"the request is larger than {MAX_BODY} bytes")
            size, chunks, deadline = int(length), [], time.monotonic() + BODY_SECONDS
            try:
                while size > 0:  # the whole body within BODY_SECONDS, however it trickles in
                    if (left := deadline - time.monotonic()) <= 0:
                        raise TimeoutError
                    self.connection.settimeout(left)
                    chunk = self.rfile.read1(min(size, 1 << 16))
                    if not chunk:
                        raise wire.ApiError(400, "the connection closed before the whole body came")
                    chunks.append(chunk)
                    size -= len(chunk)
            except TimeoutError:
                raise wire.ApiError(408, f"the request's body did not arrive within {BODY_SECONDS:g} s") from None
            finally:
                self.connection.settimeout(self.timeout)
            self.unread = False
            return b"".join(chunks)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._answer(False)

        def do_POST(self) -> None:  # noqa: N802
            self._answer(True)

    return Handler
