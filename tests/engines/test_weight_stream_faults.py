"""The weight stream's failures on the NCCL path, decided on the CPU (issue 50, item 6): what a timed-out or failed
wait does to the stream (engines.bridge.stream: abort the group once, mark the side broken, raise the named error),
how the NCCL group is built (so its watchdog cannot take a trainer rank down), and the controller forming the group
again before the next sync (trainer.weight_sync). The faults are injected: a group whose Work.wait raises NCCL's
timeout (DistBackendError) or whose start raises, and a real two-rank gloo group, in threads of this process,
whose sender stalls past the timeout; a rebuilt group then carries the next version. Seconds, no spawn."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from hybridflow.engines.bridge import stream as ws
from hybridflow.single_controller.worker_group import PendingResult

NCCL_TIMEOUT = ("[PG ID 1 PG GUID 3 Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4, "
                "OpType=BROADCAST, NumelIn=6, NumelOut=6, Timeout(ms)=2000) ran for 2001 milliseconds before timing "
                "out.")
PEERS = ["trainer rank 0", "rollout rank 3", "rollout rank 5"]


def _model(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"embed.weight": torch.randn(8, 8, generator=g), "norm.weight": torch.randn(8, generator=g),
            "big.weight": torch.randn(32, 32, generator=g)}


class _Work:
    """A Work whose wait either returns or raises what NCCL's WorkNCCL::wait raises on a timeout."""

    def __init__(self, error: BaseException | None) -> None:
        self.error, self.timeouts = error, []

    def wait(self, timeout: timedelta) -> bool:
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error
        return True


class _FaultyGroup:
    """A group of `size` ranks seen from rank `rank`, that fails operation number `fail_at` (counting every
    broadcast, send and recv started on it) at its wait, or at its start with `at_start`; the operations before it
    succeed and, for a receiver, deliver what `feed` gives. Records every abort."""

    def __init__(self, rank: int, size: int, fail_at: int, error: BaseException, at_start: bool = False,
                 feed: Callable[[int, torch.Tensor], None] | None = None, abort_raises: bool = False) -> None:
        self._rank, self._size, self.fail_at, self.error, self.at_start = rank, size, fail_at, error, at_start
        self.feed, self.abort_raises = feed, abort_raises
        self.ops, self.aborts, self.works = 0, 0, []

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _op(self, tensor: torch.Tensor) -> _Work:
        n, self.ops = self.ops, self.ops + 1
        if n == self.fail_at and self.at_start:
            raise self.error
        if n != self.fail_at and self.feed is not None:
            self.feed(n, tensor)
        work = _Work(self.error if n == self.fail_at else None)
        self.works.append(work)
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        return self._op(tensors[0])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        return self._op(tensors[0])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        return self._op(tensors[0])

    def abort(self) -> None:
        self.aborts += 1
        if self.abort_raises:
            raise dist.DistBackendError("ProcessGroup abort timed out after 4000 ms")


