"""The train -> generate transition, for real, over torch.distributed (gloo on CPU, NCCL on GPU).

Parameters are Megatron-style: column-parallel weights split along dim 0, row-parallel along dim 1, replicated
ones (norms) not split; layers split into contiguous pipeline stages. Three ways to build generation weights:

* `hybridflow`: all-gathers inside the micro-DP group, each into one contiguous buffer; the result *is* this
  rank's generation shard. Where the members' slices side by side already are a generation tensor (column-parallel
  weights; every weight when only pipeline stages merge) the buffer becomes that tensor, no copy; the rest travels
  in buckets of at most BUCKET_BYTES (small tensors coalesced, large ones cut into blocks) and is joined by one
  copy. Nothing is gathered twice and nothing is thrown away; the transient is one bucket, not one layer.
* `hybridflow-v`: all-gather inside the whole model-parallel group of the replica, then keep the (naive)
  generation slice: everyone transiently holds the full model.
* `deepspeed-chat`: ZeRO-3 shards (1/N of every flat parameter) all-gathered over the whole world.

Each returns the generation weights and what it cost (bytes received by this rank, peak transient bytes, seconds).
Generate -> train needs no communication: training shards are never dropped, generation weights are freed.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist

from hybridflow.hybrid_engine.layout import Layout, gen_shard, naive_gen_shard, train_shard

T = TypeVar("T")

BUCKET_BYTES = 4 << 20
"""Most bytes of this rank's shards in one joined HybridFlow all-gather (tensors gathered straight into their
generation tensor travel whole). Measured on gloo, 8 ranks on 2 cores: pairs each gathering 72 MB move it 2.5x
faster in 2-4 MB inputs than in 18 MB ones (64 KB ones are slower again, per-collective cost), and bench/reshard.py
was fastest at 4 MB of 1/2/4/8. It also bounds the transient buffers. NCCL likely wants larger buckets (tens of MB;
not measured here): callers pass bucket_bytes."""

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); older torch has only the old.
_ALL_GATHER_INTO: Callable | None = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None)


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    split_dim: int | None  # 0: column-parallel, 1: row-parallel, None: replicated
    layer: int


@dataclass
class ReshardStats:
    bytes_received: int = 0
    peak_transient_bytes: int = 0
    seconds: float = 0.0
    generation_bytes: int = 0


def decoder_specs(layers: int, hidden: int, ffn: int | None = None) -> list[ParamSpec]:
    """A Llama-like decoder's weight shapes (fused QKV and gate/up, as Megatron stores them)."""
    ffn = ffn or 4 * hidden
    out = []
    for i in range(layers):
        out += [
            ParamSpec(f"layers.{i}.qkv", (3 * hidden, hidden), 0, i),
            ParamSpec(f"layers.{i}.proj", (hidden, hidden), 1, i),
            ParamSpec(f"layers.{i}.fc1", (2 * ffn, hidden), 0, i),
            ParamSpec(f"layers.{i}.fc2", (hidden, ffn), 1, i),
            ParamSpec(f"layers.{i}.norm", (hidden,), None, i),
        ]
    return out


def full_param(spec: ParamSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, spec.name)) * 7919 + spec.layer)
    return torch.randn(spec.shape, generator=g, dtype=torch.float32).to(dtype)


def stage_of(layer: int, layers: int, stages: int) -> int:
    return layer // (layers // stages)


def tp_slice(t: torch.Tensor, split_dim: int | None, index: int, parts: int) -> torch.Tensor:
    if split_dim is None:
        return t
    return t.chunk(parts, dim=split_dim)[index].contiguous()


def train_shards(L: Layout, rank: int, specs: list[ParamSpec], dtype: torch.dtype = torch.float32) -> dict:
    """What a rank holds for training under p-t-d: its TP slice of its stage's layers."""
    layers = max(s.layer for s in specs) + 1
    tp, pp = train_shard(L, rank)
    return {s.name: tp_slice(full_param(s, dtype), s.split_dim, tp, L.t) for s in specs
            if stage_of(s.layer, layers, L.p) == pp}


