"""Between turns, text becomes tokens only for what the model did not write: the answers of tools and environments,
rendered as the model's chat template renders a tool's (or a user's) message, so that the model reads them as it
was trained to. The model's own tokens are never re-tokenized: a turn's text is decoded only to be read.

The template's rendering of one message is found by difference: the template over [system, message] with the
generation prompt, less the template over [system]. What the template puts after an assistant message's content
(its end-of-turn text, e.g. `<|im_end|>\\n`) is found the same way, less what the model's stop token already wrote.
Without a template, or when the template does not render this way, the plain-text form is used."""
from __future__ import annotations

from typing import Any, Sequence

from hybridflow.agents.toolcalls import plain_tools_text, tool_call_text, tool_response_text

_MARK = "\x00HYBRIDFLOW-CONTENT\x00"


class ObservationCodec:
    def __init__(self, tokenizer: Any, template: str | None, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer, self.template = tokenizer, template
        self.stop_token_ids = frozenset(stop_token_ids)
        self.tool_role = False
        self.end_of_turn = "\n"
        if template:
            try:
                self._learn_template()
            except Exception:  # noqa: BLE001 - a template that cannot render this way: the plain form
                self.template = None

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool,
                tools: Sequence[dict[str, Any]] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=generation_prompt,
                                                  tools=list(tools) if tools else None)

    def _learn_template(self) -> None:
        system = [{"role": "system", "content": "S"}]
        base = self._render(system, False)
        after = self._render(system + [{"role": "assistant", "content": _MARK}], False)
        if not after.startswith(base) or _MARK not in after:
            raise ValueError("the template does not render messages one after another")
        end = after.split(_MARK, 1)[1]
        stops = [self.tokenizer.decode([t]) for t in self.stop_token_ids]
        stop = next((s for s in stops if s and end.startswith(s)), "")
        self.end_of_turn, self._after_stop = end, end[len(stop):]
        # A tool role only where the template knows one (a template that renders any role name would show a
        # model never trained on it a `tool` header): else a user message in the plain form.
        try:
            self.tool_role = "tool" in (self.template or "") and _MARK in self._messages_text([("tool", _MARK)])
        except Exception:  # noqa: BLE001 - templates that refuse a tool role raise
            self.tool_role = False

    def _messages_text(self, parts: Sequence[tuple[str, str]]) -> str:
        system = [{"role": "system", "content": "S"}]
        base = self._render(system, False)
        full = self._render(system + [{"role": r, "content": c} for r, c in parts], True)
        if not full.startswith(base):
            raise ValueError("the template does not render messages one after another")
        return full[len(base):]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def observation_text(self, parts: Sequence[tuple[str, str]], closed: bool) -> str:
        if not self.template:
            body = "".join(f"\n{tool_response_text(t) if role == 'tool' else t}\n" for role, t in parts)
            return body
        shown = [("user", tool_response_text(c)) if r == "tool" and not self.tool_role else (r, c) for r, c in parts]
        return (self._after_stop if closed else self.end_of_turn) + self._messages_text(shown)

    def observation_ids(self, parts: Sequence[tuple[str, str]], closed: bool) -> list[int]:
        return self.text_ids(self.observation_text(parts, closed))

    # -- an agent program's chat requests (hybridflow.agents.endpoint) ------------------------------------------------

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        """A whole conversation rendered fresh, as the model's template renders it for its next turn (the tools in
        the template's own form); without a template, the plain-text form. Used only where the conversation does not
        continue the episode's previous call: the model's own earlier text is then tokenized again (a break)."""
        if not self.template:
            head = [plain_tools_text(tools)] if tools else []
            text = "".join(f"{t}\n" for t in head + [m.get("content") or "" for m in messages])
        else:
            text = self._render([self._shown(m) for m in messages], True, tools)
        return self.text_ids(text)

    def _shown(self, m: dict[str, Any]) -> dict[str, Any]:
        """A tool's message as observation_text shows it (a user message where the template has no tool role)."""
        if m["role"] == "tool" and not self.tool_role:
            return {"role": "user", "content": tool_response_text(m.get("content") or "")}
        calls = m.get("tool_calls") or []
        if m["role"] != "assistant" or not calls:
            return m
        if "tool_calls" in (self.template or ""):  # templates that render calls read their arguments as a mapping
            return {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": c["arguments"]}}
                                        for c in calls]}
        written = "".join(tool_call_text(c["function"]["name"], c["arguments"]) for c in calls)
        return {"role": "assistant", "content": (m.get("content") or "") + written}

    def text_ids(self, text: str) -> list[int]:
        """Text the model did not write (answers between turns, a rendered prompt, a completion request's appended
        prompt), tokenized as prompts are."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
