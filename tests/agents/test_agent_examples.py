"""The agentic examples. examples/smollm2-calculator.yaml as a user runs it (`hybridflow run`: real Ray, vLLM,
FSDP2 on two CPU ranks, the calculator in real bubblewrap sandboxes), shortened to two small steps (~70-90 s here).
What a short run shows stably, and is asserted: the job exits 0; the model called the calculator; every episode
that called it has more than one turn; the tool's answer is in the trajectory, with the product of the expression
the model wrote, and is masked out of the loss (0) while the model's own tokens are trained (1); rewards are finite;
and a step's update made the episodes it rewarded likelier against the others (its batch's objective rose, measured
with HF before and after the step). Not asserted: that the reward rises. Over two steps of 8 samples GRPO moves the
sampled tool-call rate by less than its sampling noise, and the greedy held-out reward starts at 1.000 (docs/agents.md,
"Examples": 12 steps, measured); a run long enough to show it costs ~60 s a step here.

examples/guess-the-number.yaml: a `hybridflow run` of it costs 42-52 s here even at one step of 8 episodes
(start-up and the final checkpoint), over this file's budget, so its run is docs/agents.md's measurement; here, in
seconds, the job is accepted as it is (scored by its environment alone, no job reward), and the user's environment
file plays games from the data script's rows in the real sandbox."""
import ast
import json
import math
import os
import subprocess
import sys

import pytest
import yaml
from support.paths import ROOT
from support.processes import running
from kube.harness import free_port, wait_for
from prometheus_server import Prometheus
from support.jobs import job_variant

from hybridflow.dashboards import AGENTS

from hybridflow.agents.local import EnvironmentCode, LocalSessions
from hybridflow.agents.toolcalls import parse_tool_calls
from hybridflow.api.errors import SpecError
from hybridflow.api.manifest_io import load_job, parse_job
from hybridflow.checkpoint import read_step_log
from hybridflow.models.builders import SMOLLM2_DIR

CALCULATOR = ROOT / "examples" / "smollm2-calculator.yaml"
GUESS = ROOT / "examples" / "guess-the-number.yaml"
GUESS_ENV = ROOT / "examples" / "agents" / "guess_the_number.py"


def _rollouts(ckpt):
    return [json.loads(line) for f in sorted((ckpt / "rollouts").glob("step_*.jsonl")) for line in f.open()]


def _masked_text(record, decode, masked):
    """The trajectory's tokens whose loss mask is 0 (masked=True: the tools' answers) or 1 (the model's own)."""
    keep = 0 if masked else 1
    return decode([t for t, m in zip(record["trajectory_ids"], record["loss_mask"]) if m == keep])


def _product(expression):
    """What the calculator must have answered for the model's expression (a * b, as the worked examples write)."""
    tree = ast.parse(str(expression), mode="eval").body  # the model may write a bare number: {"expression": 99}
    assert isinstance(tree, ast.BinOp) and isinstance(tree.op, ast.Mult), expression
    value = ast.literal_eval(tree.left) * ast.literal_eval(tree.right)
    return int(value) if float(value).is_integer() else value  # as the calculator writes 674.0 * 98


