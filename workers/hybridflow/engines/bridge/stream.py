"""Weights across pools (issue 26, item 2): a trainer rank that holds whole tensors streams them to every rollout
replica's ranks over one torch.distributed group spanning them (gloo on CPU, NCCL on GPU: the same code, the
tensors on the group's device).

The in-process transfers (transfer.py) hand tensors to `load_weights` by reference; a rollout on a pool of its own
gets them by broadcast instead. Three things matter there that do not in-process:

* Memory stays bounded. Tensors travel in buckets (reshard.byte_buckets: same-dtype tensors coalesced up to
  `bucket_bytes`, a bigger one alone), each flattened into one buffer and broadcast as bytes. The sender holds at
  most that one buffer beyond its own tensors (a lone contiguous tensor is sent as it lies, no copy); a receiver
  splits the buffer into named views and yields them lazily, so it holds one bucket in flight: the next one is
  received only when its consumer (a `load_weights`) asks for the next tensor.
* The receiver knows nothing beforehand. Each bucket is preceded by a preamble (a fixed-size int64 tensor) and a
  header (JSON: names, shapes, dtype), so a replica needs no prior knowledge of the model's shapes; the preamble
  carries the POLICY VERSION, the bucket's index and byte count, which the receiver checks (same version
  throughout, newer than the last one it loaded, buckets in order, bytes as announced). Preamble and header are
  two small broadcasts per bucket beside its payload, a per-collective cost: buckets are MBs, not tensors. An end
  marker carries the totals; each receiver then acks (version, tensors, bytes) to the sender point to point, so
  the sender knows every replica got what it meant, and by name which did not.
* A stall is an error, not a hang. Every wait is bounded by `timeout_s` (Work.wait(timeout): gloo honours it, as
  tests/engines/test_weight_stream.py shows; NCCL's WorkNCCL::wait(timeout) polls on the host until the work completes or
  the timeout passes, then aborts the work's communicator and raises DistBackendError in the caller's thread) and a
  failure is re-raised as a WeightStreamError naming the peer that did not answer (the sender, or the receiver
  that did not ack), the version and the bucket. A killed sender's sockets close, so its receivers fail at once
  (those reached through a peer fail within the timeout).
* A failure breaks the stream on the rank that saw it, and only there: it aborts the stream's group
  (Backend.abort(): ProcessGroupNCCL aborts its communicators, bounded by the group's timeout, and stops its
  watchdog and heartbeat monitor; gloo's abort returns at once), marks the side broken (a later send or receive
  raises at once instead of waiting on an aborted group) and raises the named error. The caller forms a new group
  before the next sync (the trainer's weight sync, trainer/generation/, the path a lost replica takes). On NCCL,
  `stream_group` builds the group so that its own watchdog never takes the process down: with NCCL's defaults, a
  timed-out or failed work on ANY group of a process makes that group's watchdog rethrow on its own thread
  (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, std::terminate), which a trainer rank must not die of for a rollout replica
  that stalled.

The group is one of its own (`stream_group`), not part of either pool's torch.distributed world: the sender serves
its rendezvous (`StreamRendezvous`), the receivers join it (`stream_store`). The actor role sends
(roles/actor.py `send_weights`), the rollout role on a pool of its own receives (roles/rollout.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from hybridflow.engines.bridge.reshard import BUCKET_BYTES, byte_buckets, flat_input, tensor_bytes, views_of
from hybridflow.single_controller.failures import PeerLost, one_line

STREAM_TIMEOUT_S = 60.0
"""Default bound, in seconds, on any one wait of a stream: a bucket's broadcast (which includes the sender
producing it, e.g. an FSDP all-gather for full_params, and the receivers loading the previous one) or an ack. Far
above what a bucket costs (milliseconds to a second for 4 MB to hundreds of MB), far below "hangs silently". The
first wait of a sync counts too: receivers enter `receive` when the controller says a version is coming."""

_MAGIC = 0x48465753  # "HFWS": a preamble that does not start with it is not ours (a desynchronised stream)
_PREAMBLE = 6  # magic, version, bucket index (-1: end), header bytes, payload bytes, tensors
MAX_HEADER_BYTES = 16 << 20
"""The largest bucket header (JSON: names, shapes, dtype) a receiver takes: a preamble announcing more (or a
negative size) is refused before anything is allocated or received for it. A bucket's header is ~100 bytes per
tensor; a bucket of 4 MB of one-element tensors would need ~1M of them to come near."""
_ACK = 3  # version, tensors, bytes
_ACK_TAG = 7  # the acks' point-to-point tag
_PREFIX = "hybridflow/weight-stream"

log = logging.getLogger(__name__)

NCCL_STREAM_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_PROPAGATE_ERROR": "0",
}
"""What ProcessGroupNCCL reads from the environment when it is built (its constructor, torch 2.13), set for the
stream's group alone. ASYNC_ERROR_HANDLING 0 (NoHandling): its watchdog logs a failed or timed-out work and does
not rethrow it on its own thread, which would terminate the process (the default, 3 = SkipCleanUp, tears down);
errors then surface only in the stream's own Work.wait, which names them, and the stream aborts the group itself
(distributed_c10d._abort_process_group documents abort with this variable at 0 for the same reason).
DUMP_ON_TIMEOUT 0: no flight-recorder dump signal from this group's monitor. PROPAGATE_ERROR 0: no remote-error
signal through the rendezvous store. The pools' own groups (FSDP, the 3D-HybridEngine) keep the defaults: a
timeout there is a desynchronised world, which the process should die of."""

NCCL_WATCHDOG_FACTOR = 2.0
"""The NCCL group's own timeout (its watchdog's and its abort's bound) as a multiple of the stream's: the
stream's Work.wait(timeout) sees a stall first, on the calling thread, and aborts the group (which stops its
watchdog) before the watchdog's own timeout could fire for the same work."""

