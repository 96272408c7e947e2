"""spec.rollout.agent.trajectory (merged | per_call): an agent program's episode becomes several trained rows, each
the engine's exact ids, every row with the episode's reward and its prompt's group, through the rollout's packing
(roles.rollout's _Generator over roles.episodes' EpisodeRunner), the controller's padding to the training ranks
(trainer.rows) and the group advantage. A scripted engine over SmolLM2's tokenizer, programs in this process: no
model, no vLLM."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import openai
import pytest
import torch

from hybridflow.agents.codec import ObservationCodec
from hybridflow.agents.protocol import Places, ProgramResult
from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from hybridflow.algorithms.core import token_rewards
from hybridflow.api.agents import Agent
from hybridflow.api.sections import Algorithm
from hybridflow.engines.rollout.base import Generation
from hybridflow.roles.episodes import EpisodeRunner
from hybridflow.roles.rollout import _Generator
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.rows import dp_divisor, fitted, is_padding, padded, prompt_groups

P, R = 256, 64  # the rows' prompt and response widths


@pytest.fixture(scope="module")
def tok(model_cache):
    from transformers import AutoTokenizer

    from hybridflow.api.sources import ModelSource
    from hybridflow.models.builders import materialize

    return AutoTokenizer.from_pretrained(materialize(ModelSource(source="smollm2"), model_cache, 0))


class Scripted:
    """A generation engine (RolloutEngine.generate) answering "yes" to a greedy row and "no" to a sampled one, with
    log-probs; it records every (context, ids) it answered."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.seen = tok, []

    def generate(self, prompts, cfgs):
        out = []
        for p, c in zip(prompts, cfgs):
            ids = (self.tok.encode("yes" if c.greedy else "no", add_special_tokens=False) + [self.tok.eos_token_id])
            ids = ids[: c.max_tokens]
            self.seen.append((list(p), ids))
            out.append(Generation(ids, [-0.25] * len(ids)))
        return out


