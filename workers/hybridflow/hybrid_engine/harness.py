"""Run one train -> generate transition on N local processes (gloo) and report what each rank measured.

Used by the tests (small models, checks every generation shard against the full model) and by
bench/reshard.py (a few hundred MB, timings). Processes are spawned, so this works from any script.
run_megatron_gather does the same for the actor's path (gather_micro_dp over megatron-named TP shards).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.hybrid_engine import layout as lay
from hybridflow.hybrid_engine import reshard as rs

SCHEMES = ("hybridflow", "hybridflow-v", "deepspeed-chat")


def _groups_for(L: lay.Layout, scheme: str) -> list[list[int]]:
    if scheme == "hybridflow":
        return lay.micro_dp_groups(L)
    if scheme == "hybridflow-v":
        return lay.model_parallel_groups(L)
    return [list(range(L.world))]


def _worker(rank: int, world: int, init: str, L: lay.Layout, scheme: str, layers: int, hidden: int,
            verify: bool, bucket_bytes: int, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    specs = rs.decoder_specs(layers, hidden)
    groups = _groups_for(L, scheme)
    handles = [dist.new_group(g) for g in groups]  # every rank creates every group, in the same order
    mine = next(i for i, g in enumerate(groups) if rank in g)
    if scheme == "deepspeed-chat":
        shards = rs.zero3_shards(world, rank, specs)
    else:
        shards = rs.train_shards(L, rank, specs)
    dist.barrier()
    if scheme == "hybridflow":
        gen, stats = rs.reshard_hybridflow(L, rank, shards, specs, groups[mine], handles[mine], bucket_bytes)
    elif scheme == "hybridflow-v":
        gen, stats = rs.reshard_gather_all(L, rank, shards, specs, groups[mine], handles[mine])
    else:
        gen, stats = rs.reshard_deepspeed_chat(L, rank, shards, specs, handles[mine])
    dist.barrier()
    ok = None
    if verify:
        naive = scheme != "hybridflow"
        if scheme == "deepspeed-chat":
            expected = {s.name: rs.tp_slice(rs.full_param(s), s.split_dim, (rank % L.t) // L.s_t, L.t_g) for s in specs}
        else:
            expected = rs.expected_generation_shard(L, rank, specs, naive=naive)
        ok = gen.keys() == expected.keys() and all(torch.equal(gen[k], expected[k]) for k in expected)
        # zero redundancy: under HybridFlow the training shard is literally a part of the generation shard
        if scheme == "hybridflow":
            for name, t in shards.items():
                spec = next(s for s in specs if s.name == name)
                if spec.split_dim is not None:
                    tp = L.coords(rank)[0]
                    within = tp % L.s_t
                    ok = ok and torch.equal(rs.tp_slice(gen[name], spec.split_dim, within, L.s_t), t)
    queue.put({"rank": rank, **asdict(stats), "ok": ok})
    dist.destroy_process_group()


def run_transition(L: lay.Layout, scheme: str, layers: int, hidden: int, verify: bool = True,
                   bucket_bytes: int = rs.BUCKET_BYTES) -> list[dict]:
    """One transition on L.world spawned ranks; each rank's ReshardStats (and `ok`: its generation weights equal
    the model's, when verify). bucket_bytes sizes HybridFlow's all-gathers; the baselines ignore it."""
    return _spawn(_worker, L.world, L, scheme, layers, hidden, verify, bucket_bytes)


def megatron_weights(hidden: int = 32, layers: int = 2) -> dict[str, torch.Tensor]:
    """Whole megatron-named weights covering every sharding rule (column, row, gated, replicated), in megatron's
    order, bf16 matrices beside fp32 norms as in mixed-precision training: buckets must not mix dtypes."""
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(dtype)

    out = {"embedding.word_embeddings.weight": w(8 * hidden, hidden)}
    for i in range(layers):
        h = f"decoder.layers.{i}."
        out |= {h + "input_layernorm.weight": w(hidden, dtype=torch.float32),
                h + "self_attention.linear_qkv.weight": w(3 * hidden, hidden),
                h + "self_attention.linear_qkv.bias": w(3 * hidden),
                h + "self_attention.linear_proj.weight": w(hidden, hidden),
                h + "pre_mlp_layernorm.weight": w(hidden, dtype=torch.float32),
                h + "mlp.linear_fc1.weight": w(8 * hidden, hidden),
                h + "mlp.linear_fc2.weight": w(hidden, 4 * hidden)}
    out["decoder.final_layernorm.weight"] = w(hidden, dtype=torch.float32)
    return out


def _megatron_worker(rank: int, world: int, init: str, L: lay.Layout, bucket_bytes: int, queue: Any) -> None:
    """The actor's transition (gather_micro_dp over megatron TP shards), checked against sharding the whole
    weights t_g ways: every generation shard, in order, bit for bit."""
    from hybridflow.engines import megatron_model as mm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    groups = lay.micro_dp_groups(L)
    handles = [dist.new_group(g) for g in groups]
    mine = next(i for i, g in enumerate(groups) if rank in g)
    full = megatron_weights()
    tp, j = L.coords(rank)[0], lay.gen_tp_rank(L, rank)
    stats = rs.ReshardStats()
    shards = ((name, mm.shard(name, w, L.t, tp)) for name, w in full.items())
    gen = list(rs.gather_micro_dp(shards, handles[mine], len(groups[mine]), stats, bucket_bytes))
    ok = [name for name, _ in gen] == list(full) and all(
        t.dtype == full[name].dtype and torch.equal(t, mm.shard(name, full[name], L.t_g, j)) for name, t in gen)
    queue.put({"rank": rank, **asdict(stats), "ok": ok})
    dist.destroy_process_group()


def run_megatron_gather(L: lay.Layout, bucket_bytes: int = rs.BUCKET_BYTES) -> list[dict]:
    """gather_micro_dp on L.world spawned ranks (tensor x data parallel layouts): each rank's ReshardStats and `ok`."""
    return _spawn(_megatron_worker, L.world, L, bucket_bytes)


def _spawn(target: Callable, world: int, *args: Any) -> list[dict]:
    """Runs target(rank, world, init, *args, queue) on `world` spawned processes; what each put, by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=target, args=(r, world, init, *args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = []
        while len(results) < len(procs):
            try:
                results.append(queue.get(timeout=1))
            except Exception:  # queue.Empty: check nobody died before reporting
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"a transition worker died (exit codes {dead})") from None
        for p in procs:
            p.join(60)
            if p.exitcode not in (0, None):
                raise RuntimeError(f"a transition worker exited with {p.exitcode}")
    return sorted(results, key=lambda r: r["rank"])
