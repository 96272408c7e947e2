"""An agent program's calls become what is trained (hybridflow.agents.trajectory, program_loop.assemble,
roles.episodes.fit_prompt): pure functions, no engine, no endpoint."""
from __future__ import annotations

import pytest

from hybridflow.agents.loop import NOT_RUN, PROGRAM, Episode
from hybridflow.agents.program_loop import assemble
from hybridflow.agents.protocol import ProgramResult
from hybridflow.agents.trajectory import Call, chains, per_call, sequences
from hybridflow.roles.episodes import fit_prompt


def test_calls_that_continue_each_other_are_one_sequence_with_only_the_models_tokens_trained():
    calls = [Call([1, 2], [10, 11], [-0.1, -0.2], False),
             Call([1, 2, 10, 11, 3, 4], [12], [-0.3], True),
             Call([1, 2, 10, 11, 3, 4, 12, 5], [13, 14], [], True)]  # no log-probs asked: 0
    (t,) = chains(calls)
    assert t.prompt_ids == [1, 2]
    assert t.tokens == [10, 11, 3, 4, 12, 5, 13, 14]
    assert t.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert t.log_probs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, 0.0, 0.0]
    assert sequences(calls) == ([t], 0)


def test_a_call_that_does_not_continue_starts_a_new_chain_and_every_chain_is_a_sequence():
    calls = [Call([1], [10], [], False), Call([1, 10, 2], [11], [], True),
             Call([1, 99, 2, 3], [12], [-0.5], False),  # the program rewrote the model's 10 as 99: a break
             Call([1, 99, 2, 3, 12, 4], [13], [-0.6], True)]
    found = chains(calls)
    assert [c.prompt_ids for c in found] == [[1], [1, 99, 2, 3]]
    rows, breaks = sequences(calls)
    assert breaks == 1 and rows == found
    first, last = rows
    assert (first.tokens, first.loss_mask, first.turns) == ([10, 2, 11], [1, 0, 1], 2)
    assert last.tokens == [12, 4, 13] and last.loss_mask == [1, 0, 1] and 99 not in last.tokens
    assert sequences([]) == ([], 0) and sequences([], "per_call") == ([], 0)


def test_per_call_makes_each_call_a_sequence_of_its_exact_prompt_and_completion_ids():
    calls = [Call([1, 2], [10, 11], [-0.1, -0.2], False),
             Call([1, 2, 10, 11, 3], [12], [], True),  # no log-probs asked: 0
             Call([7, 8], [13, 14, 15], [-0.3, -0.4, -0.5], False)]
    rows, breaks = sequences(calls, "per_call")
    assert breaks == 1 and rows == per_call(calls)
    assert [(e.prompt_ids, e.tokens) for e in rows] == [([1, 2], [10, 11]), ([1, 2, 10, 11, 3], [12]),
                                                         ([7, 8], [13, 14, 15])]
    assert [e.loss_mask for e in rows] == [[1, 1], [1], [1, 1, 1]]
    assert [e.log_probs for e in rows] == [[-0.1, -0.2], [0.0], [-0.3, -0.4, -0.5]]
    assert [e.turns for e in rows] == [1, 1, 1]


def test_a_call_marked_as_continuing_that_does_not_is_the_endpoints_bug_and_says_so():
    with pytest.raises(ValueError, match="does not start with its prompt and completion"):
        chains([Call([1], [10], [], False), Call([1, 11, 2], [12], [], True)])


