"""An agent program's episodes as several rows (spec.rollout.agent.trajectory) and the controller's padding rows
(trainer.rows): failures and metrics count episodes, not rows (trainer.episodes); the padding is spread so that no
training rank gets padding only, and it is left out of the step's statistics and the rollout log."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.agents.loop import PROGRAM
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.episodes import AgentFailure, EpisodeFailures, episode_stats
from hybridflow.trainer.rows import dp_divisor, is_padding, padded, prompt_groups, spread


def episodes(rows: list[int], failed: list[bool], **per_row: list[float]) -> Batch:
    """Episodes of `rows[k]` rows each (uid k // 2), the failed ones one row, and the given per-row columns."""
    first = [float(j == 0) for n in rows for j in range(n)]
    uid = [k // 2 for k, n in enumerate(rows) for _ in range(n)]
    error = [("boom" if f else "") if j == 0 else "" for n, f in zip(rows, failed) for j in range(n)]
    B = len(first)
    tensors = {"agent_episode_first": torch.tensor(first), "response_mask": torch.ones(B, 2),
               "attention_mask": torch.ones(B, 4), "scores": torch.ones(B)}
    for name in ("agent_turns", "agent_tool_calls", "agent_tool_errors", "agent_tool_timeouts", "agent_tool_seconds",
                 "env_reward", "agent_env_steps", "agent_retries", "agent_truncated", "agent_failed",
                 "agent_trajectory_breaks", "agent_environment_requests"):
        tensors[name] = torch.tensor(per_row.get(name, [0.0] * B), dtype=torch.float32)
    tensors["agent_failed"] = torch.tensor([float(bool(e)) for e in error])
    return Batch(tensors, {"uid": np.asarray(uid), "agent_error": np.asarray(error, dtype=object),
                           "agent_failure": np.asarray([PROGRAM if e else "" for e in error], dtype=object),
                           "agent_metrics": np.asarray([{} for _ in error], dtype=object)})


def test_the_failure_bound_counts_episodes_not_rows():
    batch = episodes([1, 4, 1, 4], [True, False, True, False])  # 2 of 4 episodes failed, in 10 rows
    with pytest.raises(AgentFailure, match="2 of 4 episodes failed"):
        EpisodeFailures(0.4).add(batch)
    under = EpisodeFailures(0.6)
    under.add(padded(episodes([1, 4, 1, 4], [True, False, True, False]), 8))
    assert under.episodes == 4 and under.failed == 2 and "2 of 4 episodes failed" in (under.line() or "")


@pytest.mark.filterwarnings("error")  # an agent job's log stays quiet (index_reduce printed torch's beta warning)
def test_episode_metrics_are_per_episode():
    # two episodes of 3 rows (one call each, the reward on every row, the second truncated on two rows), one of 1
    batch = episodes([3, 3, 1], [False, False, False], agent_turns=[1.0] * 7, env_reward=[1.0] * 3 + [0.0] * 4,
                     agent_truncated=[0, 1, 1, 0, 0, 0, 0], agent_tool_calls=[0, 0, 0, 1, 1, 0, 0])
    stats = episode_stats(padded(batch, 4))
    assert stats["agent_turns_mean"] == pytest.approx(7 / 3)  # its rows' calls, per episode
    assert stats["agent_env_reward_mean"] == pytest.approx(1 / 3)  # each episode once
    assert stats["agent_episodes_truncated"] == 1
    assert stats["agent_tool_calls_mean"] == pytest.approx(2 / 3) and stats["agent_tool_call_rate"] == pytest.approx(
        1 / 3)


def test_padding_is_spread_so_every_rank_trains_real_rows():
    batch = episodes([1] * 9, [False] * 9)  # 9 rows (uid 0 0 1 1 2 2 3 3 4) over 8 ranks: 16 rows
    out = padded(batch, 8)
    pad = is_padding(out)
    assert len(out) == 16 and pad.sum() == 7
    for ranks in (1, 2, 4, 8, 16):
        real = [int((~p).sum()) for p in np.split(pad, ranks)]
        assert max(real) - min(real) <= 1 and sum(real) == 9, (ranks, real)
    assert out.index(~pad)["uid"].tolist() == batch["uid"].tolist()
    assert [g["uid"].tolist() for g in prompt_groups(out)] == [[0, 0], [1, 1], [2, 2], [3, 3], [4]]
    assert spread(3, 3).all() and not spread(0, 4).any()


def test_the_divisor_counts_only_the_roles_that_take_the_batch():
    roles = {"actor": SimpleNamespace(dp_sizes={"train": 4}), "reference": SimpleNamespace(dp_sizes={"train": 2}),
             "rollout": SimpleNamespace(dp_sizes={"rollout": 3}), "judge": SimpleNamespace(dp_sizes={"train": 5})}
    assert dp_divisor(roles) == 4


def test_the_step_statistics_and_the_rollout_log_leave_the_padding_out():
    from hybridflow.trainer.step import rollout_records

    batch = Batch({"prompts": torch.ones(3, 2, dtype=torch.long), "responses": torch.ones(3, 2, dtype=torch.long),
                   "response_mask": torch.tensor([[1, 1], [1, 0], [1, 1]]), "attention_mask": torch.ones(3, 4),
                   "scores": torch.tensor([1.0, 0.5, 1.0])}, {"uid": np.asarray([0, 0, 1])})
    out = padded(batch, 4)
    real = iter([0, 1, 2])
    out.meta.update(trainer_version=3, staleness=[9 if p else next(real) for p in is_padding(out)])  # per row
    recs = rollout_records(out)
    assert [r["uid"] for r in recs] == [0, 0, 1] and [r["score"] for r in recs] == [1.0, 0.5, 1.0]
    assert [r["staleness"] for r in recs] == [0, 1, 2]
    step = _step()
    step.trained = out
    stats = step.summary()
    assert stats["reward_mean"] == pytest.approx(2.5 / 3) and stats["response_length_mean"] == pytest.approx(5 / 3)
    assert stats["tokens"] == 12


def _step():
    from hybridflow.api import JobSpec
    from hybridflow.trainer.generation.rollouts import Rollouts
    from hybridflow.trainer.generation.weight_sync import ColocatedWeightSync
    from hybridflow.trainer.step import AlgorithmState, Step, generation_rows, skipped_stages

    spec = JobSpec.model_validate({"algorithm": {"name": "grpo"}, "models": {"actor": {"source": "smollm2"}},
                                   "data": {"task": "arithmetic"}})
    rollouts = Rollouts(spec, None, ColocatedWeightSync(None), lambda: Batch(), generation_rows)
    return Step(spec, {"actor": SimpleNamespace(dp_sizes={"train": 4})}, {}, {}, AlgorithmState.for_spec(spec),
                rollouts, skipped_stages(spec))