_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _environment(overrides: dict[str, str]) -> Iterator[None]:
    """`overrides` in os.environ while the body runs, the previous values (or their absence) restored after: for
    settings a C++ constructor reads once, so they apply to the one object built inside and nothing else."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class WeightStreamError(RuntimeError):
    """A weight stream that stalled, broke or did not carry what its sender meant. The message names this rank,
    the peer, the policy version and the bucket, so the log says who to look at."""


class WeightStreamBroken(WeightStreamError, PeerLost):
    """The stream's group broke off or timed out waiting: a peer is gone or stopped (the controller takes it for a
    worker loss, single_controller.failures), not a stream that carried the wrong thing."""


@dataclass
class SyncStats:
    """What one sync cost this rank (the metrics of issue 26: bytes and seconds per sync). `bytes`: payload bytes
    sent (sender) or received (receiver); `peak_transient_bytes`: the largest buffer the stream itself held beyond
    the sender's own tensors and what the receiver's consumer keeps."""
    version: int
    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    peak_transient_bytes: int = 0
    seconds: float = 0.0


def stream_group(store: dist.Store, rank: int, size: int, timeout_s: float = STREAM_TIMEOUT_S,
                 device: torch.device | str = "cpu") -> dist.ProcessGroup:
    """The group a stream runs on, a process group of its own: not made from a default group, because its ranks
    live in different pools (each pool's processes form a torch.distributed world of their own, which FSDP and the
    3D-HybridEngine use) and join it through `store`. Group rank 0 sends; ranks 1..size-1 receive. Gloo for CPU
    tensors, its timeout the stream's, so a wait the stream does not bound is bounded too. NCCL for CUDA ones (the
    same calls; not run here for want of GPUs), built with NCCL_STREAM_ENV so its watchdog cannot take the process
    down, and with NCCL_WATCHDOG_FACTOR times the stream's timeout as its own. Blocks until all `size` ranks
    joined (gloo; NCCL connects at the first collective)."""
    if torch.device(device).type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s * NCCL_WATCHDOG_FACTOR)
        with _environment(NCCL_STREAM_ENV):
            return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))


def pool_peers(members: Sequence[int]) -> list[str]:
    """Names of a trainer -> rollout pool stream's group ranks, as its errors say them: the sender is the actor's
    rank 0, group rank 1 + i is the rollout pool's rank members[i] (the replicas in the group when it was formed:
    a group is formed again when a replica is lost or replaced)."""
    return ["trainer rank 0"] + [f"rollout rank {r}" for r in members]


def stream_store(host: str, port: int, size: int, timeout_s: float = STREAM_TIMEOUT_S) -> dist.Store:
    """A receiver's way into a stream's rendezvous (`StreamRendezvous`, opened by the sender), under the stream's
    own prefix, so the store could serve other things."""
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(_PREFIX, store)


class StreamRendezvous:
    """The sender's side of a stream's rendezvous: a TCPStore it serves on a port the kernel picks (no gap between
    choosing and listening), at `host`; the receivers reach it through `stream_store`. Kept open for the group's
    life: gloo's ranks read each other's addresses from it when they connect."""

    def __init__(self, host: str, size: int, timeout_s: float = STREAM_TIMEOUT_S) -> None:
        self.host, self.size = host, size
        self._store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
        self.port = int(self._store.port)
        self.store: dist.Store = dist.PrefixStore(_PREFIX, self._store)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightStreamError(f"unknown dtype {name!r} in a weight stream header")
    return dtype


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor seen as uint8: every backend broadcasts bytes, whatever the weights' dtype."""
    return t.view(torch.uint8)