def expected_generation_shard(L: Layout, rank: int, specs: list[ParamSpec], naive: bool = False,
                              dtype: torch.dtype = torch.float32) -> dict:
    """Reference: the generation shard computed from the full model (tests compare against it)."""
    layers = max(s.layer for s in specs) + 1
    tps, pps = (naive_gen_shard if naive else gen_shard)(L, rank)
    j, parts = tps.start // L.s_t, L.t_g
    return {s.name: tp_slice(full_param(s, dtype), s.split_dim, j, parts) for s in specs
            if stage_of(s.layer, layers, L.p) in pps}


def _buckets(shards: dict, specs: list[ParamSpec]) -> list[list[ParamSpec]]:
    """One bucket per local layer, in layer order: the k-th bucket has the same shapes on every rank."""
    by_layer: dict[int, list[ParamSpec]] = {}
    for s in specs:
        if s.name in shards:
            by_layer.setdefault(s.layer, []).append(s)
    return [by_layer[k] for k in sorted(by_layer)]


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One contiguous input for a collective. A lone contiguous tensor is sent as it is: no copy."""
    tensors = list(tensors)
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _gather(flat: torch.Tensor, group: dist.ProcessGroup, size: int, stats: ReshardStats) -> list[torch.Tensor]:
    parts = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(parts, flat, group=group)
    stats.bytes_received += (size - 1) * flat.numel() * flat.element_size()
    return parts


def _gather_into(flat: torch.Tensor, group: dist.ProcessGroup | None, size: int,
                 stats: ReshardStats) -> torch.Tensor:
    """All-gather into one contiguous (size, n) buffer, row m = member m's input: members' copies are views into
    it, and where they already lie as a generation tensor the buffer becomes it (no list, no cat). NCCL writes the
    buffer in place. gloo (torch 2.13) does not: it gathers into a flat buffer of its own, of the same size, and
    copies that out, as for the list form (measured: peak RSS grows by the output size for either form)."""
    out = flat.new_empty((size, flat.numel()))
    if _ALL_GATHER_INTO is not None:
        _ALL_GATHER_INTO(out.view(-1), flat, group=group)
    else:  # no single-tensor all-gather in this torch: the list form, writing into rows of the same buffer
        dist.all_gather(list(out.unbind(0)), flat, group=group)
    stats.bytes_received += (size - 1) * _nbytes(flat)
    return out


def _note_transient(stats: ReshardStats, nbytes: int) -> None:
    """Transient = what a bucket holds beyond the generation weights it produces and frees when it is done."""
    stats.peak_transient_bytes = max(stats.peak_transient_bytes, nbytes)


def _views(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Consecutive views of `flat` with these shapes (no copy)."""
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def _unflatten(flat: torch.Tensor, bucket: list[ParamSpec], shard_shape) -> dict[str, torch.Tensor]:
    return dict(zip((s.name for s in bucket), _views(flat, [shard_shape(s) for s in bucket])))


@dataclass(frozen=True, eq=False)
class _Piece:
    """What one training shard puts into one bucket: all of it (axis None), or the slices [start, start + n) along
    `axis` out of `extent`, an axis the TP split does not cut, so joining the members' blocks gives the same block
    of the generation tensor. `direct`: gathered alone, the members' rows of the buffer are generation tensors as
    they lie."""
    key: Any  # the shard's ParamSpec or megatron name
    tensor: torch.Tensor
    axis: int | None = None
    start: int = 0
    extent: int = 0
    direct: bool = False

    @property
    def last(self) -> bool:
        return self.axis is None or self.start + self.tensor.shape[self.axis] == self.extent


