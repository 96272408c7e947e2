"""The OpenAI wire format of the agent endpoint (hybridflow.agents.endpoint): requests read into plain values, and
the answers an `openai` client expects, as pure functions of JSON, so that what the endpoint accepts and refuses is
decided (and tested) apart from its sockets and its engine.

What is honoured and what is not, and why:
- `messages` (system, developer as system, user, assistant with `tool_calls`, tool), `tools`, `max_tokens` /
  `max_completion_tokens` (capped by the episode's budget), `n` (1 only). `model` may name anything: the policy
  being trained answers (GET /v1/models names it `policy`).
- Sampling overrides (`temperature`, `top_p`, `seed`, penalties, `logprobs`, ...) are ignored: the job's sampling
  settings are what the trainer's importance ratios assume, and agent frameworks send their own defaults on every
  request, so refusing them would refuse most programs.
- `stream: true` and `stop` sequences are refused (400, naming the field): a completion ends where the model's
  own end-of-turn token or its budget ends it, never mid-token at a string, so that its ids stay the engine's.
- Token ids outside the model's vocabulary are refused (400), as the engine would refuse them; a prompt too long
  for the engine's context is refused by the endpoint (400, code `context_length_exceeded`).
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.toolcalls import TOOL_CALL, parse_tool_calls

ROLES = {"system", "user", "assistant", "tool"}


class ApiError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A chat request: its messages normalized (content a str; each tool call with its parsed `arguments`)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None


@dataclass
class CompletionRequest:
    prompt: str | list[int] = ""
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Reply:
    """What the model's completion came to, as the program reads it."""

    text: str
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"


def _object(body: bytes) -> dict[str, Any]:
    try:
        req = json.loads(body or b"null")
    except ValueError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(req, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if req.get("stream"):
        raise ApiError(400, "stream: true is not supported by this endpoint; send stream: false", "stream")
    if req.get("n") not in (None, 1):
        raise ApiError(400, "n must be 1: each request is one completion of the episode", "n")
    if req.get("stop"):
        raise ApiError(400, "stop sequences are not supported: a completion ends at the model's own end-of-turn "
                            "token or its token budget", "stop")
    return req


def _max_tokens(req: dict[str, Any], default: int | None) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = req.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ApiError(400, f"{key} must be a positive integer", key)
            return value
    return default


def _content(value: Any, where: str) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts (no images or audio here)", where)


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for j, c in enumerate(value or []):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}.tool_calls[{j}] must be "
                                "{id, type: function, function: {name, arguments}}", where)
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments is not valid JSON", where) from None
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
                    "arguments": parsed if isinstance(parsed, dict) else {}})
    return out


def parse_chat(body: bytes, default_max_tokens: int | None = None) -> ChatRequest:
    req = _object(body)
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a role", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ROLES:
            raise ApiError(400, f"{where}.role {m['role']!r} is not one of {sorted(ROLES | {'developer'})}", "messages")
        msg: dict[str, Any] = {"role": role, "content": _content(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        out.append(msg)
    tools = req.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ApiError(400, "tools must be a list of objects", "tools")
    return ChatRequest(out, tools or None, _max_tokens(req, default_max_tokens))


def parse_completion(body: bytes, vocab: int | None = None) -> CompletionRequest:
    """A completion request; token ids must lie in [0, vocab) (the engine refuses any other id)."""
    req = _object(body)
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise ApiError(400, "prompt must be one non-empty string or one list of token ids", "prompt")
    if ok_ids and vocab is not None and max(prompt) >= vocab:
        raise ApiError(400, f"prompt holds token id {max(prompt)}, outside this model's vocabulary [0, {vocab})",
                       "prompt")
    return CompletionRequest(prompt, _max_tokens(req, 16))


def check_context(prompt_tokens: int, max_context: int | None, param: str) -> None:
    """A prompt must leave the engine's context room for at least one more token (the engine refuses it else)."""
    if max_context is not None and prompt_tokens >= max_context:
        raise ApiError(400, f"the prompt is {prompt_tokens} tokens; this model's context is {max_context} tokens, "
                            "and a prompt must leave room for at least one more", param, code="context_length_exceeded")


def bound_text(chars: int, max_chars: int, max_context: int | None, param: str) -> None:
    """A request's text must be at most `max_chars` characters before it is tokenized."""
    if chars > max_chars:
        raise ApiError(400, f"the request's text is {chars} characters, more than the endpoint tokenizes ({max_chars}"
                            f": the model's context is {max_context} tokens)", param, code="context_length_exceeded")


def raw_answer(status: str, err: ApiError) -> bytes:
    """A whole HTTP answer that closes its connection, for a connection no handler serves."""
    body = json.dumps(err.body()).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def text_size(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """The characters a chat request's messages (contents and tool calls) and tools come to: what the endpoint
    would render and tokenize, bounded before it does."""
    calls = sum(len(c["function"]["name"]) + len(c["function"]["arguments"])
                for m in messages for c in m.get("tool_calls") or [])
    return sum(len(m["content"]) for m in messages) + calls + (len(json.dumps(tools)) if tools else 0)


def reply(text: str, closed: bool) -> Reply:
    """The model's text as the assistant's message: its tool calls (the standard `<tool_call>` form) and the text
    around them; finish_reason tool_calls, stop (its end-of-turn token) or length (its budget ended it)."""
    calls = [c for c in parse_tool_calls(text) if c.error is None]
    if not calls:
        return Reply(text, text, [], "stop" if closed else "length")
    tool_calls = [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
    content = TOOL_CALL.sub("", text).strip()
    return Reply(text, content or None, tool_calls, "tool_calls")


def same_as_returned(sent: dict[str, Any], returned: Reply) -> bool:
    """Whether an assistant message the program sent back is the one the endpoint returned (its content and its
    calls: names and arguments as JSON values; ids and other fields are not the model's text)."""
    if sent["role"] != "assistant" or (sent.get("content") or "") != (returned.content or ""):
        return False
    mine = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in returned.tool_calls]
    theirs = [(c["function"]["name"], c["arguments"]) for c in sent.get("tool_calls", [])]
    return mine == theirs


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(r: Reply, model: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": r.content}
    if r.tool_calls:
        message["tool_calls"] = r.tool_calls
    return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": r.finish_reason,
                                         "logprobs": None}],
            "usage": _usage(prompt_tokens, completion_tokens)}


def completion_response(text: str, finish_reason: str, model: str, prompt_tokens: int,
                        completion_tokens: int) -> dict[str, Any]:
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": _usage(prompt_tokens, completion_tokens)}


def models_response(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "hybridflow"}]}