class _Bounded:
    """One rank's side of a stream: every wait bounded, every failure named. Ranks are the group's own; `peers`
    names them for messages (e.g. "trainer rank 0", "rollout rank 1"), "rank <i>" unless given."""

    def __init__(self, group: dist.ProcessGroup, src: int, device: torch.device | str, timeout_s: float,
                 peers: Sequence[str] | None = None) -> None:
        self.group, self.src, self.device = group, src, torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        self.rank = group.rank()
        self.receivers = [r for r in range(group.size()) if r != src]
        self.peers = list(peers) if peers is not None else [f"rank {r}" for r in range(group.size())]
        if len(self.peers) != group.size():
            raise ValueError(f"{len(self.peers)} peer names for a group of {group.size()}")
        self.broken: str | None = None  # why the stream broke on this rank; None while it is usable

    def _bounded(self, start: Callable[[], dist.Work], what: Callable[[], str]) -> None:
        """Start one operation and wait for it at most the timeout; a timeout or a lost peer (gloo and NCCL raise
        RuntimeError, DistBackendError, for both, at the start or at the wait) becomes a WeightStreamBroken that
        says `what` did not happen (`send` and `receive`, which every wait runs inside, then abort the group)."""
        try:
            start().wait(timeout=self.timeout)
        except RuntimeError as e:
            raise WeightStreamBroken(f"{self.peers[self.rank]}: {what()} (stream timeout "
                                     f"{self.timeout.total_seconds():g} s): {one_line(e)}") from e

    def _break(self, why: str) -> None:
        """The stream failed on this rank (a wait, a peer, or what it carried): abort its group once, so no work
        of it is left in flight or watched (NCCL: the communicators are aborted and the group's watchdog and
        monitor stopped), and refuse any later use. Only this rank's group object: a peer learns of it by its own
        wait failing (its socket closed, or its timeout). An abort that fails is logged, never raised: the error
        being raised says what broke."""
        if self.broken is not None:
            return
        self.broken = why
        try:
            self.group.abort()
        except Exception as e:  # noqa: BLE001 - e.g. NCCL's abort past the group's timeout; the stream's error wins
            log.warning("%s: aborting the broken weight stream's group failed: %s", self.peers[self.rank],
                        one_line(e))

    def _usable(self) -> None:
        """A stream that broke stays broken: its group is aborted, and waiting on it would hang or fail
        undefinedly. Raised as a break (the remedy is the caller's: form the group again, as after a lost peer)."""
        if self.broken is not None:
            raise WeightStreamBroken(f"{self.peers[self.rank]}: this weight stream broke earlier and its group was "
                                     f"aborted; form a new one (stream_group) before the next sync. It broke with: "
                                     f"{self.broken}")

    def _broadcast(self, t: torch.Tensor, what: Callable[[], str]) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = self.src, 0
        self._bounded(lambda: self.group.broadcast([t], opts), what)

    def _error(self, message: str) -> WeightStreamError:
        return WeightStreamError(f"{self.peers[self.rank]}: {message}")


