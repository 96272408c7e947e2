"""The 3D-HybridEngine's train -> generate transition, over torch.distributed (gloo on CPU, NCCL on GPU).

HybridFlow's gather: all-gathers inside the micro-DP group, each into one contiguous buffer; the result *is* this
rank's generation shard. Where the members' slices side by side already are a generation tensor (column-parallel
weights; every weight when only pipeline stages merge) the buffer becomes that tensor, no copy; the rest travels in
buckets of at most BUCKET_BYTES (small tensors coalesced, large ones cut into blocks) and is joined by one copy.
Nothing is gathered twice and nothing is thrown away; the transient is one bucket, not one layer.

gather_micro_dp runs it over megatron TP shards (the actor's path); gather_pieces is the name-agnostic core, which
tests/support/reshard_baselines.py also drives over synthetic shards beside the HybridFlow-V and DeepSpeed-Chat
baselines it is measured against. What it cost (bytes received by this rank, peak transient bytes, seconds) goes
into a ReshardStats. Generate -> train needs no communication: training shards are never dropped, generation
weights are freed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist
from hybridflow.engines import collectives

T = TypeVar("T")

BUCKET_BYTES = 4 << 20
"""Most bytes of this rank's shards in one joined HybridFlow all-gather (tensors gathered straight into their
generation tensor travel whole). Measured on gloo, 8 ranks on 2 cores: pairs each gathering 72 MB move it 2.5x
faster in 2-4 MB inputs than in 18 MB ones (64 KB ones are slower again, per-collective cost), and bench/reshard.py
was fastest at 4 MB of 1/2/4/8. It also bounds the transient buffers. NCCL likely wants larger buckets (tens of MB;
not measured here): callers pass bucket_bytes."""



@dataclass
class ReshardStats:
    """What one transition cost this rank: the actor reports it per step, tests check it against the formulas."""
    bytes_received: int = 0
    peak_transient_bytes: int = 0
    seconds: float = 0.0
    generation_bytes: int = 0


def byte_buckets(items: Iterable[T], nbytes: Callable[[T], int], target: int,
                 kind: Callable[[T], object] = lambda item: None,
                 alone: Callable[[T], bool] = lambda item: False) -> Iterator[list[T]]:
    """Consecutive items coalesced while they fit in `target` bytes and share one `kind` (a dtype: one flat buffer
    holds one dtype); an item over the target, or one that must travel `alone`, is a bucket of its own. The cut
    depends only on sizes and kinds, so ranks whose streams have the same shapes cut the same buckets; a bucket is
    at most max(target, largest item). Lazy: the first bucket is ready before the stream is consumed."""
    bucket: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if bucket and (size + n > target or kind(item) != kind(bucket[0]) or alone(item) or alone(bucket[0])):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (what buckets are sized by and what the stats count)."""
    return t.numel() * t.element_size()


