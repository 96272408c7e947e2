"""Where an agent program's chain runs out (hybridflow.agents.endpoint, Ended.cut): a completion cut by the chain's
budget (spec.rollout.maxResponseLength) or by the engine's context, or a request continuing the chain refused for
either (an empty completion cut by "length", or a 400 context_length_exceeded), marks the chain's last recorded call,
so that the row trained from it is truncated, as run_episodes marks an episode that ran out of its tokens; a turn's
cap, the request's own max_tokens, max_turns, or a new chain after a cut mark nothing more. A character-per-token
codec and a scripted model (each character one token), the real endpoint over its Unix socket."""
from __future__ import annotations

import threading
from typing import Any, Callable

import httpx
import pytest

from hybridflow.agents.endpoint import Endpoint, EndpointSettings, Ended

from support.agent_doubles import CharCodec


class Codec(CharCodec):
    """CharCodec with what the endpoint renders: a chat prompt is its messages' contents, each in brackets."""

    tokenizer = range(0x110000)

    def prompt_ids(self, messages: Any, tools: Any) -> list[int]:
        return [ord(c) for m in messages for c in f"[{m['content']}]"]

    def text_ids(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class Writes:
    """The model: `text` (or text(call number)), one token per character, then the stop token 0, cut at the budget."""

    def __init__(self, text: str | Callable[[int], str]) -> None:
        self.text, self.calls = text, 0

    def generate(self, rows, contexts, max_tokens):
        out = []
        for m in max_tokens:
            text = self.text(self.calls) if callable(self.text) else self.text
            self.calls += 1
            ids = ([ord(c) for c in text] + [0])[:m]
            out.append((ids, [-0.5] * len(ids)))
        return out


def run(settings: EndpointSettings, model: Writes, program: Callable[[Callable[..., Any]], Any]) -> tuple[Any, Ended]:
    """`program(ask)` on a thread, ask(body) -> (status, json) a chat request of its episode; this thread pumps."""
    with Endpoint(Codec(), settings) as endpoint:
        token, box = endpoint.open(0), {}
        http = httpx.Client(transport=httpx.HTTPTransport(uds=endpoint.socket_path), timeout=30)

        def ask(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            r = http.post("http://hybridflow/v1/chat/completions", json={"model": "p", **body},
                          headers={"Authorization": f"Bearer {token}"})
            return r.status_code, r.json()

        thread = threading.Thread(target=lambda: box.update(out=program(ask)))
        thread.start()
        while thread.is_alive():
            endpoint.pump(model, 0.02)
        http.close()
        return box.get("out"), endpoint.end(token)


def conversation(turns: int, more: str = "More.", max_tokens: int | None = None) -> Callable[[Any], list]:
    """A program that sends the conversation back `turns` times, each time with `more` from the user."""
    def program(ask: Callable[..., Any]) -> list:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Go."}]
        answers = []
        for _ in range(turns):
            status, body = ask({"messages": messages} | ({"max_tokens": max_tokens} if max_tokens else {}))
            answers.append((status, body["choices"][0] if status == 200 else body["error"]))
            if status != 200:
                break
            messages += [body["choices"][0]["message"], {"role": "user", "content": more}]
        return answers
    return program


def test_a_continuation_refused_for_the_chains_budget_marks_its_last_call():
    """6 tokens (the turn's cap: no mark), then "[More.]" leaves the chain of 10 no room: the next request is an empty
    completion cut by length, and the chain ends at its first call, marked."""
    answers, ended = run(EndpointSettings(10, max_tokens_per_turn=6), Writes("abcdefgh"), conversation(2))
    assert [a["finish_reason"] for _, a in answers] == ["length", "length"]
    assert answers[1][1]["message"]["content"] == "" and len(ended.calls) == 1
    assert ended.cut == {0}


def test_a_completion_cut_at_the_chains_budget_marks_its_call_and_one_that_ends_does_not():
    cut = run(EndpointSettings(5), Writes("abcdefgh"), conversation(1))[1]
    assert (cut.calls[0].completion_ids, cut.cut) == ([ord(c) for c in "abcde"], {0})
    ended = run(EndpointSettings(20), Writes("abc"), conversation(2, more="x"))[1]
    assert len(ended.calls) == 2 and ended.cut == frozenset()  # ended by the model's stop token, room to spare


def test_a_turns_cap_the_requests_max_tokens_and_max_turns_are_no_end_of_the_chain():
    per_turn = run(EndpointSettings(50, max_tokens_per_turn=3, max_turns=2), Writes("abcdefgh"), conversation(3))
    asked = run(EndpointSettings(50), Writes("abcdefgh"), conversation(2, max_tokens=4))
    for answers, ended in (per_turn, asked):
        assert all(a["finish_reason"] == "length" for _, a in answers) and ended.cut == frozenset()
    assert len(per_turn[1].calls) == 2  # the third request was past max_turns: answered, not marked


def test_the_engines_context_ends_a_chain_by_a_cut_completion_or_a_refused_continuation():
    """The context is the prompt "[Go.]" (5 tokens) + 4: a completion of 8 is cut at 4, marked; one of 2 ends (3
    tokens with the stop) and leaves 1 token of room, so the next request, "[More.]" longer, is a 400
    context_length_exceeded, and the chain ends at the first call, marked."""
    short = EndpointSettings(50, max_context=9)
    cut = run(short, Writes("abcdefgh"), conversation(1))[1]
    assert len(cut.calls[0].completion_ids) == 4 and cut.cut == {0}
    answers, refused = run(short, Writes("ab"), conversation(2))
    assert answers[1][0] == 400 and answers[1][1]["code"] == "context_length_exceeded"
    assert len(refused.calls) == 1 and refused.cut == {0}


def test_per_call_truncates_a_call_whose_own_completion_was_cut_not_one_after_which_a_continuation_was_refused():
    """The refused continuation above ends the merged chain (truncated), but the call's own completion ended on the
    stop token: its per_call row is complete. The completion cut at the context is truncated either way."""
    from hybridflow.agents.trajectory import chains, per_call

    short = EndpointSettings(50, max_context=9)
    refused = run(short, Writes("ab"), conversation(2))[1]
    assert refused.calls[0].cut is False and refused.cut == {0}
    assert chains(refused.calls, refused.cut)[0].truncated and not per_call(refused.calls, refused.cut)[0].truncated
    cut = run(short, Writes("abcdefgh"), conversation(1))[1]
    assert cut.calls[0].cut is True and per_call(cut.calls, cut.cut)[0].truncated


def test_a_fresh_request_after_a_cut_starts_a_chain_of_its_own_unmarked():
    """A chain cut at its budget, then a request that does not continue it (the program starts over): the mark
    stays on the first chain's call, the new chain's call ends unmarked; a fresh prompt too long is refused and
    marks nothing (no chain of it was recorded)."""
    def program(ask: Callable[..., Any]) -> list:
        first = ask({"messages": [{"role": "user", "content": "Go."}]})
        again = ask({"messages": [{"role": "user", "content": "Again."}], "max_tokens": 2})
        huge = ask({"messages": [{"role": "user", "content": "x" * 40}]})
        return [first[0], again[0], huge[0]]

    statuses, ended = run(EndpointSettings(5, max_context=30), Writes(lambda n: "abcdefgh" if n == 0 else "a"),
                          program)
    assert statuses == [200, 200, 400]
    assert [c.extends_previous for c in ended.calls] == [False, False] and ended.cut == {0}


class InProcessPrograms:
    """Programs (hybridflow.agents.protocol) whose run is an `openai` client program run in this process, over the
    endpoint's real Unix socket (the sandboxed runner is tests/agents/test_program_runner.py's)."""

    def __init__(self, turns: int) -> None:
        self.turns = turns

    def run(self, sample: Any, endpoint: Any, timeout: float) -> Any:
        import asyncio

        import openai

        from hybridflow.agents.protocol import ProgramResult

        async def go() -> float:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=endpoint.socket_path)) as http:
                client = openai.AsyncOpenAI(base_url=endpoint.BASE_URL, api_key=endpoint.token, http_client=http,
                                            max_retries=0)
                messages: list[Any] = [{"role": "user", "content": "Go."}]
                for _ in range(self.turns):
                    try:
                        r = await client.chat.completions.create(model="p", messages=messages)
                    except openai.BadRequestError:
                        break
                    messages += [r.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "user", "content": "More."}]
            return 1.0

        return ProgramResult(reward=asyncio.run(go()))

    def close(self) -> None:
        """Nothing outlives a run."""


@pytest.mark.parametrize("trajectory", ["merged", "per_call"])
def test_a_programs_row_that_ran_out_is_truncated_and_one_that_ended_in_budget_is_not(trajectory):
    from hybridflow.agents.loop import EpisodeSettings
    from hybridflow.agents.program_loop import run_program_episodes

    def rows(settings: EpisodeSettings) -> list[bool]:
        (episode,) = run_program_episodes([{}], Writes("abcdefgh"), Codec(), InProcessPrograms(2), settings, 30,
                                          trajectory=trajectory)
        return [e.truncated for e in episode]

    # its continuation was refused: the chain ran out (merged); per_call's row is its call, capped by the turn, not cut
    assert rows(EpisodeSettings(10, max_tokens_per_turn=6))[-1] is (trajectory == "merged")
    assert rows(EpisodeSettings(5))[-1] is True  # a completion cut at the chain's budget: truncated either way
    assert not any(rows(EpisodeSettings(40)))  # both calls ended with the stop token, in budget
    assert not any(rows(EpisodeSettings(40, max_tokens_per_turn=3)))  # a turn's cap is no end of the chain
