"""WorkerGroups on a real local Ray: transfer protocols, futures passed between groups, colocation, torch.distributed."""
import os
import time

import pytest
import ray
import torch
import torch.distributed as dist

from hybridflow.single_controller.allocator import worker_allocator_env
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.failures import RankFailure, rank_failure
from hybridflow.single_controller.protocol import Dispatch, DPRank, register
from hybridflow.single_controller.resource_pool import RayResourcePool
from hybridflow.single_controller.worker_group import PendingResult, RoleSpec, WorkerGroup

pytestmark = pytest.mark.slow


class Echo:
    def __init__(self, ctx, tag):
        self.ctx, self.tag = ctx, tag

    @register(Dispatch.ONE_TO_ALL)
    def info(self):
        return self.ctx.rank, self.ctx.world_size, os.getpid(), self.tag

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, x):
        return x * (self.ctx.rank + 1)

    @register(Dispatch.RANK_ZERO)
    def all_reduce(self, v):
        t = torch.tensor([float(v) * (self.ctx.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(seconds)
        return self.ctx.rank

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def produce(self, batch):
        n = len(batch)
        return Batch({"x": batch["x"] * 2, "producer": torch.full((n,), self.ctx.rank)})

    @register(Dispatch.DP_COMPUTE)
    def consume(self, batch):
        return Batch({"x": batch["x"] + 1, "producer": batch["producer"],
                      "consumer": torch.full((len(batch),), self.ctx.rank)})

    def not_registered(self):
        return 1


class TensorParallelPair(Echo):
    """Two ranks per data shard when training (as under TP=2): only the first of each pair returns data. Every rank
    is its own replica when generating (as under t_g=1), so generation has twice the data-parallel size."""

    def dp_rank(self, mesh):
        if mesh == "rollout":
            return DPRank(self.ctx.rank, self.ctx.world_size, True)
        return DPRank(self.ctx.rank // 2, self.ctx.world_size // 2, self.ctx.rank % 2 == 0)

    @register(Dispatch.DP_COMPUTE)
    def consume(self, batch):
        return Batch({"x": batch["x"], "consumer": torch.full((len(batch),), self.ctx.rank)})

    @register(Dispatch.DP_COMPUTE, blocking=False, mesh="rollout")
    def generate(self, batch):
        return Batch({"x": batch["x"], "generator": torch.full((len(batch),), self.ctx.rank)})


class Sibling:
    """Built after role "a" in the same processes and handed a's object (RoleSpec.colocated), as the rollout role
    is handed the actor."""

    def __init__(self, ctx, a):
        self.ctx, self.a = ctx, a

    @register(Dispatch.ONE_TO_ALL)
    def sibling(self):
        return self.a.tag, os.getpid(), self.a.ctx is self.ctx


@pytest.fixture(scope="module")
def pools(shared_ray):
    """Two pools in the tests' shared local Ray (conftest), which has room for both at once."""
    import sys

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    p1 = RayResourcePool("p1", nodes=1, devices_per_node=2, cpus_per_device=0.5)
    p2 = RayResourcePool("p2", nodes=2, devices_per_node=2, cpus_per_device=0.5)  # two "nodes" (placement groups)
    shared_ray.ensure_running()
    shared_ray.check_room([p1, p2])
    return p1, p2


@pytest.fixture(scope="module")
def groups(pools):
    p1, p2 = pools
    g1 = WorkerGroup(p1, {"a": RoleSpec(Echo, {"tag": "a"}), "b": RoleSpec(Echo, {"tag": "b"}),
                          "c": RoleSpec(Sibling, colocated=("a",))},
                     process_env=worker_allocator_env("tcmalloc", "p1"))  # `make install-tools` installs it
    g2 = WorkerGroup(p2, {"tp": RoleSpec(TensorParallelPair, {"tag": "tp"})})
    yield g1, g2
    for g in (g1, g2):
        g.shutdown()
        g.pool.release()


def test_one_to_all_and_colocation(groups):
    g1, _ = groups
    a, b = g1["a"].info(), g1["b"].info()
    assert [(r, w, t) for r, w, _, t in a] == [(0, 2, "a"), (1, 2, "a")]
    assert [x[2] for x in a] == [x[2] for x in b], "colocated roles must share one process per device"
    assert len({x[2] for x in a}) == 2


def test_a_colocated_role_is_handed_the_role_built_before_it_in_its_process(groups):
    g1, _ = groups
    got = g1["c"].sibling()
    assert [(tag, same_host) for tag, _, same_host in got] == [("a", True), ("a", True)]
    assert [pid for _, pid, _ in got] == [x[2] for x in g1["a"].info()]


def test_a_pools_allocator_serves_its_worker_processes_from_their_start(groups):
    """LD_PRELOAD reaches the process through Ray's runtime_env: tcmalloc is mapped into p1's workers (its malloc
    serves every allocation since the process started), and p2's, which asked for nothing, run on glibc's."""
    g1, g2 = groups
    assert g1.allocators() == ["tcmalloc", "tcmalloc"]
    assert g2.allocators() == ["system"] * 4


def test_all_to_all_and_rank_zero(groups):
    g1, _ = groups
    assert g1["a"].scale([10, 20]) == [10, 40]
    with pytest.raises(ValueError, match="one argument per rank"):
        g1["a"].scale([1, 2, 3])
    assert g1["a"].all_reduce(1.0) == 3.0  # 1*1 + 1*2 over gloo


def test_the_controller_waits_for_answers_as_long_as_the_groups_call_timeout_says_now(groups):
    """A gang's start-up (a checkpoint's load) is allowed longer than a step (trainer.setup.Workers.first_step_done
    lowers the bound after the first step): the wait for a call's answers is read at each call, not fixed when the
    group formed; the ranks' collectives keep the group's own timeout."""
    g1, _ = groups
    before = g1.call_timeout_s
    try:
        g1.call_timeout_s = 0.5
        with pytest.raises(RankFailure, match=r"a\.nap.*did not answer"):
            g1["a"].nap(3.0)
        g1.call_timeout_s = 60.0
        assert g1["a"].nap(1.0) == [0, 1]  # (queued behind the nap that was given up on)
    finally:
        g1.call_timeout_s = before


def test_unregistered_method_is_refused(groups):
    with pytest.raises(AttributeError, match="not a registered worker method"):
        groups[0]["a"].not_registered


def test_dp_compute_splits_and_gathers_in_order(groups):
    g1, _ = groups
    pending = g1["a"].produce(Batch({"x": torch.arange(8)}))
    assert isinstance(pending, PendingResult)
    out = pending.get()
    assert out["x"].tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    assert out["producer"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_futures_pass_between_roles_without_the_controller(groups, monkeypatch):
    g1, _ = groups
    pending = g1["a"].produce(Batch({"x": torch.arange(6)}))

    def forbidden(self):
        raise AssertionError("the controller fetched data it should have handed over as futures")

    monkeypatch.setattr(PendingResult, "get", forbidden)
    refs = g1["b"]._dispatch("consume", Dispatch.DP_COMPUTE, "train", (pending,), {})
    monkeypatch.undo()
    out = refs.get()
    assert out["x"].tolist() == [1, 3, 5, 7, 9, 11]
    assert out["producer"].tolist() == out["consumer"].tolist()  # each rank got its own shard back


def test_three_d_layout_only_collectors_return(groups):
    _, g2 = groups
    assert g2["tp"].dp_size == 2
    out = g2["tp"].consume(Batch({"x": torch.arange(4)}))
    assert out["x"].tolist() == [0, 1, 2, 3]
    assert out["consumer"].tolist() == [0, 0, 2, 2]  # rank 0 owns dp 0, rank 2 owns dp 1


def test_futures_cross_groups_with_different_layouts(groups):
    g1, g2 = groups
    pending = g1["a"].produce(Batch({"x": torch.arange(4)}))
    out = g2["tp"].consume(pending)  # dp sizes match (2): handed over per DP rank
    assert out["x"].tolist() == [0, 2, 4, 6]


def test_rollout_mesh_splits_wider_and_train_mesh_resplits(groups):
    _, g2 = groups
    assert g2["tp"].dp_sizes == {"train": 2, "rollout": 4}
    gen = g2["tp"].generate(Batch({"x": torch.arange(8)}))
    assert len(gen.dp_refs) == 4  # every rank generated a quarter
    out = g2["tp"].consume(gen)  # 4 generation shards -> 2 training shards, order kept
    assert gen.get()["generator"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out["x"].tolist() == list(range(8))
    assert out["consumer"].tolist() == [0, 0, 0, 0, 2, 2, 2, 2]


@ray.remote(num_cpus=0)
class _Rank:
    """One rank of a call, as far as failures go: its part fails with an error of its own, or waits."""

    def fail(self):
        raise RuntimeError("rank 0: the stream broke off")  # a plain error: no cause comes with it across Ray

    def wait(self):
        time.sleep(600)


def test_a_call_is_a_worker_loss_when_a_later_rank_died_though_an_earlier_one_failed_first(pools):
    """Ray raises a call's errors in rank order, so a survivor's own error (its part could not finish without the
    lost rank) may be the one raised, before the lost rank's death is even known (a lost pod: its node's heartbeats
    must run out first). The call is still a worker loss that names both; a job's own error, the other ranks still
    busy, stays what it was (a busy rank is not taken for a silent one)."""
    survivor, lost, busy = _Rank.remote(), _Rank.remote(), _Rank.remote()
    try:
        refs = [survivor.fail.remote(), lost.wait.remote()]
        with pytest.raises(RuntimeError) as first:
            ray.get(refs[0])
        ray.kill(lost, no_restart=True)
        failure = rank_failure("rollout.sync_weights", refs, ["rank 0", "rank 1"], first.value, settle_s=30)
        assert isinstance(failure, RankFailure), failure
        assert (failure.dead, failure.silent, failure.failed) == (["rank 1"], [], ["rank 0"]), str(failure)

        refs = [survivor.fail.remote(), busy.wait.remote()]
        with pytest.raises(RuntimeError) as own:
            ray.get(refs[0])
        assert rank_failure("actor.update_actor", refs, ["rank 0", "rank 1"], own.value, settle_s=1) is own.value
    finally:
        for a in (survivor, lost, busy):
            ray.kill(a, no_restart=True)
