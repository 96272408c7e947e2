"""The train -> generate transition, for real, over torch.distributed (gloo on CPU, NCCL on GPU).

Parameters are Megatron-style: column-parallel weights split along dim 0, row-parallel along dim 1, replicated
ones (norms) not split; layers split into contiguous pipeline stages. Three ways to build generation weights:

* `hybridflow`: one all-gather per bucket (one layer) inside the micro-DP group; the result *is* this rank's
  generation shard. Nothing is gathered twice and nothing is thrown away.
* `hybridflow-v`: all-gather inside the whole model-parallel group of the replica, then keep the (naive)
  generation slice: everyone transiently holds the full model.
* `deepspeed-chat`: ZeRO-3 shards (1/N of every flat parameter) all-gathered over the whole world.

Each returns the generation weights and what it cost (bytes received by this rank, peak transient bytes, seconds).
Generate -> train needs no communication: training shards are never dropped, generation weights are freed.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from hybridflow.hybrid_engine.layout import Layout, gen_shard, naive_gen_shard, train_shard


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


def _flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _gather(flat: torch.Tensor, group: dist.ProcessGroup, size: int, stats: ReshardStats) -> list[torch.Tensor]:
    parts = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(parts, flat, group=group)
    stats.bytes_received += (size - 1) * flat.numel() * flat.element_size()
    return parts


def _unflatten(flat: torch.Tensor, bucket: list[ParamSpec], shard_shape) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for s in bucket:
        shape = shard_shape(s)
        n = int(torch.Size(shape).numel())
        out[s.name] = flat[offset: offset + n].view(shape)
        offset += n
    return out


def _slice_shape(s: ParamSpec, parts: int) -> tuple[int, ...]:
    if s.split_dim is None:
        return s.shape
    shape = list(s.shape)
    shape[s.split_dim] //= parts
    return tuple(shape)


def reshard_hybridflow(L: Layout, rank: int, shards: dict, specs: list[ParamSpec], micro_group: list[int],
                       group: dist.ProcessGroup) -> tuple[dict, ReshardStats]:
    """All-gather inside the micro-DP group, one layer at a time, into this rank's generation shard."""
    stats = ReshardStats()
    t0 = time.perf_counter()
    layers = max(s.layer for s in specs) + 1
    members = [train_shard(L, r) for r in micro_group]  # (tp, pp) of each member, in group order
    local_buckets = _buckets(shards, specs)
    gen: dict[str, torch.Tensor] = {}
    for k, bucket in enumerate(local_buckets):
        flat = _flatten(shards[s.name] for s in bucket)
        parts = _gather(flat, group, len(micro_group), stats)
        stats.peak_transient_bytes = max(stats.peak_transient_bytes, sum(p.numel() * p.element_size() for p in parts))
        # member m's k-th bucket holds its TP slice of the k-th layer of its stage
        per_member = [_unflatten(p, [_respec(s, k, members[m][1], layers, L.p) for s in bucket],
                                 lambda s: _slice_shape(s, L.t)) for m, p in enumerate(parts)]
        layer_ids = sorted({_layer_at(k, pp, layers, L.p) for _, pp in members})
        for layer in layer_ids:
            for s in (x for x in specs if x.layer == layer):
                pieces = [(tp, per_member[m][s.name]) for m, (tp, pp) in enumerate(members)
                          if _layer_at(k, pp, layers, L.p) == layer]
                pieces.sort(key=lambda x: x[0])
                gen[s.name] = pieces[0][1].clone() if s.split_dim is None else torch.cat(
                    [p for _, p in pieces], dim=s.split_dim)
    stats.generation_bytes = sum(v.numel() * v.element_size() for v in gen.values())
    stats.seconds = time.perf_counter() - t0
    return gen, stats


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

def _bucket_key(name: str) -> str:
    """Parameters of one decoder layer travel together; anything else (embedding, final norm) alone."""
    parts = name.split(".")
    return ".".join(parts[:3]) if name.startswith("decoder.layers.") else name


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, size: int,
                   stats: ReshardStats):
    """One all-gather of a bucket's flattened shards; each member's pieces unsharded into the generation shard."""
    from hybridflow.engines.megatron_model import split_rule, unshard

    if size == 1:
        yield from bucket
        return
    parts = _gather(_flatten(t for _, t in bucket), group, size, stats)
    stats.peak_transient_bytes = max(stats.peak_transient_bytes, sum(p.numel() * p.element_size() for p in parts))
    offset = 0
    for name, t in bucket:
        n = t.numel()
        pieces = [p[offset: offset + n].view(t.shape) for p in parts]
        offset += n
        yield name, pieces[0].clone() if split_rule(name) == "replicated" else unshard(name, pieces)


def gather_micro_dp(named_shards: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, size: int,
                    stats: ReshardStats):
    """HybridFlow's train -> generate transition for megatron TP shards: one all-gather per layer inside the
    micro-DP group (consecutive TP ranks), each gathered list unsharded into this rank's generation shard.

    Yields (megatron name, generation shard) as buckets complete, so the consumer installs a layer before the
    next is gathered; with size 1 there is nothing to gather and the training shard itself is yielded."""
    t0 = time.perf_counter()
    for _, items in itertools.groupby(named_shards, key=lambda item: _bucket_key(item[0])):
        for name, gen in _gather_bucket(list(items), group, size, stats):
            stats.generation_bytes += gen.numel() * gen.element_size()
            yield name, gen
    stats.seconds = time.perf_counter() - t0
