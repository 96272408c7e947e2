"""Bring your own agent: a program's `openai.AsyncOpenAI` client against the rollout's endpoint over its Unix socket
(hybridflow.agents.endpoint), driven by hybridflow.agents.program_loop, with a real generation engine (a tiny random
Qwen2 with SmolLM2's tokenizer and chat template, on the HF engine). The programs run in this process
(InProcessPrograms: the sandboxed runner is hybridflow.agents.program's, tested in test_program_runner.py).

The key test: what is trained is the engine's ids, call by call, and text the program rewrites between calls is
never trained as the model's."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import threading
import time
from typing import Any, Awaitable, Callable

import httpx
import openai
import pytest
from support.recording_engine import RecordingEngine, tiny_qwen2_engine

from hybridflow.agents.codec import ObservationCodec
from hybridflow.agents.endpoint import Endpoint, EndpointSettings
from hybridflow.agents.loop import PROGRAM, Episode, EpisodeSettings
from hybridflow.agents.program_loop import run_program_episodes
from hybridflow.agents.protocol import EndpointAddress, ProgramResult

Program = Callable[[openai.AsyncOpenAI, dict[str, Any]], Awaitable[float]]


# -- the pieces: the tokenizer, a tiny engine, programs run in this process ------------------------------------------

@pytest.fixture(scope="module")
def tok(model_cache):
    from transformers import AutoTokenizer

    from hybridflow.api.sources import ModelSource
    from hybridflow.models.builders import materialize

    return AutoTokenizer.from_pretrained(materialize(ModelSource(source="smollm2"), model_cache, 0))


@pytest.fixture(scope="module")
def codec(tok):
    return ObservationCodec(tok, tok.chat_template, [tok.eos_token_id])


@pytest.fixture(scope="module")
def engine(tok, tmp_path_factory):
    return tiny_qwen2_engine(len(tok), tmp_path_factory.mktemp("tiny-qwen2"))


class ScriptedText:
    """loop.Model writing fixed text (the tokenizer's ids of it, then the end-of-turn token), counting its calls."""

    def __init__(self, tok: Any, text: str | Callable[[int], str]) -> None:
        self.tok, self.text, self.calls = tok, text, []

    def generate(self, rows, contexts, max_tokens):
        self.calls.append(list(rows))
        texts = [self.text(r) if callable(self.text) else self.text for r in rows]
        ids = [self.tok.encode(t, add_special_tokens=False) + [self.tok.eos_token_id] for t in texts]
        return [(i[:m], [-0.5] * len(i[:m])) for i, m in zip(ids, max_tokens)]


def client_for(address: EndpointAddress, http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=address.BASE_URL, api_key=address.token, http_client=http, max_retries=0)


def uds(address: EndpointAddress) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=address.socket_path))


class InProcessPrograms:
    """Programs (hybridflow.agents.protocol) running an `async def run(client, sample)` in this process."""

    def __init__(self, program: Program) -> None:
        self.program = program

    def run(self, sample, endpoint, timeout):
        async def go() -> float:
            async with uds(endpoint) as http:
                return await asyncio.wait_for(self.program(client_for(endpoint, http), sample), timeout)

        try:
            return ProgramResult(reward=float(asyncio.run(go())))
        except Exception as err:  # noqa: BLE001 - the program's failure is its result
            return ProgramResult(error=f"{type(err).__name__}: {err}", failure=PROGRAM)

    def close(self) -> None:
        pass


def drive(endpoint: Endpoint, model: Any, program: Callable[[EndpointAddress], Awaitable[Any]],
          row: int = 0) -> tuple[Any, list]:
    """One program against the endpoint, this thread pumping the engine: what it returned, and its calls."""
    address = EndpointAddress(endpoint.socket_path, endpoint.open(row))
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(out=asyncio.run(program(address))))
    thread.start()
    while thread.is_alive():
        endpoint.pump(model, 0.02)
    return box.get("out"), endpoint.close(address.token)


# -- the key test ---------------------------------------------------------------------------------------------------

async def three_turns(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float:
    """Three calls, each sending the conversation so far back; sample["edit"]: the program rewrites the model's
    second answer before its third call."""
    messages = [{"role": "user", "content": sample["prompt"]}]
    for turn in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        content = r.choices[0].message.content or ""
        if sample.get("edit") and turn == 1:
            content += " EDITED BY THE PROGRAM"
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"Go on ({turn})."}]
    return 0.5


