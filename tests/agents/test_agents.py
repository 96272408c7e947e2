"""Multi-turn rollouts without Ray: tool-call parsing, observations as the chat template renders them, every
advantage estimator and policy loss over masked multi-turn rows, the episode loop's scheduling, and token in /
token out with a real generation engine and real sandboxed tools."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hybridflow.agents.codec import ObservationCodec
from hybridflow.agents.local import EnvironmentCode, LocalSessions, LocalTools
from hybridflow.agents.loop import EpisodeSettings, run_episodes
from hybridflow.agents.protocol import SessionLost
from hybridflow.agents.registry import ENVIRONMENTS, TOOLS
from hybridflow.agents.tool_file import ToolFileError, read_tools_file
from hybridflow.agents.toolcalls import parse_tool_calls, plain_tools_text
from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from hybridflow.algorithms.core import token_rewards
from hybridflow.roles.episodes import placed_rewards
from hybridflow.algorithms.losses import LOSS_AGGREGATIONS, POLICY_LOSSES, ClipConfig
from support.agent_doubles import CharCodec, ScriptedPolicyDouble
from support.paths import ROOT

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


# -- parsing --------------------------------------------------------------------------------------------------------

def test_tool_calls_are_read_from_the_standard_form_and_bad_ones_say_why():
    calls = parse_tool_calls('Let me see. ' + CALL % "2*3" + ' and <tool_call>{"name": "python", "arguments": '
                             '"{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, None), ("python", {"code": "print(1)"}, None)]
    bad = parse_tool_calls('<tool_call>{"name": calc</tool_call><tool_call>[1]</tool_call>'
                           '<tool_call>{"name": "x", "arguments": 3}</tool_call>')
    assert "not valid JSON" in bad[0].error and '"name"' in bad[1].error and "object" in bad[2].error
    assert parse_tool_calls("no call here, <tool_call> unclosed") == []
    assert len(parse_tool_calls((CALL % "1") * 20)) == 8  # a turn's calls are capped


def test_a_users_tools_file_becomes_schemas_without_running_it(tmp_path):
    f = tmp_path / "tools.py"
    f.write_text('import os\nos.system("touch ran")\n\ndef lookup(city: str, days: int = 1):\n    """Weather for a '
                 'city.\n\n    More text."""\n    return city\n\ndef _hidden(x):\n    "no"\n\ndef nodoc(x):\n    pass\n')
    tools = read_tools_file(f)
    assert list(tools) == ["lookup"]
    t = tools["lookup"].offered()["function"]
    assert t["description"] == "Weather for a city."
    assert t["parameters"] == {"type": "object", "properties": {"city": {"type": "string"},
                                                                "days": {"type": "integer"}}, "required": ["city"]}
    assert not (tmp_path / "ran").exists()
    (tmp_path / "bad.py").write_text('def f(x: Path):\n    "doc"\n')
    with pytest.raises(ToolFileError, match=r"bad.py:1: tool 'f': parameter 'x' is annotated Path"):
        read_tools_file(tmp_path / "bad.py")
    with pytest.raises(ToolFileError, match="no tool found"):
        read_tools_file(_write(tmp_path / "e.py", "x=1"))
    with pytest.raises(ToolFileError, match=r"tools.py.missing: tools file not found \(spec.rollout.agent.toolsFile\)"):
        read_tools_file(tmp_path / "tools.py.missing")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- observations as the model's template renders them ---------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_tokenizer(model_cache):
    from transformers import AutoTokenizer

    from hybridflow.api.sources import ModelSource
    from hybridflow.models.builders import materialize

    return AutoTokenizer.from_pretrained(materialize(ModelSource(source="smollm2"), model_cache, 0))


