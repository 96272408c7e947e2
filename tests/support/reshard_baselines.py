"""What the 3D-HybridEngine is measured against, for the tests and bench/reshard.py (not runtime): the baselines'
groupings, the paper's communication and memory fractions (its Table 2), synthetic Megatron-style shards of a
decoder, and the three train -> generate transitions over them:

* `hybridflow`: the runtime's own gather (hybridflow.engines.bridge.reshard.gather_pieces, the core of the actor's
  gather_micro_dp) over synthetic shards, so the many-layout tests exercise the code the actor runs.
* `hybridflow-v`: all-gather inside the whole model-parallel group of the replica, then keep the (naive)
  generation slice: everyone transiently holds the full model.
* `deepspeed-chat`: ZeRO-3 shards (1/N of every flat parameter) all-gathered over the whole world.

Parameters are Megatron-style: column-parallel weights split along dim 0, row-parallel along dim 1, replicated
ones (norms) not split; layers split into contiguous pipeline stages. Each transition returns the generation
weights and what it cost (a ReshardStats).

Training layout p-t-d and the HybridFlow grouping are the runtime's (hybridflow.engines.bridge.layout). Under
HybridFlow-V (naive) the generation TP groups are consecutive ranks, so a rank's generation slice is a % t_g, which
in general does not contain its training shard: the whole model-parallel group must be all-gathered. Under
DeepSpeed-Chat training is ZeRO-3 over all N ranks; generation all-gathers every parameter everywhere.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from hybridflow.engines.bridge.layout import Layout, gen_shard, groups, train_shard
from hybridflow.engines.bridge.reshard import (
    BUCKET_BYTES,
    Piece,
    ReshardStats,
    cut_pieces,
    flat_input,
    gather_pieces,
    tensor_bytes,
    views_of,
)


def model_parallel_groups(L: Layout) -> list[list[int]]:
    """All TP x PP ranks of one training replica (what HybridFlow-V gathers over)."""
    return groups(L, lambda tp, dp, pp: (dp,))


# --- HybridFlow-V (naive) grouping -------------------------------------------------------------------------------

def naive_gen_shard(L: Layout, rank: int) -> tuple[range, range]:
    """Under consecutive generation TP/PP groups, rank a generates with slice a % t_g (and stage pp % p_g)."""
    tp, _, pp = L.coords(rank)
    j, k = tp % L.t_g, pp % L.p_g
    return range(j * L.s_t, (j + 1) * L.s_t), range(k * L.s_p, (k + 1) * L.s_p)


def naive_gen_tp_groups(L: Layout) -> list[list[int]]:
    return groups(L, lambda tp, dp, pp: (dp, pp, tp // L.t_g))


# --- Communication and memory, as fractions of the model size M --------------------------------------------------

def comm_fraction(L: Layout, scheme: str) -> Fraction:
    """Bytes each device receives at the transition, as a fraction of M (the paper's Table 2)."""
    tp_ = L.t * L.p
    if scheme == "hybridflow":
        return Fraction(tp_ - L.t_g * L.p_g, L.t_g * L.p_g * tp_)
    if scheme == "hybridflow-v":
        return Fraction(tp_ - 1, tp_)
    if scheme == "deepspeed-chat":
        return Fraction(L.world - 1, L.world)
    raise ValueError(f"unknown scheme {scheme!r}")


def peak_memory_fraction(L: Layout, scheme: str) -> Fraction:
    """Generation-time parameter memory per device, as a fraction of M."""
    if scheme == "hybridflow":
        return Fraction(1, L.t_g * L.p_g)
    if scheme in ("hybridflow-v", "deepspeed-chat"):
        return Fraction(1)
    raise ValueError(f"unknown scheme {scheme!r}")


def redundancy_free(L: Layout) -> bool:
    """Every rank's training shard lies inside its generation shard (HybridFlow's zero-redundancy property)."""
    for r in range(L.world):
        tps, pps = gen_shard(L, r)
        tp, pp = train_shard(L, r)
        if tp not in tps or pp not in pps:
            return False
    return True


# --- synthetic shards and the three transitions over them ---------------------------------------------------------

@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    split_dim: int | None  # 0: column-parallel, 1: row-parallel, None: replicated
    layer: int


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


def _gather(flat: torch.Tensor, group: dist.ProcessGroup, size: int, stats: ReshardStats) -> list[torch.Tensor]:
    parts = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(parts, flat, group=group)
    stats.bytes_received += (size - 1) * flat.numel() * flat.element_size()
    return parts


def _unflatten(flat: torch.Tensor, bucket: list[ParamSpec], shard_shape) -> dict[str, torch.Tensor]:
    return dict(zip((s.name for s in bucket), views_of(flat, [shard_shape(s) for s in bucket])))


def _slice_shape(s: ParamSpec, parts: int) -> tuple[int, ...]:
    if s.split_dim is None:
        return s.shape
    shape = list(s.shape)
    shape[s.split_dim] //= parts
    return tuple(shape)


def reshard_hybridflow(L: Layout, rank: int, shards: dict, specs: list[ParamSpec], micro_group: list[int],
                       group: dist.ProcessGroup | None, bucket_bytes: int = BUCKET_BYTES) -> tuple[dict, ReshardStats]:
    """All-gather inside the micro-DP group into this rank's generation shard (see gather_pieces). Members hold the
    same shapes in the same order (the k-th local layer of their stage), so they all cut the same pieces; the
    group lists them by rank: by stage, then TP rank. Column-parallel shards, or every shard when the group only
    merges stages (s_t = 1), are direct: the members' slices side by side are the generation tensor."""
    stats = ReshardStats()
    t0 = time.perf_counter()
    layers = max(s.layer for s in specs) + 1
    stages = [train_shard(L, r)[1] for r in micro_group]
    pieces = (piece for s in specs if s.name in shards for piece in
              cut_pieces(s, shards[s.name], s.split_dim, L.s_t == 1 or s.split_dim == 0, bucket_bytes))
    owner = functools.partial(_owner, L, layers, stages)
    gen = dict(gather_pieces(pieces, group, len(micro_group), stats, bucket_bytes, owner, _combine))
    stats.generation_bytes = sum(tensor_bytes(v) for v in gen.values())
    stats.seconds = time.perf_counter() - t0
    return gen, stats


def _owner(L: Layout, layers: int, stages: list[int], piece: Piece, m: int) -> str:
    """Member m's copy of a local piece is the same position in its own stage's layers."""
    spec = piece.key
    return _respec(spec, spec.layer % (layers // L.p), stages[m], layers, L.p).name


def _combine(piece: Piece, views: list[torch.Tensor]) -> torch.Tensor:
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
        parts = _gather(flat_input(shards[s.name] for s in bucket), group, len(mp_group), stats)
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