@pytest.mark.slow
def test_calculator_example_calls_the_tool_in_multi_turn_episodes(tmp_path, model_cache, ray_tmp):
    """Run asynchronously, rollout on a pool of its own (one trainer rank, one rollout rank): multi-turn episodes
    through the trajectory queue; and the agents' dashboard, every panel, has data in a real Prometheus scraping the
    job during its second step."""
    from transformers import AutoTokenizer

    ckpt = tmp_path / "run"
    driver_port, prom_port = free_port(), free_port()
    job = job_variant(tmp_path, CALCULATOR, trainer__steps=2, trainer__promptsPerStep=2, rollout__responsesPerPrompt=4,
                   data__evalPrompts=2, trainer__eval=False, trainer__rolloutLog=True, trainer__saveFreq=1,
                   trainer__checkpointDir=str(ckpt), rollout__mode="async", rollout__maxStaleness=1,
                   resourcePools=[{"name": "trainer", "devicesPerNode": 1}, {"name": "rollout", "devicesPerNode": 1}],
                   placement={"actor": "trainer", "rollout": "rollout"})
    cmd = [sys.executable, "-m", "hybridflow.cli", "run", str(job), "-q", "--metrics-port", str(driver_port),
           "--ray-temp-dir", ray_tmp]
    env = {**os.environ, "HYBRIDFLOW_MODEL_CACHE": str(model_cache)}
    with running(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as run:
        with Prometheus(tmp_path, {"rlhf-driver": f"127.0.0.1:{driver_port}"}, prom_port) as prom:
            steps_file = ckpt / "steps.jsonl"
            wait_for(lambda: steps_file.exists() and len(steps_file.read_text().splitlines()) >= 1
                     or run.poll() is not None, 600, "the first step")
            assert run.poll() is None, run.stderr.read()[-3000:]  # the second step runs, metrics are served
            panels = [(p.title, e.replace("$namespace", ".*").replace("$rlhfjob", ".*")) for p in AGENTS.panels
                      for e in p.exprs]
            wait_for(lambda: all(prom.query(e)["data"]["result"] for _, e in panels), 25,
                     lambda: f"agents' panels with data: {[t for t, e in panels if not prom.query(e)['data']['result']]}")
        assert run.wait(timeout=120) == 0, run.stderr.read()[-3000:]
    steps = read_step_log(ckpt)
    assert [r["step"] for r in steps] == [1, 2]
    assert any(r["agent_tool_calls_mean"] > 0 for r in steps), steps  # ~half the samples call it at temperature 1
    assert all(math.isfinite(r["reward_mean"]) and r["agent_tool_error_rate"] <= 1 for r in steps), steps
    assert all("staleness_max" in r for r in steps), steps  # trained from the asynchronous trajectory queue

    tok = AutoTokenizer.from_pretrained(model_cache / SMOLLM2_DIR)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    records = _rollouts(ckpt)
    assert len(records) == 2 * 2 * 4
    check_calculator_episodes(records, decode)
    check_updates_favour_the_rewarded_episodes(ckpt, model_cache / SMOLLM2_DIR)


def _surrogate(model, records):
    """GRPO's objective on a logged batch: the sum over its trained tokens (the model's own, loss mask 1) of
    advantage x log pi(token | trajectory so far), in float32 with HF on the prompt and then the trajectory (the
    prompt's KV cache computed once per group: the same sums to ~1e-7, in 2.5x less time than whole sequences)."""
    import torch

    total, prompts = 0.0, {}
    with torch.no_grad():
        for r in records:  # a group's prompt (~385 tokens here) is computed once, its KV cache cropped back to it
            key = tuple(r["prompt_ids"])
            if key not in prompts:
                out = model(torch.tensor([r["prompt_ids"]]), use_cache=True)
                prompts[key] = (out.logits[0, -1:], out.past_key_values)
            last, cache = prompts[key]
            if extra := cache.get_seq_length() - len(key):  # the group's previous trajectory
                cache.crop(-extra)
            ids = torch.tensor(r["trajectory_ids"])
            rest = model(ids[None, :-1], past_key_values=cache).logits[0] if len(ids) > 1 else last[:0]
            logits = torch.cat([last, rest])
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]
            own = logp[torch.tensor(r["loss_mask"]) == 1]
            assert len(own) == len(r["advantages"]), r  # the trainer's tokens are the engine's, tool answers out
            total += float((own * torch.tensor(r["advantages"])).sum())
    return total


def check_updates_favour_the_rewarded_episodes(ckpt, model_dir):
    """What a short run can show of learning, stably: a step's update raises its own batch's objective, so the
    episodes it rewarded (here: those that called the calculator and copied its answer) became likelier relative
    to the others, over the model's own tokens of multi-turn trajectories. Measured with the weights before the
    step (the initial model, or the previous step's checkpoint) and after it (its checkpoint). The first step whose
    batch has an advantage that is not 0 is checked (all groups of a batch can score alike: ~2% of step-1 batches).
    That the sampled tool-call rate and the held-out reward rise over a full run is docs/agents.md's measurement."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.export import role_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for step in (1, 2):
        batch = [json.loads(line) for line in (ckpt / "rollouts" / f"step_{step:08d}.jsonl").open()]
        if not any(a for r in batch for a in r["advantages"]):
            continue
        if step > 1:
            model.load_state_dict(role_weights(ckpt / f"step_{step - 1:08d}", "actor"), strict=False)
        before = _surrogate(model, batch)
        missing, _ = model.load_state_dict(role_weights(ckpt / f"step_{step:08d}", "actor"), strict=False)
        assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embeddings
        after = _surrogate(model, batch)
        assert after > before, (step, before, after)
        return
    raise AssertionError("no step's batch had an advantage that is not 0: every group scored alike")


def check_calculator_episodes(records, decode):
    """The rollout log's episodes of the calculator example: one turn without a tool call; with one, more turns,
    the tool's answer (the product the model asked for, computed in the sandbox) masked out of the loss."""
    assert all(math.isfinite(r["score"]) and r["score"] in (0.0, 1.0) for r in records), records
    called = [r for r in records if r["tool_calls"] > 0]
    assert called, "no episode called the calculator"
    answered = 0
    for r in records:
        assert len(r["loss_mask"]) == len(r["trajectory_ids"]) and r["loss_mask"][0] == 1, r  # the model starts
        if r["tool_calls"] == 0:
            assert r["turns"] == 1 and set(r["loss_mask"]) == {1}, r  # no tool: one turn, all of it trained
            continue
        assert r["turns"] > 1 and 0 in r["loss_mask"], r
        tool_text, own_text = _masked_text(r, decode, True), _masked_text(r, decode, False)
        assert "<tool_response>" in tool_text, r  # the tool's answer, in the plain form (SmolLM2 has no tool role)
        (call, *_) = parse_tool_calls(own_text)
        if call.error is None and call.name == "calculator":  # a well-formed call: the sandbox computed its answer
            try:
                expected = _product(call.arguments["expression"])
            except (AssertionError, KeyError, SyntaxError, ValueError):
                continue  # an expression of another shape: its answer is the tool's business, not checked here
            assert str(expected) in tool_text, (call, tool_text)
            answered += 1
    assert answered, ("no well-formed a * b call among the tool calls", [r["trajectory"] for r in called])


