"""A generative judge with a real engine: SmolLM2-135M generating in this process (the HF engine: the judge role's
vLLM is exercised through Ray by tests/trainer/test_end_to_end.py's judge example, and an in-process vLLM would
leave torch.distributed up for the tests after), asked through the controller's Judge and the job's Reward, which
sums it with a rule and a user's sandboxed function."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hybridflow.api import parse_job
from hybridflow.data.packing import pack_rollout
from hybridflow.rewards.judge import Judge
from hybridflow.rewards.rules import get_rule
from hybridflow.rewards.text import RewardFailure, TextReward
from hybridflow.rewards.verdicts import agreement
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.task import JobJudge, Reward
from support.paths import ROOT

EXTRACT = ("Here is a student's solution:\n\n{response}\n\nWhat is the student's final answer? Reply with the number "
           "only.")
FUNCTION = ROOT / "examples" / "rewards" / "arithmetic_reward.py"


@pytest.fixture(scope="module")
def smollm2(model_cache):
    from transformers import AutoTokenizer

    from hybridflow.api.sources import ModelSource
    from hybridflow.engines.rollout.base import SamplingConfig
    from hybridflow.engines.rollout.hf import HFRollout
    from hybridflow.models.builders import materialize

    directory = materialize(ModelSource(source="smollm2"), model_cache, 0)
    tok = AutoTokenizer.from_pretrained(directory)
    engine = HFRollout(directory, "float32", torch.device("cpu"), 0)
    greedy = SamplingConfig(12, greedy=True, stop_token_ids=(tok.eos_token_id,))
    asked: list[int] = []  # how many requests each engine call held

    def generate(ids: list[list[int]]) -> list[list[int]]:
        asked.append(len(ids))
        return [g.tokens for g in engine.generate(ids, [greedy] * len(ids))]

    return directory, tok, generate, asked


def answers(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str], list[float]]:
    """Questions, worked answers (every other one wrong) and the reference sums; 1.0 where the answer is right."""
    rnd = random.Random(seed)
    qs, rs, ts, right = [], [], [], []
    for i in range(n):
        a, b = rnd.randint(2, 60), rnd.randint(2, 60)
        said = a + b if i % 2 == 0 else a + b + rnd.choice([-3, -1, 1, 2, 10])
        qs.append(f"What is {a} + {b}?")
        rs.append(f"{a} + {b} = {said}. The answer is {said}.")
        ts.append(str(a + b))
        right.append(float(i % 2 == 0))
    return qs, rs, ts, right


def judge_spec(**fields):
    job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "j"},
                     "spec": {"models": {"actor": {"source": "smollm2"}, "reward": {
                         "weights": {"rule": 0.2, "function": 0.3, "judge": 0.5},
                         "function": {"path": str(FUNCTION)},
                         "judge": {"model": {"source": "smollm2"}, "template": EXTRACT, "parser": "matches",
                                   **fields}}}, "data": {"task": "arithmetic"}}})
    return job.spec.models.reward


def test_the_judge_reads_answers_batched_and_asks_each_response_once(smollm2):
    _, tok, generate, asked = smollm2
    judge = Judge(judge_spec().judge, tok, error_score=0.0)
    qs, rs, ts, right = answers(16)
    asked.clear()
    call = judge.score(generate, qs + qs[:4], rs + rs[:4], ts + ts[:4])  # a group's repeats: asked once
    assert asked == [16] and call.requests == 16 and not call.result.errors
    assert agreement(call.result.scores[:16], right) >= 0.9  # measured: 1.0
    assert call.result.scores[16:] == call.result.scores[:4]
    more_q, more_r, more_t, _ = answers(2, seed=1)
    again = judge.score(generate, qs + more_q, rs + more_r, ts + more_t)
    assert asked == [16, 2] and again.cache_hits == 16 and again.requests == 2
    assert again.result.scores[:16] == call.result.scores[:16]
    stats = again.stats()
    assert stats["judge_tokens_per_s"] > 0 and stats["judge_requests"] == 2


def test_the_default_question_gets_a_yes_or_no_from_smollm2(smollm2):
    """SmolLM2-135M answers the default template with a parseable verdict (it says "No." to nearly everything:
    too small to grade, which is why the example asks it to read the answer out instead)."""
    _, tok, generate, _ = smollm2
    call = Judge(_default(), tok, 0.0).score(generate, *answers(4)[:3])
    assert call.parse_failures == 0 and all(s in (0.0, 1.0) for s in call.result.scores)


def _default():
    from hybridflow.api.sources import JudgeSpec, ModelSource

    return JudgeSpec(model=ModelSource(source="smollm2"))


def _batch(tok, qs: list[str], rs: list[str], ts: list[str]) -> Batch:
    prompts = [tok.encode(q) for q in qs]
    responses = [tok.encode(r) for r in rs]
    packed = pack_rollout(prompts, responses, 32, 32)
    return Batch(packed, {"truth": [int(t) for t in ts], "data_source": ["arithmetic"] * len(qs),
                          "extra_info": [{} for _ in qs], "raw_prompt": qs})


def test_a_combined_reward_sums_a_rule_a_sandboxed_function_and_the_judge(smollm2):
    directory, tok, generate, _ = smollm2
    spec = judge_spec()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    function = TextReward(spec, "function")
    reward = Reward(get_rule("arithmetic_exact"), {"function": function}, decode,
                    judge=JobJudge(Judge(spec.judge, tok, spec.error_score), Path(directory), [tok.eos_token_id]),
                    weights=spec.parts(), error_policy=spec)
    try:
        qs, rs, ts, right = answers(8)
        rs[1] = "I don't know."  # no number: the function's 0 (its `answered` metric 0)
        batch = _batch(tok, qs, rs, ts)
        scores, stats = reward.score(batch, ask=generate)
        rule = torch.tensor([get_rule("arithmetic_exact")([], tok.encode(r), int(t), decode) for r, t in zip(rs, ts)])
        fn = torch.tensor(function.score(["arithmetic"] * 8, rs, ts, [{}] * 8).scores)
        judged = Judge(spec.judge, tok, spec.error_score).score(generate, qs, rs, ts).result.scores
        assert torch.allclose(scores, 0.2 * rule + 0.3 * fn + 0.5 * torch.tensor(judged))
        assert stats["reward_errors"] == stats["judge_parse_failures"]  # the function failed on none
        assert stats["judge_rule_agreement"] == agreement(judged, rule.tolist()) >= 0.8
        assert stats["reward_answered_mean"] == 7 / 8  # the function's own metric still reaches the log
        with pytest.raises(RuntimeError, match="judge role was not given"):
            reward.score(batch)
        tight = judge_spec(maxPromptLength=20)  # every question too long for the judge: past maxErrorFraction
        strict = Reward(None, {}, decode, judge=JobJudge(Judge(tight.judge, tok, 0.0), Path(directory), []),
                        weights={"judge": 1.0}, error_policy=tight)
        with pytest.raises(RewardFailure, match=r"reward judge: 8 of 8 samples failed.*maxPromptLength = 20"):
            strict.score(batch, ask=generate)
    finally:
        reward.close()
