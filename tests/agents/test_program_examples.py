"""examples/agents/openai_calculator.py, the README's agent program, run as a job runs it: in its sandbox
(LocalPrograms) against the job's real endpoint (hybridflow.agents.endpoint) over SmolLM2's tokenizer, the model
scripted: it calls the calculator, reads its answer, answers. The program's reward comes back, and its two calls are
one chain (the second continues the first). Also the second example's shape (plan_then_answer: two calls, one
chain)."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from hybridflow.agents.codec import ObservationCodec
from hybridflow.agents.endpoint import Endpoint, EndpointSettings
from hybridflow.agents.program import LocalPrograms
from hybridflow.agents.protocol import EndpointAddress, ProgramResult
from support.paths import ROOT

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 45"}}</tool_call>'
SAMPLE = {"prompt": "What is 123 * 45?", "ground_truth": 5535, "data_source": "products", "extra_info": {}}


@pytest.fixture(scope="module")
def codec(model_cache: Path) -> ObservationCodec:
    from transformers import AutoTokenizer

    from hybridflow.api.sources import ModelSource
    from hybridflow.models.builders import materialize

    tok = AutoTokenizer.from_pretrained(materialize(ModelSource(source="smollm2"), model_cache, 0))
    return ObservationCodec(tok, tok.chat_template, [tok.eos_token_id])


class ScriptedModel:
    """loop.Model writing texts[i] at its i-th call (the last one after), then the end-of-turn token."""

    def __init__(self, codec: ObservationCodec, texts: list[str]) -> None:
        self.tok, self.texts, self.n = codec.tokenizer, texts, 0

    def generate(self, rows: Any, contexts: Any, max_tokens: Any) -> list[tuple[list[int], list[float]]]:
        out = []
        for m in max_tokens:
            ids = self.tok.encode(self.texts[min(self.n, len(self.texts) - 1)], add_special_tokens=False)
            ids = (ids + [self.tok.eos_token_id])[:m]
            self.n += 1
            out.append((ids, [-0.5] * len(ids)))
        return out


def run_example(codec: ObservationCodec, example: str, texts: list[str], sample: dict) -> tuple[ProgramResult, Any]:
    programs = LocalPrograms(ROOT / "examples" / "agents" / example)
    with Endpoint(codec, EndpointSettings(200)) as endpoint:
        token, box = endpoint.open(0), {}
        address = EndpointAddress(endpoint.socket_path, token)
        thread = threading.Thread(target=lambda: box.update(result=programs.run(sample, address, 120)))
        thread.start()
        model = ScriptedModel(codec, texts)
        while thread.is_alive():
            endpoint.pump(model, 0.02)
        return box["result"], endpoint.close(token)


def test_the_calculator_program_calls_its_tool_and_is_scored(codec: ObservationCodec) -> None:
    result, calls = run_example(codec, "openai_calculator.py", [CALL, "The answer is 5535."], SAMPLE)
    assert result == ProgramResult(reward=1.0, metrics={"tool_calls": 1.0})
    assert [c.extends_previous for c in calls] == [False, True]
    wrong, _ = run_example(codec, "openai_calculator.py", ["5536"], SAMPLE)  # no tool call, a wrong answer
    assert wrong == ProgramResult(reward=0.0, metrics={"tool_calls": 0.0})


def test_plan_then_answer_is_one_chain(codec: ObservationCodec) -> None:
    result, calls = run_example(codec, "plan_then_answer.py", ["Multiply.", "5535"], SAMPLE | {"ground_truth": "5535"})
    assert result == ProgramResult(reward=1.0, metrics={"plan_chars": 9.0, "answer_only": 1.0})
    assert [c.extends_previous for c in calls] == [False, True]