def test_observations_are_the_templates_messages_after_the_models_own_end_of_turn(smollm2_tokenizer):
    tok = smollm2_tokenizer
    codec = ObservationCodec(tok, tok.chat_template, [tok.eos_token_id])
    assert not codec.tool_role  # SmolLM2's template has no tool role: a user message in the plain form
    closed = codec.observation_text([("tool", "5535")], closed=True)
    assert closed == "\n<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # a turn cut before its end-of-turn token gets the template's end of turn first
    assert codec.observation_text([("user", "Higher.")], closed=False).startswith("<|im_end|>\n<|im_start|>user\n")
    # the whole conversation, rendered by the template, equals prompt + model turn + observation, token for token
    msgs = [{"role": "user", "content": "What is 3 * 4?"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    turn = CALL % "3*4"
    whole = tok.apply_chat_template(msgs + [{"role": "assistant", "content": turn},
                                            {"role": "user", "content": "<tool_response>\n12\n</tool_response>"}],
                                    tokenize=False, add_generation_prompt=True)
    assert prompt + turn + "<|im_end|>" + codec.observation_text([("tool", "12")], closed=True) == whole
    plain = ObservationCodec(tok, None, [tok.eos_token_id])
    assert plain.observation_text([("tool", "12")], True) == "\n<tool_response>\n12\n</tool_response>\n"
    assert "calculator(expression: string)" in plain_tools_text([TOOLS["calculator"].offered()])


# -- every estimator and loss over multi-turn masks ------------------------------------------------------------------

def _multi_turn_rows(seed: int = 0):
    """Rows whose responses have observation tokens (mask 0) between model turns, and the same rows compacted
    (observation positions removed): what is computed over the model's tokens must not depend on the holes."""
    g = torch.Generator().manual_seed(seed)
    masks = [[1, 1, 0, 0, 1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
             [1, 1, 0, 0, 0, 1, 0, 0, 0, 0]]
    holey = torch.tensor(masks, dtype=torch.float64)
    compact = torch.zeros_like(holey)
    index = []
    for i, m in enumerate(masks):
        pos = [j for j, x in enumerate(m) if x]
        compact[i, : len(pos)] = 1
        index.append(pos)
    def spread(values: torch.Tensor) -> torch.Tensor:  # compact (B, R) values placed at the holey positions
        out = torch.randn(holey.shape, generator=g, dtype=torch.float64) * 100  # garbage where the mask is 0
        for i, pos in enumerate(index):
            out[i, pos] = values[i, : len(pos)]
        return out
    def gather(values: torch.Tensor) -> torch.Tensor:  # holey (B, R) -> compact positions
        out = torch.zeros_like(values)
        for i, pos in enumerate(index):
            out[i, : len(pos)] = values[i, pos]
        return out
    return holey, compact, spread, gather, g


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS.names())
def test_every_advantage_estimator_sees_only_the_models_tokens(estimator):
    holey, compact, spread, gather, g = _multi_turn_rows()
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    values_c = torch.randn(compact.shape, generator=g, dtype=torch.float64) * compact
    kl_c = torch.rand(compact.shape, generator=g, dtype=torch.float64) * compact
    group = torch.tensor([0, 0, 1, 1])
    baseline = torch.tensor([0.5, 0.5, 1.0, 1.0], dtype=torch.float64)

    def advantages(mask, values, kl):
        x = AdvantageInputs(token_rewards(scores, mask, kl, 0.1), mask, group, values, baseline, 0.9, 0.8)
        return ADVANTAGE_ESTIMATORS[estimator](x)

    adv_c, ret_c = advantages(compact, values_c, kl_c)
    adv_h, ret_h = advantages(holey, spread(values_c), spread(kl_c))
    torch.testing.assert_close(gather(adv_h) * compact, adv_c * compact)
    torch.testing.assert_close(gather(ret_h) * compact, ret_c * compact)
    assert float((adv_h * (1 - holey)).abs().sum()) == 0.0  # nothing on the answers of tools


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS.names())
def test_every_policy_loss_and_aggregation_sees_only_the_models_tokens(loss, agg):
    holey, compact, spread, gather, g = _multi_turn_rows(1)
    logp_c = torch.randn(compact.shape, generator=g, dtype=torch.float64) * 0.1 - 1
    old_c = logp_c + torch.randn(compact.shape, generator=g, dtype=torch.float64) * 0.05
    adv_c = torch.randn(compact.shape, generator=g, dtype=torch.float64)
    clip = ClipConfig(0.2, 0.28)

    def value(mask, logp, old, adv):
        logp = logp.clone().requires_grad_(True)
        out = LOSS_AGGREGATIONS[agg](POLICY_LOSSES[loss](logp, old, adv, mask, clip).loss, mask, 10)
        out.backward()
        return out.detach(), logp.grad

    v_c, grad_c = value(compact, logp_c, old_c, adv_c)
    v_h, grad_h = value(holey, spread(logp_c), spread(old_c), spread(adv_c))
    torch.testing.assert_close(v_h, v_c)
    torch.testing.assert_close(gather(grad_h) * compact, grad_c * compact)
    assert float((grad_h * (1 - holey)).abs().sum()) == 0.0


# -- the loop: scheduling, environments, lost replicas ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    f = tmp_path_factory.mktemp("tools") / "slow.py"
    f.write_text('import time\n\ndef slow(seconds: float):\n    """Sleeps, then answers."""\n'
                 '    time.sleep(seconds)\n    return "slept"\n')
    return LocalTools({"calculator": TOOLS["calculator"], "python": TOOLS["python"], **read_tools_file(f)},
                      timeout_seconds=8)


def test_a_slow_tool_holds_back_only_its_own_episode_and_turns_share_engine_calls(tools):
    slow = '<tool_call>{"name": "slow", "arguments": {"seconds": 3}}</tool_call>'
    turns = {0: [slow, "done"], **{i: [CALL % f"{i}*7", CALL % f"{i}+1", f"answer {i}"] for i in range(1, 5)}}
    policy = ScriptedPolicyDouble(turns)
    t0 = time.monotonic()
    episodes = run_episodes([[1]] * 5, [{}] * 5, policy, CharCodec(), EpisodeSettings(400, max_turns=4),
                            tools=tools)
    took = time.monotonic() - t0
    assert [e.turns for e in episodes] == [2, 3, 3, 3, 3]
    assert [e.tool_calls for e in episodes] == [1, 2, 2, 2, 2] and not any(e.tool_errors for e in episodes)
    for i in range(1, 5):  # the tools' answers are in the episode, as observation tokens
        text = CharCodec().decode(episodes[i].tokens)
        assert f"[{i * 7}]" in text and f"[{i + 1}]" in text and text.endswith(f"answer {i}")
    # the quick episodes finished all their turns while the slow tool ran: their last turns came before episode
    # 0's second turn, and shared engine calls
    last_quick = max(t for t, rows in policy.calls if set(rows) & {1, 2, 3, 4})
    slow_second = [t for t, rows in policy.calls if 0 in rows][1]
    assert last_quick < slow_second, policy.calls
    assert any(len(rows) > 1 and 0 not in rows for _, rows in policy.calls[1:]), policy.calls
    assert 3 <= took < 3 + 6, took  # not the sum of the tools' times (3 s + 8 quick sandboxes, one after another)


def test_the_loss_mask_marks_the_models_tokens_and_observations_are_never_trained(tools):
    policy = ScriptedPolicyDouble({0: [CALL % "6*7", "42"]})
    (e,) = run_episodes([[1, 2]], [{}], policy, CharCodec(), EpisodeSettings(200), tools=tools)
    codec = CharCodec()
    model_text = codec.decode([t for t, m in zip(e.tokens, e.loss_mask) if m])
    other_text = codec.decode([t for t, m in zip(e.tokens, e.loss_mask) if not m])
    assert model_text == (CALL % "6*7") + "42" and other_text == "[42]"
    assert [lp for lp, m in zip(e.log_probs, e.loss_mask) if not m] == [0.0] * len(other_text)
    assert len(e.tokens) == len(e.loss_mask) == len(e.log_probs)


def test_an_episode_stops_at_its_token_budget_and_its_turn_limit(tools):
    policy = ScriptedPolicyDouble({0: [CALL % "1+1"] * 9, 1: [CALL % "2+2"] * 9})
    long, short = run_episodes([[1], [1]], [{}, {}], policy, CharCodec(), EpisodeSettings(90, max_turns=2),
                               tools=tools)
    assert len(long.tokens) <= 90 and long.turns <= 2 and short.turns <= 2
    capped = run_episodes([[1]], [{}], ScriptedPolicyDouble({0: ["x" * 500]}), CharCodec(), EpisodeSettings(50))[0]
    assert len(capped.tokens) == 50 and capped.truncated and capped.turns == 1


def test_environment_episodes_get_per_turn_feedback_and_rewards():
    sessions = LocalSessions(EnvironmentCode(target=ENVIRONMENTS["guess_number"]), step_timeout_seconds=5)
    try:
        policy = ScriptedPolicyDouble({0: ["50", "I think 25", "30"], 1: ["7"], 2: ["1", "2", "3", "4", "5"]})
        episodes = run_episodes([[1]] * 3, [{"ground_truth": 30}, {"ground_truth": 7}, {"ground_truth": 99}],
                                policy, CharCodec(), EpisodeSettings(300, max_turns=4, has_environment=True),
                                sessions=sessions)
        won3, won1, lost = episodes
        assert (won3.turns, won3.env_steps, won3.env_reward) == (3, 3, pytest.approx(0.6))
        assert CharCodec().decode(won3.tokens).count("[Lower.]") == 1 and "[Higher.]" in CharCodec().decode(
            won3.tokens)
        assert (won1.turns, won1.env_reward) == (1, 1.0)
        assert (lost.turns, lost.env_reward) == (4, 0.0)
        assert not sessions._open  # every session's sandbox is gone
        # Each step's reward sits on the model's last token of the turn it answered (the token before that
        # answer's own), so token-level estimators credit that turn; the row sums to the episode's reward.
        ends = [t for t in range(len(won3.tokens)) if won3.loss_mask[t] == 1
                and (t + 1 == len(won3.tokens) or won3.loss_mask[t + 1] == 0)]
        assert won3.turn_rewards == [(ends[-1], pytest.approx(0.6))], (won3.turn_rewards, ends)  # paid at the end
    finally:
        sessions.shutdown()


def test_each_environment_steps_reward_is_placed_on_the_turn_that_earned_it():
    """examples/agents/guess_the_number.py pays each informative guess as it is made: those rewards sit on the
    model's last token of their turns (the token before the environment's answer), and each row of the placed
    rewards sums to its episode's reward, so token-level estimators credit each turn and outcome ones see the sum."""
    env = ROOT / "examples" / "agents" / "guess_the_number.py"
    sessions = LocalSessions(EnvironmentCode.from_file(env, "Environment"), step_timeout_seconds=5)
    try:
        sample = {"prompt": "p", "ground_truth": 60, "data_source": "d", "extra_info": {"low": 1, "high": 100}}
        policy = ScriptedPolicyDouble({0: ["50", "75", "60"], 1: ["60"]})
        episodes = run_episodes([[1]] * 2, [sample, sample], policy, CharCodec(),
                                EpisodeSettings(300, max_turns=4, has_environment=True), sessions=sessions)
        e = episodes[0]
        ends = [t for t in range(len(e.tokens)) if e.loss_mask[t] == 1
                and (t + 1 == len(e.tokens) or e.loss_mask[t + 1] == 0)]
        assert [p for p, _ in e.turn_rewards] == ends and len(ends) == 3, (e.turn_rewards, ends)
        assert all(r > 0 for _, r in e.turn_rewards) and sum(r for _, r in e.turn_rewards) == pytest.approx(
            e.env_reward)
        placed = placed_rewards(episodes, 300)
        assert placed.sum(1).tolist() == pytest.approx([x.env_reward for x in episodes])
        assert [float(placed[0, p]) for p in ends] == pytest.approx([r for _, r in e.turn_rewards])
    finally:
        sessions.shutdown()


class LosesOneReplica:
    """A fault injector around real sessions: the first step of episode 1's first session raises SessionLost, as
    the environment pool's client does when that session's replica died."""

    def __init__(self, inner: LocalSessions) -> None:
        self.inner, self.lost, self.opened = inner, False, []

    def open(self, sample):
        sid, obs = self.inner.open(sample)
        self.opened.append(sample["ground_truth"])
        return sid, obs

    def step(self, session, action):
        if not self.lost and action == "41":
            self.lost = True
            raise SessionLost("replica 0 refused the connection")
        return self.inner.step(session, action)

    def close(self, session):
        self.inner.close(session)

    def shutdown(self):
        self.inner.shutdown()


def test_an_episode_whose_replica_is_lost_starts_again_and_is_not_lost():
    sessions = LosesOneReplica(LocalSessions(EnvironmentCode(target=ENVIRONMENTS["guess_number"])))
    try:
        policy = ScriptedPolicyDouble({0: ["41", "42", "42"], 1: ["5"]})
        first, other = run_episodes([[1], [1]], [{"ground_truth": 42}, {"ground_truth": 5}], policy, CharCodec(),
                                    EpisodeSettings(100, has_environment=True), sessions=sessions)
        assert sessions.lost and sorted(sessions.opened) == [5, 42, 42]  # episode 0 was reset again
        assert first.retries == 1 and first.error is None and first.env_reward == 1.0
        assert CharCodec().decode(first.tokens) == "42"  # the lost attempt's tokens are gone, not trained
        assert other.env_reward == 1.0 and other.retries == 0
    finally:
        sessions.shutdown()


# -- token in, token out, with the real engine and real tools --------------------------------------------------------

class RecordingEngine:
    """The real HF generation engine, with what it returned recorded (a spy, not a double: it generates)."""

    def __init__(self, engine) -> None:
        self.engine, self.outputs = engine, []

    def generate(self, prompts, cfgs):
        out = self.engine.generate(prompts, cfgs)
        self.outputs.append([(list(p), list(g.tokens)) for p, g in zip(prompts, out)])
        return out


@pytest.fixture(scope="module")
def smollm2_dir(model_cache):
    from hybridflow.api.sources import ModelSource
    from hybridflow.models.builders import materialize

    return materialize(ModelSource(source="smollm2"), model_cache, 0)


@pytest.mark.slow
def test_the_trained_ids_are_the_engines_ids_and_re_tokenizing_would_change_them(smollm2_dir, smollm2_tokenizer):
    """Multi-turn SmolLM2 episodes with the calculator through the rollout's episode runner: the model positions of
    the packed batch are exactly the ids the engine returned, turn after turn, and the other positions are the
    tool's answers; and the constructed case below shows that decoding and tokenizing again would not give them."""
    from hybridflow.agents.places import job_tools
    from hybridflow.api.agents import Agent
    from hybridflow.data.files import PromptRenderer
    from hybridflow.data.tasks import products_samples
    from hybridflow.engines.rollout.base import SamplingConfig
    from hybridflow.engines.rollout.hf import HFRollout
    from hybridflow.roles.episodes import EpisodeRunner

    tok = smollm2_tokenizer
    agent = Agent(tools=["calculator"], max_turns=3, max_tokens_per_turn=48)
    renderer = PromptRenderer(tok, None, None, [t.offered() for t in job_tools(agent).values()])
    samples = products_samples(4, 3, lambda m: renderer.ids(m, "test"))
    runner = EpisodeRunner.build(agent, smollm2_dir, None, [tok.eos_token_id], 120)
    engine = RecordingEngine(HFRollout(smollm2_dir, "float32", torch.device("cpu"), 0))
    batch = {"prompt_ids": [s.prompt for s in samples], "truth": [s.truth for s in samples],
             "data_source": ["products"] * 4, "extra_info": [{}] * 4}
    sampling = lambda greedy, lp, n: SamplingConfig(n, 1.0, 1.0, greedy, (tok.eos_token_id,), lp)  # noqa: E731
    try:
        packed = runner.run(engine, sampling, batch, [True] * 4, False, 512)
    finally:
        runner.close()
    P = 512
    called = [i for i in range(4) if packed["agent_tool_calls"][i] > 0]
    assert called, [tok.decode(r) for r in packed["responses"]]  # greedy after three worked examples calls it
    for i, prompt in enumerate(batch["prompt_ids"]):
        mask, resp = packed["response_mask"][i], packed["responses"][i]
        n = int(packed["attention_mask"][i, P:].sum())
        turns = [out for call in engine.outputs for p, out in call if p[: len(prompt)] == prompt]
        assert resp[mask.bool()].tolist() == [t for out in turns for t in out]  # exactly the engine's ids
        assert packed["input_ids"][i, P - len(prompt): P].tolist() == prompt
        if i in called:
            shown = tok.decode(resp[:n][~mask[:n].bool()])
            truth = batch["truth"][i]
            assert "<tool_response>" in shown and str(truth) in shown.replace(",", ""), shown
        # each turn's context was the prompt and every earlier token, the answers included, exactly as packed
        contexts = [p for call in engine.outputs for p, _ in call if p[: len(prompt)] == prompt]
        for context in contexts:
            assert context[len(prompt):] == resp[: len(context) - len(prompt)].tolist()
        assert len(contexts) == int(packed["agent_turns"][i])
    # The constructed case: a turn the engine could write whose text tokenizes differently ("t" "he" -> "the").
    word = [tok.encode("t", add_special_tokens=False)[0], tok.encode("he", add_special_tokens=False)[0]]
    assert tok.encode(tok.decode(word), add_special_tokens=False) != word  # re-tokenizing merges "t"+"he"
    (e,) = run_episodes([[1]], [{}], _FixedTurn(word + [tok.eos_token_id]), ObservationCodec(
        tok, tok.chat_template, [tok.eos_token_id]), EpisodeSettings(20))
    assert e.tokens == word + [tok.eos_token_id]  # the loop keeps the engine's ids as they were


class _FixedTurn:
    """A policy double that writes one fixed token sequence (the constructed case above)."""

    def __init__(self, ids):
        self.ids = ids

    def generate(self, rows, contexts, max_tokens):
        return [(list(self.ids), []) for _ in rows]


def test_validate_names_a_missing_or_broken_environment_or_tools_file(tmp_path):
    from hybridflow.api import RLHFJob
    from hybridflow.trainer.preflight import check_runtime_paths

    def problems(**agent):
        job = RLHFJob.model_validate({"spec": {"models": {"actor": {"source": "smollm2"}}, "data": {
            "task": "products"}, "rollout": {"agent": agent}, "trainer": {"checkpointDir": str(tmp_path / "c")}}})
        return check_runtime_paths(job)

    assert problems(environmentFile=str(tmp_path / "nope.py")) == [
        f"spec.rollout.agent.environmentFile: {tmp_path / 'nope.py'}: environment file not found; fix the path"]
    binary = tmp_path / "env.bin"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    assert "env.bin: not a text file" in problems(environmentFile=str(binary))[0]
    binary_tools = tmp_path / "tools.bin"
    binary_tools.write_bytes(b"\xff\xfe\x00 not text")
    assert "tools.bin: not a text file" in problems(toolsFile=str(binary_tools))[0]
    broken = _write(tmp_path / "env.py", "class Environment:\n    def reset(self\n")
    assert "env.py:2: syntax error" in problems(environmentFile=str(broken))[0]
    assert "no tool found" in problems(toolsFile=str(_write(tmp_path / "t.py", "x = 1\n")))[0]
    assert problems(environmentFile=str(_write(tmp_path / "ok.py", "class Environment: pass\n"))) == []


def test_the_wire_carries_numpy_values_as_python_ones_and_refuses_what_is_not_one_json_object():
    import numpy as np

    from hybridflow import wire

    assert wire.decode(wire.encode({"truth": np.int64(42), "ids": np.array([1, 2])})) == {"truth": 42, "ids": [1, 2]}
    for bad in (b"[" * 100_000, b"[1]", b"not json", b'{"a": 1'):
        with pytest.raises(wire.WireError):
            wire.decode(bad)


@pytest.mark.parametrize("change, refused", [
    ({"rollout": {"engine": "megatron"}}, "spec.rollout.engine: megatron generation takes one sampling setting"),
    ({"rollout": {"partialRolloutTokens": 4}}, "spec.rollout.partialRolloutTokens"),
    ({"models": {"actor": {"source": "tiny"}}}, "need a model with a tokenizer"),
    ({"rollout": {"agent": {"score": "environment"}}}, "score: environment needs an environment"),
    ({"rollout": {"agent": {"tools": []}}}, "names no tools"),
])
def test_the_spec_refuses_what_multi_turn_rollouts_cannot_do_saying_why(change, refused):
    from hybridflow.api import RLHFJob

    doc = {"models": {"actor": {"source": "smollm2"}}, "data": {"task": "products"},
           "rollout": {"agent": {"tools": ["calculator"]}}, "training": {"engine": "megatron"}}
    for section, values in change.items():
        for k, v in values.items():
            doc[section][k] = {**doc[section].get(k, {}), **v} if isinstance(v, dict) else v
    if "engine" not in change.get("rollout", {}):
        doc.pop("training")
    with pytest.raises(ValueError, match=refused):
        RLHFJob.model_validate({"spec": doc})


def test_a_silent_step_still_hands_the_turn_back_and_a_session_that_cannot_start_ends_only_its_episode(tmp_path):
    env = _write(tmp_path / "quiet.py", "class Environment:\n    def reset(self, sample):\n        self.n = 0\n"
                 "        return ''\n    def step(self, action):\n        self.n += 1\n"
                 "        return '', float(self.n == 2), self.n == 2, {}\n")
    sessions = LocalSessions(EnvironmentCode.from_file(env, "Environment"))
    try:
        (e,) = run_episodes([[1]], [{}], ScriptedPolicyDouble({0: ["a", "b"]}), CharCodec(),
                            EpisodeSettings(50, has_environment=True), sessions=sessions)
        assert CharCodec().decode(e.tokens) == "a[]b" and e.env_reward == 1.0  # the empty answer is still a turn
    finally:
        sessions.shutdown()

    class NoSandboxLeft(LocalSessions):
        def open(self, sample):
            raise OSError(11, "Resource temporarily unavailable")

    broken = NoSandboxLeft(EnvironmentCode.from_file(env, "Environment"))
    episodes = run_episodes([[1], [1]], [{}, {}], ScriptedPolicyDouble({0: ["a"], 1: ["b"]}), CharCodec(),
                            EpisodeSettings(50, has_environment=True), sessions=broken)
    assert all("Resource temporarily unavailable" in e.error and e.turns == 0 for e in episodes)
