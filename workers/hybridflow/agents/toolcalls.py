"""Tool calls in the model's text and the tools in its prompt, in the standard form (Hermes / Qwen / SmolLM3 and
what HF chat templates render): the model writes

    <tool_call>{"name": "calculator", "arguments": {"expression": "123 * 45"}}</tool_call>

and reads each answer back as the tool's message (a chat template's `tool` role) or, where the model's template has
no tool role or there is no template, in the documented plain-text form `<tool_response>...</tool_response>`.
Pure functions of text."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_CALLS_PER_TURN = 8


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None  # the call could not be read (bad JSON, no name): the model is told, nothing runs


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` of a turn, in order (at most MAX_CALLS_PER_TURN); one that is not
    {"name": str, "arguments": object-or-JSON-string} is a ToolCall with `error`."""
    out = []
    for body in TOOL_CALL.findall(text)[:MAX_CALLS_PER_TURN]:
        try:
            call = json.loads(body)
        except ValueError as err:
            out.append(ToolCall("", {}, f"the tool call is not valid JSON ({err.msg} at character {err.pos})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append(ToolCall("", {}, 'a tool call must be {"name": ..., "arguments": {...}}'))
            continue
        args = call.get("arguments", call.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            out.append(ToolCall(call["name"], {}, "the tool call's arguments must be a JSON object"))
            continue
        out.append(ToolCall(call["name"], args))
    return out


PLAIN_TOOLS_HEADER = (
    "You can call tools. To call one, write\n"
    '<tool_call>{"name": "<tool name>", "arguments": {<its arguments as JSON>}}</tool_call>\n'
    "and stop; its answer comes back as <tool_response>...</tool_response>. Then go on, or give your final answer "
    "without a tool call. The tools:")


def plain_tools_text(tools: Sequence[dict[str, Any]]) -> str:
    """The documented plain-text form of the tools, for a model whose chat template does not render `tools` (or
    that has none): a paragraph put into the system message."""
    lines = [PLAIN_TOOLS_HEADER]
    for t in tools:
        fn = t["function"]
        props = fn.get("parameters", {}).get("properties", {})
        params = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        lines.append(f"- {fn['name']}({params}): {fn.get('description', '')}")
    return "\n".join(lines)


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template uses the `tools` it is given (HF passes them to every template; most ignore them)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


def tool_response_text(text: str) -> str:
    """A tool's answer in the plain-text form (also the content of a `user` message standing in for a tool role)."""
    return f"<tool_response>\n{text}\n</tool_response>"


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call in the standard form, as a model writes it (for a template that does not render `tool_calls`)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