def test_the_guess_the_number_job_is_scored_by_its_environment_alone():
    job = load_job(GUESS)
    agent = job.spec.rollout.agent
    assert agent.episode_score == "environment" and agent.environment_file == "examples/agents/guess_the_number.py"
    assert job.spec.data.answer_key == "secret" and job.spec.models.reward.type == "rule"  # the default: unused
    doc = yaml.safe_load(GUESS.read_text())
    doc["spec"]["rollout"]["agent"]["score"] = "both"  # the job's reward is added: a rule cannot score files
    with pytest.raises(SpecError, match="spec.models.reward.type: rule scores the token ids of a generated task"):
        parse_job(doc, str(GUESS))


def _games(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "examples" / "data" / "make_guess_the_number.py"), "--out",
                    str(tmp_path), "--train", "40", "--test", "8"], check=True, capture_output=True)
    rows = {split: [json.loads(line) for line in (tmp_path / "guess_the_number" / f"{split}.jsonl").open()]
            for split in ("train", "test")}
    held = {(r["secret"], r["high"]) for r in rows["test"]}
    assert not any((r["secret"], r["high"]) in held for r in rows["train"]), "a test game is in the train file"
    return rows["train"]


def _sample(row):
    """What the rollout hands reset() for a row of the JSONL with answerKey `secret`: the columns the prompt and
    answer do not use are its extra_info."""
    return {"prompt": row["prompt"], "ground_truth": row["secret"], "data_source": "train.jsonl",
            "extra_info": {"low": row["low"], "high": row["high"]}}


def test_the_users_environment_plays_its_data_rows_in_the_sandbox(tmp_path):
    sessions = LocalSessions(EnvironmentCode.from_file(GUESS_ENV, "Environment"), step_timeout_seconds=10)
    try:
        for row in _games(tmp_path)[:3]:  # a binary search finds each secret; its rewards sum to 1
            sid, first = sessions.open(_sample(row))
            assert first.text == "" and first.error is None
            lo, hi, total, obs = row["low"], row["high"], 0.0, None
            for _ in range(8):
                guess = (lo + hi) // 2
                obs = sessions.step(sid, f"My guess is {guess}.")
                assert obs.error is None and obs.info["guess"] == guess and obs.info["consistent"], obs
                total += obs.reward
                if obs.done:
                    break
                lo, hi = (guess + 1, hi) if obs.text == "Higher." else (lo, guess - 1)
                assert obs.text in ("Higher.", "Lower."), obs
            assert obs.text == "Correct!" and total == pytest.approx(1.0), (row, obs, total)

        row = {"prompt": "p", "secret": 60, "low": 1, "high": 100}
        sid, _ = sessions.open(_sample(row))
        first = sessions.step(sid, "50")
        assert (first.text, first.done) == ("Higher.", False) and first.reward == pytest.approx(50 / 99)
        again = sessions.step(sid, "40")  # against the feedback: rules nothing out
        assert again.reward == 0.0 and again.info["consistent"] is False
        chat = sessions.step(sid, "I am thinking about it")
        assert chat.reward == 0.0 and chat.text == "Reply with one whole number from 51 to 100."
        sessions.close(sid)

        _, bad = sessions.open(_sample({**row, "secret": 150}))  # a data row outside its own range
        assert bad.done and "secret 150 is outside the row's range 1..100" in bad.error, bad
    finally:
        sessions.shutdown()