def _receive_all(receiver: ws.WeightReceiver) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}

    def load(stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in stream:
            got[name] = tensor.clone()

    receiver.sync(load)
    return got


def test_an_nccl_timeout_at_a_receivers_wait_aborts_its_group_once_and_names_sender_version_and_bucket():
    """Rank 2 of the group (rollout rank 5) waits for the first preamble; its wait raises NCCL's timeout
    (DistBackendError): the group is aborted, the error is the stream's WeightStreamBroken (a peer that stopped:
    the controller's worker loss) naming the sender and what it did not send, with the stream's timeout; every
    wait was given that timeout. A later sync on the same stream raises at once, starts nothing and aborts nothing
    again: the group is aborted, and the caller forms a new one."""
    group = _FaultyGroup(rank=2, size=3, fail_at=0, error=dist.DistBackendError(NCCL_TIMEOUT))
    receiver = ws.WeightReceiver(group, src=0, timeout_s=2.0, peers=PEERS)
    with pytest.raises(ws.WeightStreamBroken) as err:
        _receive_all(receiver)
    assert str(err.value).startswith("rollout rank 5: sender trainer rank 0 did not send bucket 0 of the next "
                                     "version (stream timeout 2 s): "), err.value
    assert "Watchdog caught collective operation timeout" in str(err.value)
    assert group.aborts == 1 and receiver.broken is not None
    assert [w.timeouts for w in group.works] == [[timedelta(seconds=2.0)]]
    with pytest.raises(ws.WeightStreamBroken, match="broke earlier and its group was aborted; form a new one"):
        _receive_all(receiver)
    assert group.ops == 1 and group.aborts == 1


@pytest.mark.parametrize("at_start", [False, True], ids=["at-the-wait", "at-the-start"])
def test_a_senders_failure_mid_version_aborts_its_group_and_names_the_receivers_version_and_bucket(at_start):
    """The sender fails on bucket 1's preamble (operation 3: bucket 0 is a preamble, a header and a payload), at
    the wait (a timeout) or already at the start (NCCL raises there once its communicator is aborted or has
    failed): the group is aborted once, the error names the receivers, the version and the bucket, and the sender
    refuses the next version until its group is formed again."""
    group = _FaultyGroup(rank=0, size=3, fail_at=3, at_start=at_start,
                         error=dist.DistBackendError("NCCL communicator was aborted on rank 0"))
    sender = ws.WeightSender(group, bucket_bytes=512, timeout_s=2.0, peers=PEERS)
    with pytest.raises(ws.WeightStreamBroken) as err:
        sender.send(4, iter(_model(4).items()))
    assert str(err.value).startswith("trainer rank 0: receivers rollout rank 3, rollout rank 5 did not take bucket 1 "
                                     "of policy version 4 (stream timeout 2 s)"), err.value
    assert group.aborts == 1 and sender.version is None
    with pytest.raises(ws.WeightStreamBroken, match="broke earlier"):
        sender.send(5, iter(_model(5).items()))
    assert group.aborts == 1 and group.ops == 4  # bucket 1's preamble was the last operation started


def test_a_failed_abort_does_not_hide_the_streams_error():
    """NCCL's abort is itself bounded (by the group's timeout) and raises past it: the stream's named error is what
    the caller gets, the stream broken all the same."""
    group = _FaultyGroup(rank=1, size=2, fail_at=0, error=dist.DistBackendError(NCCL_TIMEOUT), abort_raises=True)
    receiver = ws.WeightReceiver(group, src=0, timeout_s=2.0)
    with pytest.raises(ws.WeightStreamBroken, match=r"^rank 1: sender rank 0 did not send bucket 0"):
        _receive_all(receiver)
    assert group.aborts == 1 and receiver.broken is not None


def test_a_desynchronised_stream_aborts_the_group_too():
    """A preamble that is not the stream's (the sender and this receiver out of step: no wait failed) is a
    WeightStreamError, not a lost peer, and it breaks the stream as well: the next broadcast would pair with the
    wrong one."""
    def feed(n: int, t: torch.Tensor) -> None:
        t.copy_(torch.tensor([0x1234, 1, 0, 10, 10, 1]))

    group = _FaultyGroup(rank=1, size=2, fail_at=-1, error=RuntimeError("unused"), feed=feed)
    receiver = ws.WeightReceiver(group, src=0, timeout_s=2.0)
    with pytest.raises(ws.WeightStreamError, match="is not a weight stream preamble") as err:
        _receive_all(receiver)
    assert not isinstance(err.value, ws.WeightStreamBroken)
    assert group.aborts == 1 and receiver.broken is not None


def test_the_nccl_group_is_built_so_its_watchdog_cannot_take_the_process_down(monkeypatch):
    """ProcessGroupNCCL reads TORCH_NCCL_ASYNC_ERROR_HANDLING and its siblings in its constructor: stream_group
    builds it with NoHandling (no rethrow on the watchdog's thread, which terminates the process), no dump or
    remote-error signals, and a timeout of its own NCCL_WATCHDOG_FACTOR times the stream's (the stream's wait sees
    a stall first and aborts the group); the process's environment is as it was afterwards, for the pools' own
    groups. The CPU build has no ProcessGroupNCCL: a stand-in records what the constructor would read."""
    seen: dict[str, Any] = {}

    class Options:
        def __init__(self) -> None:
            self._timeout = timedelta(minutes=10)

    class FakeNCCL:
        def __init__(self, store: Any, rank: int, size: int, opts: Options) -> None:
            seen.update(env={k: os.environ.get(k) for k in ws.NCCL_STREAM_ENV}, rank=rank, size=size,
                        timeout=opts._timeout)

    FakeNCCL.Options = Options  # type: ignore[attr-defined]
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the pool's setting, if it had one
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    group = ws.stream_group(dist.HashStore(), 1, 3, timeout_s=30.0, device="cuda:0")
    assert isinstance(group, FakeNCCL)
    assert seen["env"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                           "TORCH_NCCL_PROPAGATE_ERROR": "0"}
    assert seen["timeout"] == timedelta(seconds=30.0 * ws.NCCL_WATCHDOG_FACTOR) > timedelta(seconds=30.0)
    assert (seen["rank"], seen["size"]) == (1, 3)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ


@contextlib.contextmanager
def _aborts_counted(monkeypatch) -> Iterator[list[int]]:
    """Every ProcessGroupGloo.abort in the body, by the rank of the group aborted (the real abort still runs)."""
    ranks: list[int] = []
    real = dist.ProcessGroupGloo.abort

    def abort(self: dist.ProcessGroupGloo) -> None:
        ranks.append(self.rank())
        real(self)

    monkeypatch.setattr(dist.ProcessGroupGloo, "abort", abort)
    yield ranks


def _two_ranks(prefix: str, timeout_s: float, body: Callable[[int, dist.ProcessGroup], Any]) -> dict[int, Any]:
    """`body(rank, group)` on each rank of a real two-rank gloo stream group, one thread each: what each returned,
    or the exception it raised."""
    store = dist.PrefixStore(prefix, dist.HashStore())
    out: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank, ws.stream_group(store, rank, 2, timeout_s=timeout_s))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a stream rank hung"
    return out


