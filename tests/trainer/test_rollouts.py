"""The pure parts of asynchronous rollout (trainer/trajectories.py): the staleness rule, a partial rollout's
tokens and versions as the engine calls add them, and the batch finished trajectories become. Fast, no Ray."""
import typing

import pytest
import torch

from hybridflow.api.schema import Rollout
from hybridflow.trainer.generation.rollouts import ROLLOUT_MODES, _padded
from hybridflow.trainer.generation.trajectories import (
    Trajectory, oldest_versions, pack_trajectories, staleness, too_stale,
)
from hybridflow.data.packing import versions_of


def test_every_mode_the_spec_names_has_a_source():
    assert set(ROLLOUT_MODES) == set(typing.get_args(Rollout.model_fields["mode"].annotation))


@pytest.mark.parametrize("trainer,oldest,bound,stale", [(5, 3, 2, False), (5, 2, 2, True), (5, 5, 0, False),
                                                        (5, 4, 0, True), (0, 0, 0, False)])
def test_a_trajectory_is_too_stale_only_past_the_bound(trainer, oldest, bound, stale):
    assert staleness(trainer, oldest) == trainer - oldest
    assert too_stale(trainer, oldest, bound) is stale


def test_a_partial_rollout_keeps_each_tokens_version_and_knows_when_it_is_done():
    t = Trajectory({"prompt_ids": [1, 2], "uid": 7})
    t.advance([5, 6], [-0.1, -0.2], version=3, asked=2, max_len=6, stop_ids=(0,))
    assert not t.done and t.versions == [3, 3]
    t.advance([7, 8], [-0.3, -0.4], version=4, asked=2, max_len=6, stop_ids=(0,))  # new weights arrived
    assert not t.done and t.versions == [3, 3, 4, 4] and t.oldest_version == 3
    t.advance([9], [-0.5], version=4, asked=2, max_len=6, stop_ids=(0,))  # fewer than asked: the engine stopped
    assert t.done and t.tokens == [5, 6, 7, 8, 9]
    stopped = Trajectory({"prompt_ids": [1]})
    stopped.advance([4, 0], [-1.0, -1.0], version=0, asked=2, max_len=6, stop_ids=(0,))
    assert stopped.done  # ended on a stop token
    full = Trajectory({"prompt_ids": [1]})
    full.advance([4, 4], [], version=1, asked=2, max_len=2, stop_ids=(0,))
    assert full.done and full.log_probs == [0.0, 0.0]  # reached maxResponseLength; no log-probs asked for


def test_finished_trajectories_pack_like_a_generation_with_each_tokens_version():
    a, b = Trajectory({"prompt_ids": [3, 4], "uid": 1}), Trajectory({"prompt_ids": [5], "uid": 1})
    a.advance([6, 7, 8], [-0.1, -0.2, -0.3], 2, 3, 4, ())
    a.advance([9], [-0.4], 3, 1, 4, ())
    b.advance([1], [-0.5], 3, 3, 4, ())
    batch = pack_trajectories([a, b], prompt_width=3, response_width=4)
    assert batch["responses"].tolist() == [[6, 7, 8, 9], [1, 0, 0, 0]]
    assert batch["token_versions"].tolist() == [[2, 2, 2, 3], [3, -1, -1, -1]]
    assert batch["rollout_log_probs"][0].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert list(batch["uid"]) == [1, 1] and [list(p) for p in batch["prompt_ids"]] == [[3, 4], [5]]
    assert oldest_versions(batch).tolist() == [2, 3]


def test_a_batch_made_by_one_version_is_tagged_with_it_on_its_response_tokens():
    batch = pack_trajectories([Trajectory({"prompt_ids": [1]}, [2, 3], [0.0, 0.0], [0, 0], True)], 2, 3)
    tagged = versions_of(batch["response_mask"], 7)
    assert tagged.tolist() == [[7, 7, -1]]
    assert oldest_versions(batch.with_columns(token_versions=torch.tensor([[-1, -1, -1]]))).tolist() == [0]


@pytest.mark.parametrize("n,ranks,want", [(3, 2, 4), (1, 4, 4), (4, 4, 4), (5, 3, 6), (0, 2, 0)])
def test_a_partial_rollout_call_is_padded_to_split_evenly_over_the_ranks(n, ranks, want):
    """Unfinished responses fewer than (or not a multiple of) the rollout ranks still advance: the call repeats
    rows up to a multiple, and the first n results are the rows' own."""
    rows = list(range(n))
    padded = _padded(rows, ranks)
    assert len(padded) == want and padded[:n] == rows and set(padded) == set(rows)


def test_dropping_stale_groups_wakes_a_producer_waiting_for_room():
    """The trainer dropping stale groups frees room in the queue: a producer waiting for room starts at once, not at
    its next 0.5 s poll (a lost wake-up: with every queued group stale, trainer and producer both waited it out)."""
    import collections
    import threading
    import time
    from types import SimpleNamespace

    from hybridflow.trainer.generation.rollouts import AsyncRollouts

    q = AsyncRollouts.__new__(AsyncRollouts)  # just the queue's state: no Ray, no engine
    q._cond, q.spec = threading.Condition(), SimpleNamespace(rollout=SimpleNamespace(max_staleness=1))
    q.weights, q.dropped = SimpleNamespace(version=3), 0
    stale = pack_trajectories([Trajectory({"prompt_ids": [1]}, [2], [0.0], [1], True)], 1, 1)  # version 1: 2 behind
    q.ready = collections.deque([stale, stale])
    waiting, woke = threading.Event(), []

    def producer() -> None:
        with q._cond:
            waiting.set()
            q._cond.wait(5.0)  # the lock is released only once it waits: the drop below cannot come before
            woke.append(time.perf_counter())

    t = threading.Thread(target=producer)
    t.start()
    waiting.wait(5.0)
    t0 = time.perf_counter()
    with q._cond:
        q._drop_stale()
    t.join(10.0)
    assert q.dropped == 2 and not q.ready
    assert woke and woke[0] - t0 < 2.0, "the producer slept through the drop"