class WeightSender(_Bounded):
    """The sending side: the one trainer rank in the group that holds whole tensors (FSDP's rank 0 after
    sync_params()). `send` streams one policy version; versions must increase."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device | str = "cpu",
                 bucket_bytes: int = BUCKET_BYTES, timeout_s: float = STREAM_TIMEOUT_S,
                 peers: Sequence[str] | None = None) -> None:
        super().__init__(group, group.rank(), device, timeout_s, peers)
        self.bucket_bytes = bucket_bytes
        self.version: int | None = None

    def send(self, version: int, named: Iterable[tuple[str, torch.Tensor]],
             on_bucket: Callable[[int], None] | None = None) -> SyncStats:
        """Stream `named` (HF names, whole tensors, consumed lazily) as policy `version`; returns once every
        receiver acked it. `on_bucket(i)` runs after bucket i was sent, its buffer still held: where tests measure
        what the sender holds, or kill it between buckets. A failure once anything was sent breaks the stream
        (_break): the receivers are mid-version, out of step, whatever failed."""
        if self.version is not None and version <= self.version:
            raise ValueError(f"policy version {version} is not newer than the last one sent ({self.version})")
        self._usable()
        try:
            return self._send(version, named, on_bucket)
        except Exception as e:
            self._break(one_line(e))
            raise

    def _send(self, version: int, named: Iterable[tuple[str, torch.Tensor]],
              on_bucket: Callable[[int], None] | None) -> SyncStats:
        stats, t0 = SyncStats(version), time.perf_counter()
        buckets = byte_buckets(named, lambda item: tensor_bytes(item[1]), self.bucket_bytes,
                               kind=lambda item: item[1].dtype)
        for i, bucket in enumerate(buckets):
            flat = flat_input(t.detach().to(self.device) for _, t in bucket)
            if len(bucket) > 1 or flat.data_ptr() != bucket[0][1].data_ptr():  # a copy: the stream's own buffer
                stats.peak_transient_bytes = max(stats.peak_transient_bytes, tensor_bytes(flat))
            header = json.dumps({"names": [n for n, _ in bucket], "shapes": [list(t.shape) for _, t in bucket],
                                 "dtype": str(flat.dtype).removeprefix("torch.")}).encode()
            self._send_bucket(version, i, header, flat, len(bucket))
            stats.tensors, stats.buckets = stats.tensors + len(bucket), i + 1
            stats.bytes += tensor_bytes(flat)
            if on_bucket is not None:
                on_bucket(i)
            del flat, bucket  # before the next bucket is built
        end = torch.tensor([_MAGIC, version, -1, 0, stats.bytes, stats.tensors], dtype=torch.int64, device=self.device)
        self._broadcast(end, lambda: f"receivers {self._names(self.receivers)} did not take the end of policy "
                                     f"version {version}")
        self._acks(stats)
        self.version = version
        stats.seconds = time.perf_counter() - t0
        return stats

    def _send_bucket(self, version: int, i: int, header: bytes, flat: torch.Tensor, n: int) -> None:
        def what() -> str:
            return f"receivers {self._names(self.receivers)} did not take bucket {i} of policy version {version}"

        pre = torch.tensor([_MAGIC, version, i, len(header), tensor_bytes(flat), n], dtype=torch.int64,
                           device=self.device)
        self._broadcast(pre, what)
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device), what)
        self._broadcast(_as_bytes(flat), what)

    def _names(self, ranks: list[int]) -> str:
        return ", ".join(self.peers[r] for r in ranks)

    def _acks(self, stats: SyncStats) -> None:
        """Each receiver's (version, tensors, bytes), point to point: names the receiver that did not answer."""
        acks = {r: torch.zeros(_ACK, dtype=torch.int64, device=self.device) for r in self.receivers}
        works = {r: self.group.recv([a], r, _ACK_TAG) for r, a in acks.items()}
        for r, work in works.items():
            self._bounded(lambda w=work: w,
                          lambda r=r: f"receiver {self.peers[r]} did not ack policy version {stats.version}")
            got = acks[r].tolist()
            if got != [stats.version, stats.tensors, stats.bytes]:
                raise self._error(f"receiver {self.peers[r]} acked (version, tensors, bytes) "
                                        f"{got}, sent {[stats.version, stats.tensors, stats.bytes]}")