def test_a_stalled_sender_on_gloo_breaks_both_sides_and_a_group_formed_again_carries_the_next_version(monkeypatch):
    """A real gloo group: version 1 goes through; during version 2 the sender sleeps past the stream's timeout
    after bucket 0 (alive, sockets open). The receiver raises naming the sender, version 2 and bucket 1, and aborts
    its group; the sender, awake, finds no ack and raises naming the receiver, and aborts its own. A group formed
    again over the same ranks (what the controller does before the next sync) carries version 3 bit for bit."""
    timeout_s, model = 1.0, {v: _model(v) for v in (1, 2, 3)}

    def first(rank: int, group: dist.ProcessGroup) -> Any:
        if rank == 0:
            sender = ws.WeightSender(group, bucket_bytes=512, timeout_s=timeout_s, peers=PEERS[:2])
            sender.send(1, iter(model[1].items()))
            nap = lambda i: time.sleep(timeout_s + 1.0) if i == 0 else None  # noqa: E731
            try:
                sender.send(2, iter(model[2].items()), on_bucket=nap)
            except ws.WeightStreamError as e:
                return e, sender.broken
            return None, sender.broken
        receiver = ws.WeightReceiver(group, src=0, timeout_s=timeout_s, peers=PEERS[:2])
        got1 = _receive_all(receiver)
        t0 = time.monotonic()
        try:
            _receive_all(receiver)
        except ws.WeightStreamError as e:
            return got1, e, time.monotonic() - t0, receiver.broken
        return got1, None, time.monotonic() - t0, receiver.broken

    with _aborts_counted(monkeypatch) as aborted:
        out = _two_ranks("first", timeout_s, first)
        got1, err, took, broken = out[1]
        assert all(torch.equal(got1[n], t) for n, t in model[1].items())
        assert isinstance(err, ws.WeightStreamBroken), out
        assert str(err).startswith(f"rollout rank 3: sender trainer rank 0 did not send bucket 1 of policy version 2 "
                                   f"(stream timeout {timeout_s:g} s)"), err
        assert 0.9 * timeout_s <= took < timeout_s + 10 and broken is not None
        sender_err, sender_broken = out[0]
        assert isinstance(sender_err, ws.WeightStreamBroken), out
        assert "rollout rank 3 did not" in str(sender_err) and "policy version 2" in str(sender_err), sender_err
        assert sender_broken is not None
        assert sorted(aborted) == [0, 1]  # each side aborted its own group, once

        def again(rank: int, group: dist.ProcessGroup) -> Any:
            if rank == 0:
                return ws.WeightSender(group, bucket_bytes=512, timeout_s=timeout_s, peers=PEERS[:2]).send(
                    3, iter(model[3].items()))
            return _receive_all(ws.WeightReceiver(group, src=0, timeout_s=timeout_s, peers=PEERS[:2]))

        out = _two_ranks("again", timeout_s, again)
        assert isinstance(out[0], ws.SyncStats) and out[0].version == 3, out
        assert list(out[1]) == list(model[3]) and all(torch.equal(out[1][n], t) for n, t in model[3].items())
        assert sorted(aborted) == [0, 1]  # the new group: nothing aborted