async def three_calls(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float:
    """Call 2 continues call 1; before call 3 the program rewrites the model's answer (a break). Reward: whether
    the model said yes."""
    messages = [{"role": "user", "content": sample["prompt"]}]
    said = ""
    for turn in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        said = r.choices[0].message.content or ""
        shown = said + (" (REWRITTEN)" if turn == 1 else "")
        messages += [{"role": "assistant", "content": shown}, {"role": "user", "content": f"Again ({turn})."}]
    return 1.0 if "yes" in said else 0.0


class InProcess:
    """Programs (hybridflow.agents.protocol) running an `async def run(client, sample)` in this process."""

    def __init__(self, program) -> None:
        self.program = program

    def run(self, sample, endpoint, timeout):
        import asyncio

        import httpx

        async def go() -> float:
            transport = httpx.AsyncHTTPTransport(uds=endpoint.socket_path)
            async with httpx.AsyncClient(transport=transport) as http:
                client = openai.AsyncOpenAI(base_url=endpoint.BASE_URL, api_key=endpoint.token, http_client=http,
                                            max_retries=0)
                return await asyncio.wait_for(self.program(client, sample), timeout)

        return ProgramResult(reward=float(asyncio.run(go())))

    def close(self) -> None:
        pass


def rollout(tok: Any, trajectory: str, tmp_path) -> tuple[Batch, Scripted]:
    """Two prompts, two responses each (uids 7, 7, 9, 9; the second of each group greedy: it says yes), through
    the rollout's packing of program episodes."""
    program = tmp_path / "agent.py"
    program.write_text("async def run(client, sample):\n    return 1.0\n")
    agent = Agent(program=str(program), max_turns=4, trajectory=trajectory)
    codec = ObservationCodec(tok, tok.chat_template, [tok.eos_token_id])
    runner = EpisodeRunner(agent, codec, Places(programs=InProcess(three_calls)), R)
    engine = Scripted(tok)
    config = SimpleNamespace(algorithm=Algorithm(), rollout=SimpleNamespace(
        mode="sync", max_prompt_length=P, max_response_length=R, temperature=1.0, top_p=1.0))
    gen = _Generator(engine, config, (tok.eos_token_id,), episodes=runner)  # type: ignore[arg-type]
    prompts = [tok.encode(text, add_special_tokens=False) for text in ("Say yes.", "Say yes.", "Say no.", "Say no.")]
    batch = Batch(non_tensors={"prompt_ids": prompts, "uid": [7, 7, 9, 9], "truth": ["a", "a", "b", "b"],
                               "data_source": ["d"] * 4, "extra_info": [{}] * 4,
                               "greedy": np.array([False, True, False, True])})
    return gen.packed(batch, greedy=False), engine


def row_ids(batch: Batch, i: int) -> tuple[list[int], list[int], list[int]]:
    """Row i's prompt ids, its response ids and their loss mask (padding stripped)."""
    prompt = batch["prompts"][i][batch["attention_mask"][i, :P].bool()].tolist()
    n = int(batch["attention_mask"][i, P:].sum())
    return prompt, batch["responses"][i, :n].tolist(), batch["response_mask"][i, :n].tolist()


def grpo(batch: Batch) -> torch.Tensor:
    """The advantages Step.advantages computes for a program's job (score environment: the env_reward column,
    placed on each row's last model token), by GRPO over the uid groups."""
    mask = batch["response_mask"]
    inputs = AdvantageInputs(token_rewards(batch["env_reward"], mask, None, 0.0, batch["env_turn_rewards"]), mask,
                             torch.as_tensor(batch["uid"].astype(np.int64)))
    return ADVANTAGE_ESTIMATORS["grpo"](inputs)[0]


def test_merged_trains_every_chain_as_its_own_row_with_the_episodes_reward_and_group(tok, tmp_path):
    batch, engine = rollout(tok, "merged", tmp_path)
    assert len(batch) == 8  # four episodes, each two chains: calls 1 and 2, then call 3 after the break
    assert batch["uid"].tolist() == [7, 7, 7, 7, 9, 9, 9, 9]  # each episode's rows: its input row's columns
    assert batch["greedy"].tolist() == [False, False, True, True] * 2
    assert batch["env_reward"].tolist() == [0.0, 0.0, 1.0, 1.0] * 2
    assert batch["agent_trajectory_breaks"].tolist() == [1.0, 0.0] * 4  # the episode's, on its first row
    assert batch["agent_turns"].tolist() == [2.0, 1.0] * 4  # each row's own calls
    for i in range(8):
        prompt, response, mask = row_ids(batch, i)
        trained = [t for t, m in zip(response, mask) if m]
        whole = prompt + response
        own = sorted({(tuple(c), tuple(ids)) for c, ids in engine.seen  # the calls the row holds: each its context,
                      if len(c) >= len(prompt) and whole[: len(c) + len(ids)] == c + ids})  # then its ids
        assert trained == [t for _, ids in own for t in ids]  # the engine's ids, call by call
        assert list(own[0][0]) == prompt  # the row's prompt is its first call's context
        assert "REWRITTEN" not in tok.decode(trained) and (i % 2 == 0 or "REWRITTEN" in tok.decode(prompt))
        first_chain = i % 2 == 0  # calls 1 and 2, the user turn between them masked; then call 3 alone
        assert len(own) == (2 if first_chain else 1) and (0 in mask) == first_chain
        last = max(j for j, m in enumerate(mask) if m)  # the reward on the row's last model token
        assert batch["env_turn_rewards"][i].nonzero().flatten().tolist() == ([last] if batch["env_reward"][i] else [])
    adv = grpo(batch)
    for i in range(8):  # both chains trained, by the episode's reward against its group (sampled 0, greedy 1)
        m = batch["response_mask"][i].bool()
        assert (adv[i][~m] == 0).all() and m.any()
        assert ((adv[i][m] > 0) if batch["env_reward"][i] else (adv[i][m] < 0)).all()


def test_per_call_makes_one_row_per_call_of_the_engines_exact_ids_all_trained(tok, tmp_path):
    batch, engine = rollout(tok, "per_call", tmp_path)
    assert len(batch) == 12 and batch["uid"].tolist() == [7] * 6 + [9] * 6
    assert batch["env_reward"].tolist() == [0.0] * 3 + [1.0] * 3 + [0.0] * 3 + [1.0] * 3
    assert batch["agent_turns"].tolist() == [1.0] * 12 and batch["agent_trajectory_breaks"].sum() == 4
    rows = [row_ids(batch, i) for i in range(12)]
    assert sorted((p, r) for p, r, _ in rows) == sorted(engine.seen)  # each row: one call's context, its ids
    assert all(m == [1] * len(r) for _, r, m in rows)
    adv = grpo(batch)
    assert (adv[batch["response_mask"] == 0] == 0).all()
    assert (adv[3:6][batch["response_mask"][3:6].bool()] > 0).all() and (adv[:3][batch["response_mask"][:3].bool()]
                                                                          < 0).all()


def test_the_controller_pads_the_rows_to_the_training_ranks_and_the_padding_trains_nothing(tok, tmp_path):
    batch, _ = rollout(tok, "per_call", tmp_path)  # 12 rows
    roles = {"actor": SimpleNamespace(dp_sizes={"train": 8}), "critic": SimpleNamespace(dp_sizes={"train": 4}),
             "rollout": SimpleNamespace(dp_sizes={"rollout": 3}), "judge": SimpleNamespace(dp_sizes={"train": 5})}
    assert dp_divisor(roles) == 8 and dp_divisor({}) == 1  # the rollout and judge never take the trained batch
    out = fitted(batch, dp_divisor(roles))
    pad_at = is_padding(out)
    assert len(out) == 16 and pad_at.sum() == 4
    for ranks in (2, 4, 8):  # every rank's contiguous part holds its share of the real rows, not padding only
        assert sorted(int((~c).sum()) for c in np.split(pad_at, ranks)) in (
            [12 // ranks] * ranks, [12 // ranks] * (ranks - 12 % ranks) + [12 // ranks + 1] * (12 % ranks))
    assert out.index(~pad_at)["uid"].tolist() == batch["uid"].tolist()  # the real rows keep their order
    assert sorted(out["uid"][pad_at].tolist()) == [-4, -3, -2, -1]  # each a group of one
    pad = out.index(pad_at)
    assert pad["response_mask"].sum() == 0 and pad["env_turn_rewards"].sum() == 0 and pad["env_reward"].sum() == 0
    assert pad["agent_turns"].sum() == 0 and set(pad["agent_error"]) == {""} and pad["agent_episode_first"].sum() == 0
    assert (grpo(out)[pad_at] == 0).all() and torch.equal(grpo(out)[~pad_at], grpo(batch))  # the groups unchanged
    assert [g["uid"].tolist() for g in prompt_groups(out)] == [[7] * 6, [9] * 6]  # padding in no group, none split
    assert padded(batch, 4) is batch  # 12 divides: nothing added
    from hybridflow.trainer.episodes import EpisodeFailures, episode_stats

    assert episode_stats(out) == episode_stats(batch)  # the padding holds no episode: the step's metrics ignore it
    assert batch["agent_episode_first"].tolist() == [1, 0, 0] * 4  # four episodes of three calls
    assert episode_stats(batch)["agent_turns_mean"] == 3  # per episode: its rows' calls
    counted = EpisodeFailures(0.5)
    counted.add(out)
    assert counted.episodes == 4
    for split in out.chunk(8):  # every training rank gets its equal part
        assert len(split) == 2


def test_a_greedy_baseline_needs_one_row_per_response(tok, tmp_path):
    batch, _ = rollout(tok, "merged", tmp_path)
    with pytest.raises(RuntimeError, match="greedy baseline .ReMax. needs one row per response"):
        fitted(batch, 2, rows_in=4)
    one = batch.index(np.array([0, 2, 4, 6]))
    assert fitted(one, 8, rows_in=4) is one  # one row each: split by position as before, nothing padded


def test_async_generation_groups_rows_by_prompt_and_leaves_the_ranks_padding_out():
    from hybridflow.trainer.generation.rollouts import _padded_batch

    rows = Batch({"x": torch.arange(3)}, {"uid": [5, 5, 6]})
    sent = _padded_batch(rows, 2)  # three rows over two ranks: the first repeated, as padding
    assert sent["uid"].tolist() == [5, 5, 6, -1] and rows["uid"].tolist() == [5, 5, 6]
    # what came back: the episode of row 0 two rows, the padding's own rows after the real ones
    back = sent.index(np.array([0, 0, 1, 2, 3, 3]))
    groups = prompt_groups(back)
    assert [g["uid"].tolist() for g in groups] == [[5, 5, 5], [6]] and [g["x"].tolist() for g in groups] == [
        [0, 0, 1], [2]]


def test_the_step_pads_a_programs_generation_and_dynamic_sampling_groups_its_rows_by_prompt(tmp_path):
    """Step (trainer.step) over a generation of variable rows per episode: padded to the training ranks at once,
    and dapo's groups are each prompt's rows (however many), its refilled batch padded again."""
    from hybridflow.api import JobSpec
    from hybridflow.trainer.generation.rollouts import Rollouts
    from hybridflow.trainer.generation.weight_sync import ColocatedWeightSync
    from hybridflow.trainer.step import AlgorithmState, Step, generation_rows, skipped_stages

    program = tmp_path / "agent.py"
    program.write_text("async def run(client, sample):\n    return 1.0\n")
    spec = JobSpec.model_validate({"algorithm": {"name": "dapo"}, "trainer": {"promptsPerStep": 2},
                                   "models": {"actor": {"source": "smollm2"}}, "data": {"task": "arithmetic"},
                                   "rollout": {"responsesPerPrompt": 2, "agent": {"program": str(program)}}})
    # uid 0: episodes of 2 and 1 rows, scores differ; uid 1: 1 and 2 rows, all the same (5 rows for 4 responses)
    made = Batch({"scores": torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5]), "response_mask": torch.ones(5, 3)},
                 {"uid": [0, 0, 0, 1, 1]})

    class Made(Rollouts):
        def generate(self, prompts, shape):
            return made

    rollouts = Made(spec, None, ColocatedWeightSync(None), lambda: Batch(), generation_rows)
    roles = {"actor": SimpleNamespace(dp_sizes={"train": 4})}
    step = Step(spec, roles, {}, {}, AlgorithmState.for_spec(spec), rollouts, skipped_stages(spec))
    out = step.generate(Batch(non_tensors={"uid": [0, 1]}))
    assert len(out) == 8 and is_padding(out).sum() == 3
    assert out.index(~is_padding(out))["uid"].tolist() == [0] * 3 + [1] * 2
    kept = step.groups_with_varied_scores(out)
    assert [g["uid"].tolist() for g in kept] == [[0, 0, 0]] and step.stats["sampled_groups"] == 2
    batch = step.fill_batch(kept, spare=out)  # topped up with uid 1's uniform group, then padded to 4 rows' multiple
    assert batch.index(~is_padding(batch))["uid"].tolist() == [0, 0, 0, 1, 1] and len(batch) == 8
    assert step.stats["filler_groups"] == 1 and [g["uid"].tolist() for g in prompt_groups(batch)] == [[0] * 3, [1] * 2]