class WeightReceiver(_Bounded):
    """The receiving side, on each rank of each rollout replica: `receive` yields one version's (name, tensor)
    lazily, shaped for RolloutEngine.load_weights; `sync(load)` runs a whole one. `version`: the last loaded."""

    def __init__(self, group: dist.ProcessGroup, src: int = 0, device: torch.device | str = "cpu",
                 timeout_s: float = STREAM_TIMEOUT_S, peers: Sequence[str] | None = None) -> None:
        super().__init__(group, src, device, timeout_s, peers)
        self.version: int | None = None
        self.stats: SyncStats | None = None  # the last complete sync's

    def sync(self, load: Callable[[Iterable[tuple[str, torch.Tensor]]], object]) -> SyncStats:
        """One version into `load` (a load_weights, or with LoRA a load_adapter: what it returns is unused). A load
        that stops early would leave the stream out of step with the sender, so what it left is drained, and that
        is an error."""
        stream = self.receive()
        load(stream)
        left = sum(1 for _ in stream)
        if left:
            raise self._error(f"the load left {left} tensor(s) of policy version "
                                    f"{self.version} unconsumed")
        assert self.stats is not None
        return self.stats

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The next version's tensors, as views into the bucket just received: valid until the next item is asked
        for (a load_weights copies them into its parameters). Acks the sender after the end marker. A failure
        breaks the stream (_break), a wrong preamble or header too: the sender and this rank are out of step."""
        self._usable()
        try:
            yield from self._receive()
        except Exception as e:
            self._break(one_line(e))
            raise

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        t0, stats, i = time.perf_counter(), SyncStats(-1), 0
        while True:
            pre = self._preamble(stats.version, i)
            magic, version, index, header_len, nbytes, n = pre
            if magic != _MAGIC:
                raise self._error(f"bucket {i} from sender {self.peers[self.src]} is not a weight "
                                        f"stream preamble ({pre})")
            if i == 0:
                if self.version is not None and version <= self.version:
                    raise self._error(f"sender {self.peers[self.src]} sent policy version {version}, "
                                            f"not newer than the loaded {self.version}")
                stats.version = version
            elif version != stats.version:
                raise self._error(f"bucket {i} from sender {self.peers[self.src]} is of policy "
                                        f"version {version}, the sync began as {stats.version}")
            if index == -1:
                if (nbytes, n) != (stats.bytes, stats.tensors):
                    raise self._error(f"sender {self.peers[self.src]} ended version {version} at "
                                            f"{n} tensors / {nbytes} bytes, received {stats.tensors} / {stats.bytes}")
                break
            if index != i:
                raise self._error(f"sender {self.peers[self.src]} sent bucket {index} of version "
                                        f"{version}, expected bucket {i}")
            yield from self._bucket(stats, i, header_len, nbytes, n)
            i += 1
        self._ack(stats)
        self.version, stats.seconds = stats.version, time.perf_counter() - t0
        self.stats = stats

    def _what(self, version: int, i: int) -> Callable[[], str]:
        shown = "the next version" if version < 0 else f"policy version {version}"
        return lambda: f"sender {self.peers[self.src]} did not send bucket {i} of {shown}"

    def _preamble(self, version: int, i: int) -> list[int]:
        pre = torch.zeros(_PREAMBLE, dtype=torch.int64, device=self.device)
        self._broadcast(pre, self._what(version, i))
        return pre.tolist()

    def _bucket(self, stats: SyncStats, i: int, header_len: int, nbytes: int,
                n: int) -> Iterator[tuple[str, torch.Tensor]]:
        """One bucket: its header, its bytes, split into named views. Only this bucket's buffer is held; the
        views are dropped before the next one is received. A preamble announcing a header over MAX_HEADER_BYTES, or
        a negative size or count, is refused before the header is allocated or received."""
        if not 0 < header_len <= MAX_HEADER_BYTES or nbytes < 0 or n < 0:
            raise self._error(f"bucket {i} of version {stats.version} from sender {self.peers[self.src]} announces "
                              f"a {header_len}-byte header (at most {MAX_HEADER_BYTES}), {nbytes} bytes and {n} "
                              "tensors: refused")
        header = torch.empty(header_len, dtype=torch.uint8, device=self.device)
        self._broadcast(header, self._what(stats.version, i))
        meta = json.loads(bytes(header.cpu().tolist()).decode())
        del header
        names, shapes, dtype = meta["names"], [torch.Size(s) for s in meta["shapes"]], _dtype(meta["dtype"])
        expected = sum(s.numel() for s in shapes) * dtype.itemsize
        if len(names) != n or len(shapes) != n or expected != nbytes:
            raise self._error(f"bucket {i} of version {stats.version} from sender {self.peers[self.src]} "
                                    f"announces {n} tensors / {nbytes} bytes, its header {len(names)} / "
                                    f"{expected}")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(buf, self._what(stats.version, i))
        stats.peak_transient_bytes = max(stats.peak_transient_bytes, nbytes)
        stats.tensors, stats.buckets, stats.bytes = stats.tensors + n, i + 1, stats.bytes + nbytes
        views = views_of(buf.view(dtype), list(shapes))
        del buf
        while views:
            yield names.pop(0), views.pop(0)  # the generator keeps no reference to what it handed out

    def _ack(self, stats: SyncStats) -> None:
        ack = torch.tensor([stats.version, stats.tensors, stats.bytes], dtype=torch.int64, device=self.device)
        self._bounded(lambda: self.group.send([ack], self.src, _ACK_TAG),
                      lambda: f"sender {self.peers[self.src]} did not take the ack of policy version {stats.version}")