class _Pending(PendingResult):
    """A call in flight as StreamedWeightSync sees one (worker_group.PendingResult), answered at once."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.refs, self.method, self.where, self.timeout_s = [], "call", [], None
        self.value, self.error = value, error

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Actor:
    def __init__(self) -> None:
        self.opened: list[int] = []

    def open_weight_stream(self, size: int, timeout_s: float) -> tuple[str, int]:
        self.opened.append(size)
        return "127.0.0.1", 1000 + len(self.opened)

    def join_weight_stream(self, members: list[int], timeout_s: float) -> None:
        return None

    def send_weights(self, version: int, dtype: str) -> _Pending:
        return _Pending([{"seconds": 0.1, "bytes": 0.0, "peak_bytes": 64.0}])


class _Replicas:
    """The rollout replicas as StreamedWeightSync uses them (trainer.generation.replicas.RolloutReplicas): two
    replicas, none lost; the first `breaks` syncs fail with the stream broken (a stall, an NCCL error)."""

    def __init__(self, breaks: int) -> None:
        self.breaks, self.joins, self.syncs = breaks, [], []
        self.role = self.failures = self  # its failure policy too (lost_in)
        self.call = self  # its handle as the rollout role's Protocol (RoleHandle.call)

    def generation_dtype_name(self) -> str:
        return "float32"

    def members(self) -> list[int]:
        return [0, 1]

    @contextlib.contextmanager
    def claimed(self, joining_too: bool = False) -> Iterator[list[int]]:
        yield [0, 1]

    def handle(self, ranks: list[int]) -> "_Replicas":
        return self

    def join_weight_stream(self, host: str, port: int, members: list[int], timeout_s: float) -> list[int]:
        self.joins.append(port)
        return [0, 0]

    def sync_weights(self, version: int) -> _Pending:
        self.syncs.append(version)
        if self.breaks:
            self.breaks -= 1
            return _Pending(error=ws.WeightStreamBroken(
                f"rollout rank 1: sender trainer rank 0 did not send bucket 2 of policy version {version} (stream "
                f"timeout 2 s): {NCCL_TIMEOUT} [waiting for policy version {version}]"))
        row = {"seconds": 0.2, "bytes": 100.0, "peak_bytes": 50.0, "generation_bytes": 100.0, "version": version}
        return _Pending([row, row])

    def lost_in(self, err: BaseException, refs: list[Any], timeout_s: float) -> list[int]:
        return []  # every replica answers: none lost

    def joining_now(self) -> list[int]:
        return []


def test_a_broken_stream_is_formed_again_before_the_next_sync_which_carries_the_next_version():
    """The controller's side: a sync whose stream broke with no replica lost raises the receivers' named error (the
    peer, the version, the bucket), and the next sync forms the group anew (a new rendezvous, every replica joining
    it, as after a lost replica) and carries the next version; a sync that went through forms nothing."""
    from hybridflow.trainer.generation.weight_sync import StreamedWeightSync

    actor, replicas = _Actor(), _Replicas(breaks=1)
    sync = StreamedWeightSync(actor, replicas, timeout_s=2.0)  # type: ignore[arg-type]
    assert actor.opened == [3] and replicas.joins == [1001]
    with pytest.raises(ws.WeightStreamBroken, match="did not send bucket 2 of policy version 1"):
        sync.sync(1)
    assert sync.version == 0 and actor.opened == [3]  # not retried at once: the error is what the step sees
    stats = sync.sync(2)
    assert actor.opened == [3, 3] and replicas.joins == [1001, 1002]  # formed again, over the same replicas
    assert sync.version == 2 and stats["rollout_policy_version"] == 2.0 and replicas.syncs == [1, 2]
    sync.sync(3)
    assert actor.opened == [3, 3] and replicas.syncs == [1, 2, 3]