def flat_input(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One contiguous input for a collective. A lone contiguous tensor is sent as it is: no copy."""
    tensors = list(tensors)
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _gather_into(flat: torch.Tensor, group: dist.ProcessGroup | None, size: int,
                 stats: ReshardStats) -> torch.Tensor:
    """All-gather into one contiguous (size, n) buffer, row m = member m's input: members' copies are views into
    it, and where they already lie as a generation tensor the buffer becomes it (no list, no cat). NCCL writes the
    buffer in place. gloo (torch 2.13) does not: it gathers into a flat buffer of its own, of the same size, and
    copies that out, as for the list form (measured: peak RSS grows by the output size for either form)."""
    out = flat.new_empty((size, flat.numel()))
    collectives.all_gather_into(out, flat, group=group)
    stats.bytes_received += (size - 1) * tensor_bytes(flat)
    return out


def _note_transient(stats: ReshardStats, nbytes: int) -> None:
    """Transient = what a bucket holds beyond the generation weights it produces and frees when it is done."""
    stats.peak_transient_bytes = max(stats.peak_transient_bytes, nbytes)


def views_of(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Consecutive views of `flat` with these shapes (no copy)."""
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


@dataclass(frozen=True, eq=False)
class Piece:
    """What one training shard puts into one bucket: all of it (axis None), or the slices [start, start + n) along
    `axis` out of `extent`, an axis the TP split does not cut, so joining the members' blocks gives the same block
    of the generation tensor. `direct`: gathered alone, the members' rows of the buffer are generation tensors as
    they lie."""
    key: Any  # what owner and combine know the shard by: its megatron name (a ParamSpec in tests/support)
    tensor: torch.Tensor
    axis: int | None = None
    start: int = 0
    extent: int = 0
    direct: bool = False

    @property
    def last(self) -> bool:
        return self.axis is None or self.start + self.tensor.shape[self.axis] == self.extent


def cut_pieces(key: Any, t: torch.Tensor, split_dim: int | None, direct: bool, target: int) -> list[Piece]:
    """How one shard travels. A direct one of a quarter bucket or more goes whole and alone: its buffer becomes the
    generation tensor, which saves a copy of it (smaller ones cost less to copy than a collective of their own).
    Others over `target` go in blocks of at most `target` (one slice at least) along the axis the TP split leaves
    whole, so no joined all-gather exceeds a bucket whatever the tensor (an embedding can be hundreds of MB)."""
    if direct and 4 * tensor_bytes(t) >= target:
        return [Piece(key, t, direct=True)]
    if t.dim() < 2 or tensor_bytes(t) <= target:
        return [Piece(key, t)]
    axis = 1 if split_dim == 0 else 0
    extent = t.shape[axis]
    step = max(1, target // (tensor_bytes(t) // extent))
    return [Piece(key, t.narrow(axis, i, min(step, extent - i)), axis, i, extent) for i in range(0, extent, step)]


Owner = Callable[[Piece, int], str]  # (piece, member index) -> the generation tensor that member's copy is part of
Combine = Callable[[Piece, list[torch.Tensor]], torch.Tensor]  # one generation tensor's copies, in TP order -> it


def gather_pieces(pieces: Iterable[Piece], group: dist.ProcessGroup | None, size: int, stats: ReshardStats,
                  bucket_bytes: int, owner: Owner, combine: Combine) -> Iterator[tuple[str, torch.Tensor]]:
    """HybridFlow's gather, whatever names the weights have: pieces bucketed to `bucket_bytes`, one all-gather per
    bucket into one buffer; yields (generation name, tensor) as each completes. Every member must feed pieces of
    the same shapes, and members whose copies make one generation tensor must be consecutive, in TP order."""
    partial: dict[str, torch.Tensor] = {}  # generation tensors that arrive in blocks, until their last block
    buckets = byte_buckets(pieces, lambda p: tensor_bytes(p.tensor), bucket_bytes, kind=lambda p: p.tensor.dtype,
                           alone=lambda p: p.direct)
    for bucket in buckets:
        flat = flat_input(p.tensor for p in bucket)
        out = _gather_into(flat, group, size, stats)
        if bucket[0].direct:
            yield from _as_laid(bucket[0], out, owner)
        else:
            yield from _joined(bucket, flat, out, owner, combine, partial, stats)
        del flat, out  # before the next bucket allocates its own


def _runs(piece: Piece, size: int, owner: Owner) -> list[tuple[str, range]]:
    """The members, grouped by the generation tensor their copy of `piece` is part of."""
    runs: list[tuple[str, range]] = []
    for m in range(size):
        name = owner(piece, m)
        if runs and runs[-1][0] == name:
            runs[-1] = (name, range(runs[-1][1].start, m + 1))
        else:
            assert all(name != n for n, _ in runs), f"members holding {name} are not consecutive"
            runs.append((name, range(m, m + 1)))
    return runs


def _as_laid(piece: Piece, out: torch.Tensor, owner: Owner) -> Iterator[tuple[str, torch.Tensor]]:
    """A direct piece: a generation tensor is its members' rows of the buffer, as they lie (dim 0 joined, or one
    member's whole copy). The buffer is generation memory, not transient."""
    for name, rows in _runs(piece, len(out), owner):
        yield name, out[rows.start: rows.stop].view(-1, *piece.tensor.shape[1:])


def _joined(bucket: list[Piece], flat: torch.Tensor, out: torch.Tensor, owner: Owner, combine: Combine,
            partial: dict[str, torch.Tensor], stats: ReshardStats) -> Iterator[tuple[str, torch.Tensor]]:
    """A coalesced or cut bucket: each generation tensor (or block) joined from the members' views by one copy,
    so the buffer is freed with the bucket. Transient: the buffer, the flattened input, one joined block."""
    copied = len(bucket) > 1 or not bucket[0].tensor.is_contiguous()
    held = tensor_bytes(out) + (tensor_bytes(flat) if copied else 0)
    _note_transient(stats, held)
    per_member = [views_of(row, [p.tensor.shape for p in bucket]) for row in out]
    for i, piece in enumerate(bucket):
        for name, rows in _runs(piece, len(out), owner):
            joined = combine(piece, [per_member[m][i] for m in rows])
            if piece.axis is None:
                yield name, joined
                continue
            _note_transient(stats, held + tensor_bytes(joined))
            _block_of(partial, name, piece, joined).copy_(joined)
            if piece.last:
                yield name, partial.pop(name)


def _block_of(partial: dict[str, torch.Tensor], name: str, piece: Piece, joined: torch.Tensor) -> torch.Tensor:
    """Where a joined block goes in its generation tensor (allocated at its first block)."""
    if name not in partial:
        shape = list(joined.shape)
        shape[piece.axis] = piece.extent
        partial[name] = joined.new_empty(shape)
    return partial[name].narrow(piece.axis, piece.start, joined.shape[piece.axis])


_SPLIT_DIM = {"column": 0, "gated": 0, "row": 1, "replicated": None}  # megatron's sharding rule -> TP split dim


def _combine_megatron(piece: Piece, views: list[torch.Tensor]) -> torch.Tensor:
    from hybridflow.engines.train.megatron_model import split_rule, unshard

    return views[0].clone() if split_rule(piece.key) == "replicated" else unshard(piece.key, views)


def _megatron_pieces(named_shards: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                     all_direct: bool = False) -> Iterator[Piece]:
    """How megatron TP shards travel (cut_pieces by their sharding rule): column-parallel ones direct, or all of them."""
    from hybridflow.engines.train.megatron_model import split_rule

    for name, t in named_shards:
        rule = split_rule(name)
        yield from cut_pieces(name, t, _SPLIT_DIM[rule], all_direct or rule == "column", bucket_bytes)


def gather_micro_dp(named_shards: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, size: int,
                    stats: ReshardStats, bucket_bytes: int = BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """HybridFlow's train -> generate transition for megatron TP shards (see gather_pieces): all-gathers inside the
    micro-DP group (consecutive TP ranks, so equal shapes in equal order), column-parallel weights straight into
    their generation tensor, the rest in buckets of at most `bucket_bytes` unsharded into it.

    Yields (megatron name, generation shard) as tensors complete, so the consumer installs them before the next
    bucket is gathered; with size 1 there is nothing to gather and the training shard itself is yielded."""
    t0 = time.perf_counter()
    if size == 1:
        gen = iter(named_shards)
    else:
        gen = gather_pieces(_megatron_pieces(named_shards, bucket_bytes), group, size, stats, bucket_bytes,
                            lambda piece, m: piece.key, _combine_megatron)
    for name, tensor in gen:
        stats.generation_bytes += tensor_bytes(tensor)
        yield name, tensor
    stats.seconds = time.perf_counter() - t0


def gather_stages(named_shards: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None,
                  ranks: list[int], stages: int, stage: int, layers_per_stage: int, stats: ReshardStats,
                  bucket_bytes: int = BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """The transition when generation joins the training's pipeline stages (p -> p_g = 1): the micro-DP group
    (`ranks`, in rank order) holds every stage, member m being TP slice m % s_t of stage m // s_t's block.

    Every stage holds the same run of layers, so layers travel as gather_micro_dp's pieces under their stage-local
    names, each member's copy owned by the layer of its own stage: one all-gather per bucket brings every stage's
    layers. What only one stage holds (the embedding on the first, the final norm and an untied output layer on
    the last) is broadcast from its holders, each TP slice once. Yields (whole-model megatron name, generation
    shard) as they complete. A rank receives its generation shard less what it trains, except that a replicated
    tensor (a norm) comes from one holder, so its stage peers receive the copy they hold (a broadcast reaches the
    whole group)."""
    from hybridflow.engines.train.megatron_model import global_layer_name, split_rule, unshard

    t0 = time.perf_counter()
    size, me = len(ranks), ranks.index(dist.get_rank())
    s_t = size // stages
    layers, rest = [], []
    for name, t in named_shards:
        if name.startswith("decoder.layers."):
            layers.append((global_layer_name(name, -stage * layers_per_stage), t))
        else:
            rest.append((name, t))
    # where only stages join (s_t = 1), each member's copy is a whole generation tensor of its own layer: every
    # piece can lie in the buffer as it came (direct), not only column-parallel ones
    pieces = _megatron_pieces(layers, bucket_bytes, all_direct=s_t == 1)
    for name, tensor in gather_pieces(pieces, group, size, stats, bucket_bytes,
                                      lambda piece, m: global_layer_name(piece.key, (m // s_t) * layers_per_stage),
                                      _combine_megatron):
        stats.generation_bytes += tensor_bytes(tensor)
        yield name, tensor
    every: list = [None] * size
    collectives.all_gather_object(every, [(n, tuple(t.shape), t.dtype) for n, t in rest], group=group)
    held = [{n: (shape, dtype) for n, shape, dtype in entries} for entries in every]
    mine = dict(rest)
    device = layers[0][1].device
    for name in dict.fromkeys(n for entries in every for n, _, _ in entries):  # first seen first, on every member
        holders = [m for m in range(size) if name in held[m]]
        if split_rule(name) == "replicated":
            holders = holders[:1]
        parts = []
        for m in holders:
            shape, dtype = held[m][name]
            t = mine[name].contiguous() if m == me else torch.empty(shape, dtype=dtype, device=device)
            collectives.broadcast(t, src=ranks[m], group=group)
            if m != me:
                stats.bytes_received += tensor_bytes(t)
            parts.append(t)
        tensor = parts[0] if len(parts) == 1 else unshard(name, parts)
        stats.generation_bytes += tensor_bytes(tensor)
        yield name, tensor
    stats.seconds = time.perf_counter() - t0
