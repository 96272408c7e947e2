"""The cross-pool weight stream (hybridflow.engines.bridge.stream), on one spawn of three gloo ranks: rank 0 sends
(a trainer rank holding whole tensors), ranks 1 and 2 receive (two rollout replicas). One spawn runs every
scenario in order (the good syncs, a stalled sender on a group of its own, the killed sender last): process start
and the torch import cost seconds, a scenario milliseconds. The tests read what each rank wrote."""
from __future__ import annotations

import gc
import json
import os
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

TIMEOUT_S = 3.0  # the stream's timeout here: a killed sender must be named well within TIMEOUT_S + margin
BUCKET = 4096  # bytes: the mixed model below cuts into several buckets, one tensor bigger than a bucket
VERSIONS = [1, 2, 5]  # increasing, not consecutive: the receiver records what was sent, it does not count
KILLED_VERSION, KILLED_AFTER_BUCKET = 9, 1
SLACK = 512  # bytes beyond the bucket a measurement may see: a few preambles and headers a finished Work still holds
STALLED_VERSION, STALL_TIMEOUT_S = 7, 1.0  # a short timeout of its own: the stall test waits for it to pass
SHAPES = {  # name -> (shape, dtype): fp32 and bf16 runs, small ones coalesced, "big" alone (16 KB > BUCKET)
    "embed.weight": ((16, 16), torch.float32), "embed.bias": ((8,), torch.float32),
    "layers.0.w": ((32, 16), torch.bfloat16), "layers.0.b": ((16,), torch.bfloat16),
    "big.weight": ((64, 64), torch.float32),
    "layers.1.w": ((16, 32), torch.float32), "layers.1.u": ((24, 16), torch.float32),
    "norm.weight": ((16, 16), torch.float32),
}


def _model(version: int) -> dict[str, torch.Tensor]:
    """Different weights for every version, the same on every rank that asks."""
    g = torch.Generator().manual_seed(version)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in SHAPES.items()}


def _sums(model: dict[str, torch.Tensor]) -> dict[str, list]:
    return {n: [float(t.double().sum()), list(t.shape), str(t.dtype)] for n, t in model.items()}


def _live_bytes() -> int:
    """Bytes of every tensor storage this process holds (each storage once): what the stream holds is what this
    grows by beyond the tensors the test itself keeps."""
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # not isinstance: that reads __class__, deprecated on some
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _nbytes(model: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in model.values())


def _send(sender, out: dict) -> None:
    for v in VERSIONS:
        model = _model(v)
        peak = 0
        base = _live_bytes() - _nbytes(model)  # before the stream; the model is the sender's own tensors

        def measure(i: int) -> None:
            nonlocal peak
            if v == VERSIONS[0]:
                peak = max(peak, _live_bytes() - base - _nbytes(model))

        stats = sender.send(v, iter(model.items()), on_bucket=measure)
        out["syncs"].append({"sums": _sums(model), "stats": vars(stats), "measured_peak": peak})
    try:
        sender.send(VERSIONS[-1], iter(_model(1).items()))
    except ValueError as e:
        out["stale_version"] = str(e)


def _receive(receiver, out: dict) -> None:
    for v in VERSIONS:
        got: dict[str, torch.Tensor] = {}
        peak = 0
        base = _live_bytes()

        def load(stream: Iterator[tuple[str, torch.Tensor]]) -> None:  # a load_weights: copies as they come
            nonlocal peak
            for name, tensor in stream:
                if v == VERSIONS[0]:
                    peak = max(peak, _live_bytes() - base - _nbytes(got))
                got[name] = tensor.clone()

        stats = receiver.sync(load)
        out["syncs"].append({"sums": _sums(got), "stats": vars(stats), "measured_peak": peak,
                             "version": receiver.version})