def test_the_trained_ids_are_the_engines_ids_call_by_call_and_rewritten_text_is_never_trained(tok, codec, engine):
    recorder = RecordingEngine(engine, tok.eos_token_id)
    samples = [{"prompt": f"Count to {i}.", "edit": i >= 2} for i in range(4)]
    episodes = run_program_episodes(samples, recorder, codec, InProcessPrograms(three_turns),
                                    EpisodeSettings(200, max_turns=4, concurrent=4), timeout=60)
    calls = recorder.rows()
    assert len(recorder.calls) < len(calls) == 12  # the episodes' requests shared engine calls
    for i, rows in enumerate(episodes):
        e = rows[0]
        assert all(r.error is None and r.env_reward == 0.5 for r in rows) and sum(r.turns for r in rows) == 3
        contexts = [c for r, c, _ in calls if r == i]
        outs = [t for r, _, t in calls if r == i]
        trained = [[t for t, m in zip(r.tokens, r.loss_mask) if m] for r in rows]
        if not samples[i]["edit"]:
            assert len(rows) == 1 and e.trajectory_breaks == 0 and e.prompt_ids == contexts[0]
            for context, out in zip(contexts, outs):  # each call: the context it read, then the ids it wrote
                k = len(context) - len(e.prompt_ids)
                assert e.prompt_ids + e.tokens[:k] == context
                assert e.tokens[k:k + len(out)] == out and e.loss_mask[k:k + len(out)] == [1] * len(out)
            assert trained == [[t for out in outs for t in out]]  # exactly the engine's ids, nothing else
            assert e.turn_rewards == [(max(j for j, m in enumerate(e.loss_mask) if m), 0.5)]
        else:
            # the third call's messages hold a rewritten answer: it does not continue, so it starts a second
            # sequence (merged: each chain is a row, both trained), and the rewritten text is in its (untrained)
            # prompt, never among the model's tokens
            (first, last), breaks = rows, sum(r.trajectory_breaks for r in rows)
            assert breaks == 1 and first.prompt_ids == contexts[0] and last.prompt_ids == contexts[2]
            assert trained == [outs[0] + outs[1], outs[2]] and last.tokens == outs[2]
            assert (first.turns, last.turns) == (2, 1)
            assert "EDITED BY THE PROGRAM" in tok.decode(last.prompt_ids)
            assert not any("EDITED" in tok.decode(t) for t in trained)
            for r in rows:  # the episode's reward on each row's last model token
                assert r.turn_rewards == [(max(j for j, m in enumerate(r.loss_mask) if m), 0.5)]


def test_log_probs_are_the_engines(tok, codec, engine):
    """The trained log-probs are the engine's for the model's tokens and 0 for the tokens between calls."""
    seen: list[tuple[list[int], list[float]]] = []

    class Keep(RecordingEngine):
        def generate(self, rows, contexts, max_tokens):
            out = super().generate(rows, contexts, max_tokens)
            seen.extend(out)
            return out

    ((e,),) = run_program_episodes([{"prompt": "Hi.", "edit": False}], Keep(engine, tok.eos_token_id), codec,
                                InProcessPrograms(three_turns), EpisodeSettings(200, concurrent=1), timeout=60)
    assert [lp for lp, m in zip(e.log_probs, e.loss_mask) if m] == [lp for _, lps in seen for lp in lps]
    assert all(lp == 0.0 for lp, m in zip(e.log_probs, e.loss_mask) if not m)


# -- the endpoint ---------------------------------------------------------------------------------------------------