def _pieces(key: Any, t: torch.Tensor, split_dim: int | None, direct: bool, target: int) -> list[_Piece]:
    """How one shard travels. A direct one of a quarter bucket or more goes whole and alone: its buffer becomes the
    generation tensor, which saves a copy of it (smaller ones cost less to copy than a collective of their own).
    Others over `target` go in blocks of at most `target` (one slice at least) along the axis the TP split leaves
    whole, so no joined all-gather exceeds a bucket whatever the tensor (an embedding can be hundreds of MB)."""
    if direct and 4 * _nbytes(t) >= target:
        return [_Piece(key, t, direct=True)]
    if t.dim() < 2 or _nbytes(t) <= target:
        return [_Piece(key, t)]
    axis = 1 if split_dim == 0 else 0
    extent = t.shape[axis]
    step = max(1, target // (_nbytes(t) // extent))
    return [_Piece(key, t.narrow(axis, i, min(step, extent - i)), axis, i, extent) for i in range(0, extent, step)]


Owner = Callable[[_Piece, int], str]  # (piece, member index) -> the generation tensor that member's copy is part of
Combine = Callable[[_Piece, list[torch.Tensor]], torch.Tensor]  # one generation tensor's copies, in TP order -> it


def _transition(pieces: Iterable[_Piece], group: dist.ProcessGroup | None, size: int, stats: ReshardStats,
                bucket_bytes: int, owner: Owner, combine: Combine) -> Iterator[tuple[str, torch.Tensor]]:
    """HybridFlow's gather, whatever names the weights have: pieces bucketed to `bucket_bytes`, one all-gather per
    bucket into one buffer; yields (generation name, tensor) as each completes. Every member must feed pieces of
    the same shapes, and members whose copies make one generation tensor must be consecutive, in TP order."""
    partial: dict[str, torch.Tensor] = {}  # generation tensors that arrive in blocks, until their last block
    buckets = byte_buckets(pieces, lambda p: _nbytes(p.tensor), bucket_bytes, kind=lambda p: p.tensor.dtype,
                           alone=lambda p: p.direct)
    for bucket in buckets:
        flat = _flatten(p.tensor for p in bucket)
        out = _gather_into(flat, group, size, stats)
        if bucket[0].direct:
            yield from _as_laid(bucket[0], out, owner)
        else:
            yield from _joined(bucket, flat, out, owner, combine, partial, stats)
        del flat, out  # before the next bucket allocates its own


def _runs(piece: _Piece, size: int, owner: Owner) -> list[tuple[str, range]]:
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


def _as_laid(piece: _Piece, out: torch.Tensor, owner: Owner) -> Iterator[tuple[str, torch.Tensor]]:
    """A direct piece: a generation tensor is its members' rows of the buffer, as they lie (dim 0 joined, or one
    member's whole copy). The buffer is generation memory, not transient."""
    for name, rows in _runs(piece, len(out), owner):
        yield name, out[rows.start: rows.stop].view(-1, *piece.tensor.shape[1:])


def _joined(bucket: list[_Piece], flat: torch.Tensor, out: torch.Tensor, owner: Owner, combine: Combine,
            partial: dict[str, torch.Tensor], stats: ReshardStats) -> Iterator[tuple[str, torch.Tensor]]:
    """A coalesced or cut bucket: each generation tensor (or block) joined from the members' views by one copy,
    so the buffer is freed with the bucket. Transient: the buffer, the flattened input, one joined block."""
    copied = len(bucket) > 1 or not bucket[0].tensor.is_contiguous()
    held = _nbytes(out) + (_nbytes(flat) if copied else 0)
    _note_transient(stats, held)
    per_member = [_views(row, [p.tensor.shape for p in bucket]) for row in out]
    for i, piece in enumerate(bucket):
        for name, rows in _runs(piece, len(out), owner):
            joined = combine(piece, [per_member[m][i] for m in rows])
            if piece.axis is None:
                yield name, joined
                continue
            _note_transient(stats, held + _nbytes(joined))
            _block_of(partial, name, piece, joined).copy_(joined)
            if piece.last:
                yield name, partial.pop(name)


def _block_of(partial: dict[str, torch.Tensor], name: str, piece: _Piece, joined: torch.Tensor) -> torch.Tensor:
    """Where a joined block goes in its generation tensor (allocated at its first block)."""
    if name not in partial:
        shape = list(joined.shape)
        shape[piece.axis] = piece.extent
        partial[name] = joined.new_empty(shape)
    return partial[name].narrow(piece.axis, piece.start, joined.shape[piece.axis])


def _slice_shape(s: ParamSpec, parts: int) -> tuple[int, ...]:
    if s.split_dim is None:
        return s.shape
    shape = list(s.shape)
    shape[s.split_dim] //= parts
    return tuple(shape)


def reshard_hybridflow(L: Layout, rank: int, shards: dict, specs: list[ParamSpec], micro_group: list[int],
                       group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES) -> tuple[dict, ReshardStats]:
    """All-gather inside the micro-DP group into this rank's generation shard (see _transition). Members hold the
    same shapes in the same order (the k-th local layer of their stage), so they all cut the same pieces; the
    group lists them by rank: by stage, then TP rank. Column-parallel shards, or every shard when the group only
    merges stages (s_t = 1), are direct: the members' slices side by side are the generation tensor."""
    stats = ReshardStats()
    t0 = time.perf_counter()
    layers = max(s.layer for s in specs) + 1
    stages = [train_shard(L, r)[1] for r in micro_group]
    pieces = (piece for s in specs if s.name in shards for piece in
              _pieces(s, shards[s.name], s.split_dim, L.s_t == 1 or s.split_dim == 0, bucket_bytes))
    owner = functools.partial(_owner, L, layers, stages)
    gen = dict(_transition(pieces, group, len(micro_group), stats, bucket_bytes, owner, _combine))
    stats.generation_bytes = sum(_nbytes(v) for v in gen.values())
    stats.seconds = time.perf_counter() - t0
    return gen, stats


def _owner(L: Layout, layers: int, stages: list[int], piece: _Piece, m: int) -> str:
    """Member m's copy of a local piece is the same position in its own stage's layers."""
    spec = piece.key
    return _respec(spec, spec.layer % (layers // L.p), stages[m], layers, L.p).name


def _combine(piece: _Piece, views: list[torch.Tensor]) -> torch.Tensor:
    """Consecutive TP slices -> one tensor (a copy, so the gathered buffer can be freed)."""
    split_dim = piece.key.split_dim
    return views[0].clone() if split_dim is None else torch.cat(views, dim=split_dim)


def _layer_at(k: int, stage: int, layers: int, stages: int) -> int:
    return stage * (layers // stages) + k


def _respec(s: ParamSpec, k: int, stage: int, layers: int, stages: int) -> ParamSpec:
    """The spec of the k-th local layer on a rank of `stage` that corresponds to local spec `s`."""
    layer = _layer_at(k, stage, layers, stages)
    return ParamSpec(s.name.replace(f"layers.{s.layer}.", f"layers.{layer}.", 1), s.shape, s.split_dim, layer)


def reshard_gather_all(L: Layout, rank: int, shards: dict, specs: list[ParamSpec], mp_group: list[int],
                       group: dist.ProcessGroup) -> tuple[dict, ReshardStats]:
    """HybridFlow-V: gather the replica's whole model inside its model-parallel group, keep the naive slice."""
    stats = ReshardStats()
    t0 = time.perf_counter()
    layers = max(s.layer for s in specs) + 1
    members = [train_shard(L, r) for r in mp_group]
    full: dict[str, torch.Tensor] = {}
    held = 0
    for k, bucket in enumerate(_buckets(shards, specs)):
        parts = _gather(_flatten(shards[s.name] for s in bucket), group, len(mp_group), stats)
        per_member = [_unflatten(p, [_respec(s, k, members[m][1], layers, L.p) for s in bucket],
                                 lambda s: _slice_shape(s, L.t)) for m, p in enumerate(parts)]
        for m, (tp, pp) in enumerate(members):
            for name, tensor in per_member[m].items():
                full.setdefault(name, {})[tp] = tensor  # type: ignore[index]
        held += sum(p.numel() * p.element_size() for p in parts)
    stats.peak_transient_bytes = held
    tps, pps = naive_gen_shard(L, rank)
    j = tps.start // L.s_t
    gen = {}
    for s in specs:
        if stage_of(s.layer, layers, L.p) not in pps:
            continue
        slices = full[s.name]  # type: ignore[index]
        whole = slices[0] if s.split_dim is None else torch.cat([slices[a] for a in range(L.t)], dim=s.split_dim)
        gen[s.name] = tp_slice(whole, s.split_dim, j, L.t_g)
    stats.generation_bytes = sum(v.numel() * v.element_size() for v in gen.values())
    stats.seconds = time.perf_counter() - t0
    return gen, stats


def zero3_shards(world: int, rank: int, specs: list[ParamSpec], dtype: torch.dtype = torch.float32) -> dict:
    """DeepSpeed-Chat's training state: 1/N of every flattened parameter (padded to a multiple of N)."""
    out = {}
    for s in specs:
        flat = full_param(s, dtype).reshape(-1)
        pad = (-flat.numel()) % world
        flat = torch.cat([flat, flat.new_zeros(pad)])
        out[s.name] = flat.chunk(world)[rank].clone()
    return out


def reshard_deepspeed_chat(L: Layout, rank: int, shards: dict, specs: list[ParamSpec],
                           group: dist.ProcessGroup | None = None) -> tuple[dict, ReshardStats]:
    """All-gather every parameter over the world, then keep the TP generation slice (t_g over the full model)."""
    stats = ReshardStats()
    t0 = time.perf_counter()
    world = dist.get_world_size(group)
    held = 0
    gen = {}
    j = (rank % L.t) // L.s_t
    for s in specs:
        parts = _gather(shards[s.name], group, world, stats)
        held += sum(p.numel() * p.element_size() for p in parts)
        whole = torch.cat(parts)[: int(torch.Size(s.shape).numel())].view(s.shape)
        gen[s.name] = tp_slice(whole, s.split_dim, j, L.t_g)
    stats.peak_transient_bytes = held
    stats.generation_bytes = sum(v.numel() * v.element_size() for v in gen.values())
    stats.seconds = time.perf_counter() - t0
    return gen, stats


def model_bytes(specs: list[ParamSpec], dtype: torch.dtype = torch.float32) -> int:
    return sum(int(torch.Size(s.shape).numel()) for s in specs) * torch.tensor([], dtype=dtype).element_size()


# --- the same transition on a real megatron model -------------------------------------------------------------------

_SPLIT_DIM = {"column": 0, "gated": 0, "row": 1, "replicated": None}  # megatron's sharding rule -> TP split dim


def _combine_megatron(piece: _Piece, views: list[torch.Tensor]) -> torch.Tensor:
    from hybridflow.engines.megatron_model import split_rule, unshard

    return views[0].clone() if split_rule(piece.key) == "replicated" else unshard(piece.key, views)


def gather_micro_dp(named_shards: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, size: int,
                    stats: ReshardStats, bucket_bytes: int = BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """HybridFlow's train -> generate transition for megatron TP shards (see _transition): all-gathers inside the
    micro-DP group (consecutive TP ranks, so equal shapes in equal order), column-parallel weights straight into
    their generation tensor, the rest in buckets of at most `bucket_bytes` unsharded into it.

    Yields (megatron name, generation shard) as tensors complete, so the consumer installs them before the next
    bucket is gathered; with size 1 there is nothing to gather and the training shard itself is yielded."""
    from hybridflow.engines.megatron_model import split_rule

    t0 = time.perf_counter()
    if size == 1:
        gen = iter(named_shards)
    else:
        pieces = (piece for name, t in named_shards for piece in
                  _pieces(name, t, _SPLIT_DIM[split_rule(name)], split_rule(name) == "column", bucket_bytes))
        gen = _transition(pieces, group, size, stats, bucket_bytes, lambda piece, m: piece.key, _combine_megatron)
    for name, tensor in gen:
        stats.generation_bytes += _nbytes(tensor)
        yield name, tensor
    stats.seconds = time.perf_counter() - t0