def test_an_episode_carries_the_programs_reward_on_the_models_last_token_and_its_failures():
    calls = [Call([1, 2], [10, 11], [-0.1, -0.2], False), Call([1, 2, 10, 11, 3], [12, 0], [-0.3, -0.4], True)]
    (e,) = assemble(ProgramResult(reward=0.75), calls, max_tokens=100)
    assert (e.prompt_ids, e.tokens, e.turns, e.env_reward) == ([1, 2], [10, 11, 3, 12, 0], 2, 0.75)
    assert e.turn_rewards == [(4, 0.75)] and e.error is None and not e.truncated
    assert assemble(ProgramResult(reward=1.0), calls, max_tokens=5)[0].truncated
    (failed,) = assemble(ProgramResult(error="agent.py:3: ZeroDivisionError", failure=PROGRAM), calls, 100)
    assert (failed.failure, failed.env_reward, failed.tokens) == (PROGRAM, 0.0, [10, 11, 3, 12, 0])
    # logged, never trained: its loss mask is all 0, its log-probs still one per token
    assert failed.loss_mask == [0] * 5 and failed.log_probs == [-0.1, -0.2, 0.0, -0.3, -0.4]
    assert not failed.turn_rewards
    (unscored,) = assemble(ProgramResult(reward=float("nan")), calls, 100)
    assert unscored.loss_mask == [0] * 5 and len(unscored.log_probs) == 5
    (silent,) = assemble(ProgramResult(reward=1.0), [], 100)
    assert silent.failure == PROGRAM and "no call to the model" in silent.error and silent.prompt_ids is None
    assert "no finite reward" in assemble(ProgramResult(reward=float("nan")), calls, 100)[0].error
    assert assemble(ProgramResult(error="no sandbox", failure=NOT_RUN), [], 100)[0].failure == NOT_RUN


def test_a_programs_own_metrics_reach_the_step_log_as_means_over_the_episodes_that_returned_them():
    from hybridflow.roles.episodes import non_tensor_columns
    from hybridflow.single_controller.batch import Batch
    from hybridflow.trainer.episodes import program_metrics

    calls = [Call([1, 2], [10, 11], [-0.1, -0.2], False)]
    episodes = [assemble(ProgramResult(reward=1.0, metrics=m), calls, 100)[0]
                for m in ({"tool_calls": 2.0}, {"tool_calls": 1.0, "plan_chars": 30.0}, {})]
    assert [e.metrics for e in episodes] == [{"tool_calls": 2.0}, {"tool_calls": 1.0, "plan_chars": 30.0}, {}]
    batch = Batch({}, non_tensor_columns(episodes))
    assert program_metrics(batch) == {"agent_program_plan_chars_mean": 30.0, "agent_program_tool_calls_mean": 1.5}


def test_a_programs_prompt_longer_than_the_prompt_width_opens_the_response_untrained():
    e = Episode(tokens=[10, 11], loss_mask=[1, 1], log_probs=[-0.1, -0.2], turn_rewards=[(1, 1.0)])
    prompt, fitted = fit_prompt([1, 2, 3, 4, 5], e, 3, 10)
    assert prompt == [1, 2, 3]
    assert (fitted.tokens, fitted.loss_mask, fitted.log_probs) == ([4, 5, 10, 11], [0, 0, 1, 1],
                                                                   [0.0, 0.0, -0.1, -0.2])
    assert fitted.turn_rewards == [(3, 1.0)] and e.tokens == [10, 11]  # the original is left as it was
    assert not fitted.truncated and fit_prompt([1, 2, 3, 4, 5], e, 3, 3)[1].truncated  # pushed past the width
    assert fit_prompt([1, 2], e, 3, 10) == ([1, 2], e)


def test_the_bound_advises_an_agent_programs_own_settings_for_its_failures():
    import numpy as np

    from hybridflow.single_controller.batch import Batch
    from hybridflow.trainer.episodes import AgentFailure, EpisodeFailures

    batch = Batch({}, {"agent_error": np.array(["", "the agent program agent.py timed out after 300 s"], dtype=object),
                       "agent_failure": np.array(["", PROGRAM], dtype=object), "truth": ["4", "9"]})
    with pytest.raises(AgentFailure) as err:
        EpisodeFailures(0.25).add(batch)
    assert str(err.value) == (
        "1 of 2 episodes failed in this step (agent program: 1), more than spec.rollout.agent.maxFailedFraction = "
        "0.25; first: sample 1 (ground truth '9'): agent program: the agent program agent.py timed out after 300 s. "
        "Fix spec.rollout.agent.program (run it on that sample), raise spec.rollout.agent.programTimeoutSeconds if "
        "its runs time out, or raise maxFailedFraction")
