"""Run one train -> generate transition on N local processes (gloo) and report what each rank measured.

Used by the tests (small models, checks every generation shard against the full model) and by
bench/reshard.py (a few hundred MB, timings). Processes are spawned, so this works from any script.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from typing import Any

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
            verify: bool, queue: Any) -> None:
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
        gen, stats = rs.reshard_hybridflow(L, rank, shards, specs, groups[mine], handles[mine])
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


def run_transition(L: lay.Layout, scheme: str, layers: int, hidden: int, verify: bool = True) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_worker, args=(r, L.world, init, L, scheme, layers, hidden, verify, queue))
                 for r in range(L.world)]
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