def _stall(rank: int, group, ws, out: dict) -> None:
    """Version STALLED_VERSION with the sender asleep between buckets for longer than the stream's timeout (alive,
    its sockets open: only the timeout can tell): the receivers raise naming it, then the sender, awake, finds
    they did not take the rest (or did not ack) and raises naming them. The group is left broken."""
    t0 = time.monotonic()
    try:
        if rank == 0:
            nap = lambda i: time.sleep(STALL_TIMEOUT_S + 1.0) if i == 0 else None  # noqa: E731
            ws.WeightSender(group, bucket_bytes=BUCKET, timeout_s=STALL_TIMEOUT_S).send(
                STALLED_VERSION, iter(_model(STALLED_VERSION).items()), on_bucket=nap)
        else:
            ws.WeightReceiver(group, src=0, timeout_s=STALL_TIMEOUT_S).sync(lambda s: [t.clone() for _, t in s])
        out["stalled"] = "no error"
    except ws.WeightStreamError as e:
        out["stalled"], out["stalled_type"] = str(e), type(e).__name__
    out["stalled_s"] = time.monotonic() - t0


def _rank(rank: int, store: str, outdir: str) -> None:
    """One rank: the good syncs, the stalled one, then version KILLED_VERSION, during which the sender SIGKILLs
    itself between buckets; each rank writes what it saw, what it raised and how long that took."""
    import torch.distributed as dist

    from hybridflow.engines.bridge import stream as ws

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)  # its barrier only
    # Three groups of their own, as a job's stream is (its ranks are in different pools' worlds), joined through
    # one rendezvous the sender serves, each under a prefix of its own.
    if rank == 0:
        rendezvous = ws.StreamRendezvous("127.0.0.1", 3)
        Path(store + ".tmp").write_text(str(rendezvous.port))
        os.replace(store + ".tmp", store + ".port")  # whole, or not there
        stores = rendezvous.store
    else:
        while not Path(store + ".port").exists():
            time.sleep(0.05)
        stores = ws.stream_store("127.0.0.1", int(Path(store + ".port").read_text()), 3)
    group, stalled, killed = (ws.stream_group(dist.PrefixStore(f"g{i}", stores), rank, 3, timeout_s=t)
                              for i, t in enumerate((TIMEOUT_S, STALL_TIMEOUT_S, TIMEOUT_S)))
    out: dict = {"syncs": []}
    path = Path(outdir) / f"rank{rank}.json"
    if rank == 0:
        _send(ws.WeightSender(group, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S), out)
        _stall(rank, stalled, ws, out)
        path.write_text(json.dumps(out))
        dist.barrier()  # on the default group: the receivers are out of the stalled sync

        def die(i: int) -> None:
            if i == KILLED_AFTER_BUCKET:
                os.kill(os.getpid(), signal.SIGKILL)

        ws.WeightSender(killed, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S).send(
            KILLED_VERSION, iter(_model(KILLED_VERSION).items()), on_bucket=die)
        return
    receiver = ws.WeightReceiver(group, src=0, timeout_s=TIMEOUT_S)
    _receive(receiver, out)
    _stall(rank, stalled, ws, out)
    dist.barrier()
    receiver = ws.WeightReceiver(killed, src=0, timeout_s=TIMEOUT_S)
    t0 = time.monotonic()
    try:
        receiver.sync(lambda stream: [t.clone() for _, t in stream])
        out["killed"] = "no error"
    except ws.WeightStreamError as e:
        out["killed"], out["killed_type"] = str(e), type(e).__name__
    out["killed_s"] = time.monotonic() - t0
    path.write_text(json.dumps(out))
    # out at once: tearing down gloo groups whose peer died can abort in gloo's own threads (SIGABRT, seen once in
    # about a dozen runs here), which is torch's exit, not the stream's; exit code 0 says this rank returned
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """Each rank's report, and the ranks' exit codes; every process is gone when it returns, whatever happened."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("weight-stream")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp / "store"), str(tmp))) for r in range(3)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 90
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    reports = {r: json.loads((tmp / f"rank{r}.json").read_text()) if (tmp / f"rank{r}.json").exists() else None
               for r in range(3)}
    return {"reports": reports, "exitcodes": [p.exitcode for p in procs], "left_running": alive}


def _expected_buckets() -> list[list[str]]:
    from hybridflow.engines.bridge.reshard import byte_buckets, tensor_bytes

    items = list(_model(1).items())
    return [[n for n, _ in b] for b in byte_buckets(items, lambda i: tensor_bytes(i[1]), BUCKET,
                                                    kind=lambda i: i[1].dtype)]


def test_every_receiver_gets_every_version_bit_for_bit(ranks):
    """One sender, two receivers, three versions of fp32 + bf16 weights with one tensor over a bucket: each
    receiver's tensors equal the sender's (sums, shapes, dtypes), and it records the versions sent, in order."""
    sender = ranks["reports"][0]
    assert sender is not None, ranks
    assert len(_expected_buckets()) >= 4 and any(len(b) > 1 for b in _expected_buckets())  # coalesced and cut
    for r in (1, 2):
        got = ranks["reports"][r]
        assert got is not None, ranks
        assert [s["version"] for s in got["syncs"]] == VERSIONS
        assert [s["stats"]["version"] for s in got["syncs"]] == VERSIONS
        for mine, theirs in zip(got["syncs"], sender["syncs"]):
            assert mine["sums"] == theirs["sums"]
            assert list(mine["sums"]) == list(SHAPES)  # names, in the sender's order
            for key in ("tensors", "buckets", "bytes"):
                assert mine["stats"][key] == theirs["stats"][key]
    stats = sender["syncs"][0]["stats"]
    assert stats["buckets"] == len(_expected_buckets()) and stats["bytes"] == _nbytes(_model(1))
    assert all(s["stats"]["seconds"] > 0 for s in sender["syncs"])
    assert "not newer" in sender["stale_version"]


def test_each_side_holds_at_most_one_bucket(ranks):
    """Measured from the tensors alive in each process while the stream runs (not the stream's own count): the
    sender holds at most one coalesced bucket beyond its own tensors (the big one goes as it lies), a receiver at
    most the bucket in flight (the big one's is that tensor) beyond what its load kept."""
    largest = max(t.numel() * t.element_size() for t in _model(1).values())
    sender = ranks["reports"][0]["syncs"][0]
    assert sender["stats"]["peak_transient_bytes"] <= sender["measured_peak"] <= BUCKET, sender
    assert sender["measured_peak"] <= sender["stats"]["peak_transient_bytes"] + SLACK, sender
    for r in (1, 2):
        got = ranks["reports"][r]["syncs"][0]
        assert got["stats"]["peak_transient_bytes"] == largest, got  # the big tensor's bucket is the largest
        assert largest <= got["measured_peak"] <= largest + SLACK, got


def test_a_killed_sender_is_a_named_error_within_the_timeout(ranks):
    """SIGKILLed between buckets 1 and 2 of a version: every receiver raises a WeightStreamError naming the
    sender, the version and the bucket it waited for (its socket closed: at once, well within the timeout plus a
    generous margin), and no process is left behind."""
    assert ranks["left_running"] == [], ranks
    assert ranks["exitcodes"][0] == -signal.SIGKILL, ranks
    assert ranks["exitcodes"][1:] == [0, 0], ranks
    for r in (1, 2):
        got = ranks["reports"][r]
        assert f"sender rank 0 did not send bucket {KILLED_AFTER_BUCKET + 1} of policy version {KILLED_VERSION}" \
            in got["killed"], got["killed"]
        assert got["killed"].startswith(f"rank {r}: "), got["killed"]
        assert got["killed_type"] == "WeightStreamBroken", got  # a peer lost: the controller's worker loss
        assert got["killed_s"] < TIMEOUT_S + 27, got


def test_a_stalled_sender_is_a_named_error_after_the_timeout(ranks):
    """Alive but silent for longer than the timeout (no socket closes): the receivers raise naming the sender, the
    version and the bucket once the timeout passed (not before: the timeout, not a lost peer, told them), and the
    sender, awake, raises naming the receivers that did not take the rest."""
    for r in (1, 2):
        got = ranks["reports"][r]
        assert got["stalled"].startswith(f"rank {r}: sender rank 0 did not send bucket 1 of policy version "
                                         f"{STALLED_VERSION} (stream timeout {STALL_TIMEOUT_S:g} s)"), got["stalled"]
        assert 0.9 * STALL_TIMEOUT_S <= got["stalled_s"] < STALL_TIMEOUT_S + 27, got
        assert got["stalled_type"] == "WeightStreamBroken", got  # a peer that stopped: a worker loss too
    sender = ranks["reports"][0]
    assert sender["stalled"].startswith("rank 0: receiver"), sender["stalled"]
    assert f"policy version {STALLED_VERSION}" in sender["stalled"], sender["stalled"]