def test_concurrent_episodes_share_engine_calls(tok, codec):
    model = ScriptedText(tok, "ok")
    barrier = threading.Barrier(4)

    async def together(client, sample):
        messages = [{"role": "user", "content": "go"}]
        for _ in range(3):
            await asyncio.to_thread(barrier.wait)  # the four episodes ask at the same time
            r = await client.chat.completions.create(model="policy", messages=messages)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        return 1.0

    endpoint = Endpoint(codec, EndpointSettings(100, gather_seconds=0.5))
    try:
        programs = InProcessPrograms(together)
        results: list[ProgramResult] = []
        threads = [threading.Thread(target=lambda i=i: results.append(programs.run(
            {}, EndpointAddress(endpoint.socket_path, endpoint.open(i)), 30))) for i in range(4)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            endpoint.pump(model, 0.02)
    finally:
        endpoint.stop()
    assert [r.error for r in results] == [None] * 4
    assert len(model.calls) == 3 and all(sorted(rows) == [0, 1, 2, 3] for rows in model.calls)
    assert not os.path.exists(endpoint.socket_path)  # the socket and its directory go with the endpoint


def test_tool_calls_are_parsed_and_the_tools_answer_continues_the_chain(tok, codec):
    model = ScriptedText(tok, lambda row: 'Let me look. <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}'
                                          '</tool_call>')

    async def program(address):
        async with uds(address) as http:
            client = client_for(address, http)
            messages = [{"role": "user", "content": "Weather in Oslo?"}]
            tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
            r = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
            m = r.choices[0].message
            messages += [m.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "Sunny, 21 C"}]
            await client.chat.completions.create(model="policy", messages=messages, tools=tools)
            return r

    with Endpoint(codec, EndpointSettings(200)) as endpoint:
        r, calls = drive(endpoint, model, program)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "weather",
                                                                                   {"city": "Oslo"})
    assert r.usage.prompt_tokens == len(calls[0].prompt_ids) and r.usage.completion_tokens == len(
        calls[0].completion_ids)
    assert [c.extends_previous for c in calls] == [False, True]
    between = calls[1].prompt_ids[len(calls[0].prompt_ids) + len(calls[0].completion_ids):]
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in tok.decode(between)


def test_tokens_are_per_episode_and_bad_requests_get_openais_errors(tok, codec):
    model = ScriptedText(tok, "hello")
    with Endpoint(codec, EndpointSettings(200)) as endpoint:
        async def program(address):
            async with uds(address) as http:
                ok = client_for(address, http)
                wrong = client_for(EndpointAddress(address.socket_path, "not-a-token"), http)
                with pytest.raises(openai.AuthenticationError):
                    await wrong.models.list()
                assert (await ok.models.list()).data[0].id == "policy"
                with pytest.raises(openai.BadRequestError, match="stream"):
                    await ok.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}],
                                                     stream=True)
                with pytest.raises(openai.BadRequestError, match="n must be 1"):
                    await ok.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], n=2)
                auth = {"Authorization": f"Bearer {address.token}"}
                bad = await http.post("http://x/v1/chat/completions", content=b"{not json", headers=auth)
                empty = await http.post("http://x/v1/chat/completions", json={"model": "p"}, headers=auth)
                r = await ok.completions.create(model="p", prompt="Once upon a time")
                again = await ok.completions.create(model="p", prompt="Once upon a time" + r.choices[0].text + " then")
                return bad, empty, r, again

        (bad, empty, r, again), calls = drive(endpoint, model, program)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert "not valid JSON" in bad.json()["error"]["message"]
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
        assert r.choices[0].text == "hello" and r.choices[0].finish_reason == "stop"
        assert [c.extends_previous for c in calls] == [False, True]  # the completion continued its prompt
        assert calls[1].prompt_ids[: len(calls[0].prompt_ids) + len(calls[0].completion_ids)] == (
            calls[0].prompt_ids + calls[0].completion_ids)

        async def closed(address):
            async with uds(address) as http:
                with pytest.raises(openai.AuthenticationError):
                    await client_for(address, http).chat.completions.create(
                        model="p", messages=[{"role": "user", "content": "x"}])

        token = endpoint.open(5)
        endpoint.close(token)  # its program ended: the token is refused from now on
        asyncio.run(closed(EndpointAddress(endpoint.socket_path, token)))
        mode = os.stat(endpoint.socket_path).st_mode
        assert stat.S_ISSOCK(mode) and mode & 0o002  # the sandbox's uid can connect; the token is the auth
        assert stat.S_IMODE(os.stat(os.path.dirname(endpoint.socket_path)).st_mode) == 0o711
        # no TCP port unless the rollout's programs run in the sandbox pool (test_program_pool.py)
        assert endpoint.url is None and [s.socket.family for s in endpoint._servers.servers] == [socket.AF_UNIX]


def test_a_spent_budget_answers_an_empty_completion_cut_by_length(tok, codec):
    model = ScriptedText(tok, "one two three four five six seven eight")

    async def program(address):
        async with uds(address) as http:
            client = client_for(address, http)
            messages = [{"role": "user", "content": "Talk."}]
            first = await client.chat.completions.create(model="p", messages=messages, max_tokens=50)
            messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
            return first, await client.chat.completions.create(model="p", messages=messages)

    with Endpoint(codec, EndpointSettings(10, max_tokens_per_turn=6)) as endpoint:
        (first, second), calls = drive(endpoint, model, program)
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 6  # the per-turn cap
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.content == ""
    assert second.usage.completion_tokens == 0 and len(calls) == 1 and len(model.calls) == 1  # no engine call


def test_a_program_that_fails_or_never_calls_the_model_is_a_failed_episode(tok, codec):
    async def boom(client, sample):
        raise ZeroDivisionError("the program's bug")

    async def silent(client, sample):
        return 1.0

    episodes = run_program_episodes([{}, {}], ScriptedText(tok, "x"), codec, InProcessPrograms(boom),
                                    EpisodeSettings(50), timeout=10)
    assert all(e.failure == PROGRAM and "ZeroDivisionError" in e.error for (e,) in episodes)
    ((e,),) = run_program_episodes([{}], ScriptedText(tok, "x"), codec, InProcessPrograms(silent), EpisodeSettings(50),
                                timeout=10)
    assert e.failure == PROGRAM and "no call to the model" in e.error


# -- the rollout's episode runner -------------------------------------------------------------------------------------

def test_the_rollout_packs_a_programs_episodes_with_its_own_prompt_and_the_engines_ids(tok, codec, engine, tmp_path):
    """EpisodeRunner with spec.rollout.agent.program: each row's prompt is the program's first call's (its excess
    over maxPromptLength opens the response, untrained), the trained positions are the engine's ids, and the
    breaks are a column."""
    from hybridflow.agents.protocol import Places
    from hybridflow.api.agents import Agent
    from hybridflow.engines.rollout.base import SamplingConfig
    from hybridflow.roles.episodes import EpisodeRunner

    seen: list[tuple[list[int], list[int]]] = []  # (context, ids) of every engine answer

    class Recording:
        def generate(self, prompts, cfgs):
            out = engine.generate(prompts, cfgs)
            seen.extend((list(p), list(g.tokens)) for p, g in zip(prompts, out))
            return out

    program = tmp_path / "agent.py"
    program.write_text("async def run(client, sample):\n    return 1.0\n")
    agent = Agent(program=str(program), max_turns=4)
    given: list[Any] = []  # the prompts the programs read

    async def recorded(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float:
        given.append(sample["prompt"])
        return await three_turns(client, sample)

    runner = EpisodeRunner(agent, codec, Places(programs=InProcessPrograms(recorded)), 120)
    batch = {"prompt_ids": [[28, 29, 30], [31, 32, 33]], "truth": ["a", "b"], "data_source": ["d"] * 2,
             "extra_info": [{}] * 2, "raw_prompt": ["Count to three.", None]}
    sampling = lambda greedy, lp, n: SamplingConfig(n, 1.0, 1.0, greedy, (tok.eos_token_id,), lp)  # noqa: E731
    P = 16  # shorter than the template's rendering of the program's first prompt
    packed = runner.run(Recording(), sampling, batch, [False, False], True, P)
    assert packed["agent_trajectory_breaks"].tolist() == [0.0, 0.0] and packed["agent_turns"].tolist() == [3.0, 3.0]
    assert packed["agent_failed"].tolist() == [0.0, 0.0] and packed["env_reward"].tolist() == [0.5, 0.5]
    # the prompt as the data gave it (a row without one: its ids decoded), rendered by the program in its calls
    assert sorted(given) == sorted(["Count to three.", codec.decode([31, 32, 33])])
    firsts = [c for c, _ in seen if not any(c[: len(o)] == o and len(o) < len(c) for o, _ in seen)]
    for i in range(2):
        resp, mask = packed["responses"][i].tolist(), packed["response_mask"][i].tolist()
        row = packed["prompts"][i].tolist() + resp[: int(packed["attention_mask"][i, P:].sum())]
        first = next(c for c in firsts if row[: len(c)] == c)  # the row is its first call's prompt, then the rest
        assert len(first) > P and packed["prompts"][i].tolist() == first[:P] and mask[: len(first) - P] == [0] * (
            len(first) - P)  # the excess opens the response, untrained
        mine = [(c, o) for c, o in seen if row[: len(c)] == c]
        assert len(mine) == 3 and [t for t, m in zip(resp, mask) if m] == [t for _, o in mine for t in o]
        for c, o in mine:  # each engine answer sits right after the context it read, mask 1
            assert row[len(c): len(c) + len(o)] == o and mask[len(c) - P: len(c) - P + len(o)] == [1] * len(o)
        assert packed["rollout_log_probs"][i][~packed["response_mask"][i].bool()].abs().sum() == 0


def test_a_faithful_conversation_reads_as_the_chat_template_renders_it(tok, codec):
    """Where the model's text tokenizes back to its own ids, the captured context of a continuing call is exactly
    the template's rendering of the conversation: the model reads what it was trained to read."""
    model = ScriptedText(tok, "The answer is 4.")

    async def program(address):
        async with uds(address) as http:
            client = client_for(address, http)
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
            r = await client.chat.completions.create(model="p", messages=messages)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
            await client.chat.completions.create(model="p", messages=messages)
            return messages

    with Endpoint(codec, EndpointSettings(200)) as endpoint:
        messages, calls = drive(endpoint, model, program)
    assert [c.extends_previous for c in calls] == [False, True]
    shown = [{"role": m["role"], "content": m["content"]} for m in messages]
    rendered = tok.apply_chat_template(shown, add_generation_prompt=True, tokenize=False)
    assert calls[1].prompt_ids == tok(rendered, add_special_tokens=False)["input_ids"]


# -- what the engine would refuse, connections, closing ---------------------------------------------------------------

CHAT = {"model": "p", "messages": [{"role": "user", "content": "hi"}]}


def send(endpoint: Endpoint, token: str, body: Any = CHAT, path: str = "/v1/chat/completions") -> tuple[
        threading.Thread, dict[str, Any]]:
    """One request on a thread of its own: the thread, and the box its response lands in."""
    box: dict[str, Any] = {}

    def go() -> None:
        with httpx.Client(transport=httpx.HTTPTransport(uds=endpoint.socket_path), timeout=10) as http:
            box["r"] = http.post(f"http://x{path}", json=body, headers={"Authorization": f"Bearer {token}"})

    thread = threading.Thread(target=go)
    thread.start()
    return thread, box


def ask(endpoint: Endpoint, model: Any, token: str, body: Any = CHAT, path: str = "/v1/chat/completions") -> Any:
    thread, box = send(endpoint, token, body, path)
    while thread.is_alive():
        endpoint.pump(model, 0.02)
    return box["r"]


def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def raw(path: str, data: bytes, seconds: float = 3.0) -> bytes:
    """What the endpoint answers `data` sent on a connection of its own, until it closes it (or `seconds`)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(seconds)
        s.connect(path)
        out = b""
        try:  # a connection past the cap is answered and closed as it connects: maybe before `data` is sent
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def test_a_prompt_the_engine_would_refuse_is_a_400_and_never_reaches_it(tok, codec):
    """The engine refuses a prompt that fills its context and unknown ids, and its error would fail the rollout:
    the endpoint refuses them first, and caps each completion within the context."""
    model = ScriptedText(tok, " ".join(["word"] * 30))
    with Endpoint(codec, EndpointSettings(200, max_context=40)) as endpoint:
        token = endpoint.open(0)
        long_chat = ask(endpoint, model, token, {**CHAT, "messages": [{"role": "user", "content": "word " * 60}]})
        long_ids = ask(endpoint, model, token, {"model": "p", "prompt": [28] * 40}, "/v1/completions")
        unknown = ask(endpoint, model, token, {"model": "p", "prompt": [28, len(tok)]}, "/v1/completions")
        negative = ask(endpoint, model, token, {"model": "p", "prompt": [28, -1]}, "/v1/completions")
        huge = ask(endpoint, model, token, {**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]})
        assert model.calls == []  # none reached the engine
        capped = ask(endpoint, model, token, {"model": "p", "prompt": [28] * 35, "max_tokens": 50}, "/v1/completions")
        calls = endpoint.close(token)
    for r, param in ((long_chat, "messages"), (long_ids, "prompt"), (huge, "messages")):
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == param, error
        assert "40 tokens" in error["message"]
    assert "the prompt is 40 tokens" in long_ids.json()["error"]["message"]
    assert unknown.status_code == 400 and "vocabulary" in unknown.json()["error"]["message"]
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "prompt"
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 5  # 40 - 35
    assert len(calls) == 1 and len(calls[0].completion_ids) == 5 and len(model.calls) == 1


def test_a_row_that_would_hold_no_trained_token_is_a_failed_episode():
    from hybridflow.roles.episodes import fit_prompt

    e = Episode(tokens=[10, 11], loss_mask=[1, 1], log_probs=[-0.1, -0.2], env_reward=1.0, turn_rewards=[(1, 1.0)])
    prompt, fitted = fit_prompt(list(range(10)), e, 3, 5)  # 7 tokens of excess fill the response's 5
    assert prompt == [0, 1, 2] and fitted.failure == PROGRAM and "prompt is 10 tokens" in fitted.error
    assert fitted.turn_rewards == [] and fitted.env_reward == 0.0  # no reward on a masked position
    prompt, fitted = fit_prompt(list(range(6)), e, 3, 5)  # within the endpoint's context, 3 + 5: it fits
    assert fitted.error is None and fitted.loss_mask == [0, 0, 0, 1, 1] and fitted.turn_rewards == [(4, 1.0)]


def test_the_rollout_gives_the_endpoint_the_engines_context(codec, monkeypatch, tmp_path):
    import hybridflow.roles.episodes as episodes
    from hybridflow.agents.protocol import Listen, Places
    from hybridflow.api.agents import Agent

    seen: dict[str, Any] = {}

    def fake(samples, model, codec, programs, settings, timeout, max_context=None, trajectory="merged", listen=None):
        seen["max_context"], seen["listen"] = max_context, listen
        return [[Episode(tokens=[5], loss_mask=[1], log_probs=[0.0])] for _ in samples]

    monkeypatch.setattr(episodes, "run_program_episodes", fake)
    program = tmp_path / "agent.py"
    program.write_text("async def run(client, sample):\n    return 1.0\n")
    runner = episodes.EpisodeRunner(Agent(program=str(program)), codec, Places(programs=InProcessPrograms(None)), 120)
    batch = {"prompt_ids": [[28, 29]], "truth": ["a"], "data_source": ["d"], "extra_info": [{}]}
    runner.run(None, lambda *a: None, batch, [False], False, 16)
    assert seen["max_context"] == 16 + 120  # maxPromptLength + maxResponseLength: vLLM's max_model_len
    assert seen["listen"] is None  # the places' (programs on this machine: the endpoint's socket alone)
    pool = Places(programs=InProcessPrograms(None), listen=Listen("10.0.0.7", (8400, 8463)))  # programs in the pool
    episodes.EpisodeRunner(Agent(program=str(program)), codec, pool, 120).run(None, lambda *a: None, batch, [False],
                                                                              False, 16)
    assert seen["listen"] == Listen("10.0.0.7", (8400, 8463))


def test_a_request_without_a_token_is_refused_before_its_body_and_a_body_has_a_deadline(codec, monkeypatch):
    import hybridflow.agents.endpoint as module

    monkeypatch.setattr(module, "BODY_SECONDS", 0.5)
    with Endpoint(codec, EndpointSettings(200)) as endpoint:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
        # no token: 401 at once, the 1 MB body never read, the connection closed
        assert raw(endpoint.socket_path, head % (1 << 20) + b"\r\n").startswith(b"HTTP/1.1 401")
        auth = b"Authorization: Bearer %s\r\n\r\n" % endpoint.open(0).encode()
        assert raw(endpoint.socket_path, head % (module.MAX_BODY + 1) + auth).startswith(b"HTTP/1.1 413")
        with socket.socket(socket.AF_UNIX) as s:  # a body that trickles in: 408 at its deadline, not per byte
            s.settimeout(3)
            s.connect(endpoint.socket_path)
            s.sendall(head % 100 + auth)
            start, answer = time.monotonic(), b""
            while not answer and time.monotonic() - start < 3:
                with contextlib.suppress(BrokenPipeError):  # it answered and closed since the last byte: read it
                    s.sendall(b" ")
                s.settimeout(0.1)
                with contextlib.suppress(TimeoutError):
                    answer = s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 2


def test_connections_past_the_cap_are_refused_at_once(codec):
    with Endpoint(codec, EndpointSettings(200, max_connections=2)) as endpoint:
        token = endpoint.open(0).encode()
        held = [socket.socket(socket.AF_UNIX) for _ in range(2)]
        for s in held:
            s.connect(endpoint.socket_path)
        assert raw(endpoint.socket_path, b"").startswith(b"HTTP/1.1 503")  # answered as it connects
        held.pop().close()  # a slot comes free when its connection ends
        get = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer %s\r\n\r\n" % token
        until(lambda: raw(endpoint.socket_path, get).startswith(b"HTTP/1.1 200"))
        held[0].close()


def test_a_spent_or_closed_episode_is_answered_before_anything_is_rendered(tok, codec):
    rendered: list[int] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(codec, name)

        def prompt_ids(self, *args):
            rendered.append(1)
            return codec.prompt_ids(*args)

    model = ScriptedText(tok, "ok")
    with Endpoint(Counting(), EndpointSettings(200, max_turns=1)) as endpoint:  # type: ignore[arg-type]
        token = endpoint.open(0)
        assert ask(endpoint, model, token).status_code == 200
        spent = ask(endpoint, model, token, {**CHAT, "messages": [{"role": "user", "content": "again"}]})
    assert spent.json()["choices"][0]["finish_reason"] == "length" and len(rendered) == 1 and len(model.calls) == 1


def test_the_engine_failing_answers_503_then_raises(tok, codec):
    class Failing:
        def generate(self, rows, contexts, max_tokens):
            raise RuntimeError("out of memory")

    with Endpoint(codec, EndpointSettings(200, gather_seconds=0.2)) as endpoint:
        sent = [send(endpoint, endpoint.open(i)) for i in range(2)]
        until(lambda: endpoint._queue.qsize() == 2)
        with pytest.raises(RuntimeError, match="out of memory"):
            endpoint.pump(Failing(), 1)
        for thread, box in sent:
            thread.join(5)
            assert box["r"].status_code == 503 and "the engine failed: RuntimeError" in box["r"].text


def test_stop_answers_the_requests_still_waiting(codec):
    endpoint = Endpoint(codec, EndpointSettings(200))
    thread, box = send(endpoint, endpoint.open(0))
    until(lambda: endpoint._queue.qsize() == 1)
    endpoint.stop()
    thread.join(5)
    assert not thread.is_alive() and box["r"].status_code == 503 and "stopped" in box["r"].text


def test_an_episodes_calls_are_its_own_and_a_closed_episodes_request_is_dropped(tok, codec):
    model = ScriptedText(tok, "ok")
    with Endpoint(codec, EndpointSettings(200)) as endpoint:
        mine, other = endpoint.open(0), endpoint.open(1)
        assert ask(endpoint, model, mine).status_code == 200
        assert model.calls == [[0]] and endpoint.close(other) == [] and len(endpoint.close(mine)) == 1
        late = endpoint.open(2)  # its program ran out of time while its request waited for the engine
        thread, box = send(endpoint, late)
        until(lambda: endpoint._queue.qsize() == 1)
        assert endpoint.close(late) == []
        assert endpoint.pump(model, 0.5) == 0 and model.calls == [[0]]  # dropped: no engine call for it
        thread.join(5)
        assert box["r"].status_code == 503


def test_a_program_gone_before_its_answer_leaves_no_traceback(tok, codec, capfd, caplog):
    model = ScriptedText(tok, "ok")
    with Endpoint(codec, EndpointSettings(200)) as endpoint:
        body = json.dumps(CHAT).encode()
        s = socket.socket(socket.AF_UNIX)
        s.connect(endpoint.socket_path)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                  % (endpoint.open(0).encode(), len(body), body))
        until(lambda: endpoint._queue.qsize() == 1)
        s.close()  # the program went (killed at its timeout)
        assert endpoint.pump(model, 0.5) == 1
        time.sleep(0.3)  # the handler writes its answer to nobody
    assert "Traceback" not in capfd.readouterr().err and not [r for r in caplog.records if r.levelname == "ERROR"]


def test_close_and_a_call_being_recorded_are_ordered(tok, codec):
    """A call that finishes as its episode closes is either in the calls close() returns or never recorded."""
    entered = threading.Event()

    class Slow(list):
        def append(self, item):
            entered.set()
            time.sleep(0.3)
            super().append(item)

    model = ScriptedText(tok, "ok")
    with Endpoint(codec, EndpointSettings(200)) as endpoint:
        token = endpoint.open(0)
        e = endpoint._episodes[token]
        e.calls = Slow()
        thread, box = send(endpoint, token)
        while not entered.is_set():
            endpoint.pump(model, 0.02)
        calls = endpoint.close(token)
        thread.join(5)
    assert box["r"].status_code == 200 and calls == list(e.calls) and len(calls) == 1
