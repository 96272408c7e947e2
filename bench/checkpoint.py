"""Checkpoint save and load of a SmolLM2-135M actor (fp32 weights + AdamW state, FSDP2 on two gloo ranks), measured
in one run, side by side:

  full     the format before sharding: the full state gathered to rank 0, one torch.save by rank 0
  sync     sharded (DCP): every rank writes its own shards, training waits for the write
  async    sharded, asynchronous: training waits only for the host copy; the write overlaps the next steps

and the cost of an asynchronous save to the training steps that run while it is written (step time with a write
in flight / without). Every save is fsynced and hashed, as the job's saves are.

    python bench/checkpoint.py [--steps 3] [--dir /tmp/bench-ckpt]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))


def _batch():
    from hybridflow.single_controller.batch import Batch
    from hybridflow.data.packing import pack_rollout

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (24,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(10, 1000, (24,), generator=g).tolist() for _ in range(4)]
    return Batch(pack_rollout(prompts, responses, 24, 24))


def _step(engine, batch) -> float:
    def loss_fn(model, mb):
        logp, _ = engine.log_probs(model, mb, 1.0)
        return -logp.mean(), {}
    t0 = time.perf_counter()
    engine.train_mini_batch(batch, 2, loss_fn)
    return time.perf_counter() - t0


def _rank(rank: int, world: int, store: str, model_dir: str, out_dir: str, steps: int, result: str) -> None:
    from hybridflow.checkpoint import dcp as sc
    from hybridflow.checkpoint.store import sha256
    from hybridflow.engines.train.fsdp import FSDPEngine, load_causal_lm

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out = Path(out_dir)
    engine = FSDPEngine(load_causal_lm(Path(model_dir), "float32"), 1e-5, 1.0, "cpu")
    batch = _batch().split(world)[rank]
    _step(engine, batch)  # AdamW state exists, as in any checkpoint after step 1
    r: dict[str, float] = {}

    def timed(name, fn):
        dist.barrier()
        t0 = time.perf_counter()
        value = fn()
        dist.barrier()
        r[name] = time.perf_counter() - t0
        return value

    def full_save():
        state = engine.state_dict()
        if rank == 0:
            path = out / "full" / "actor.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            sha256(path)

    timed("full_save", full_save)

    def full_load():
        from hybridflow.checkpoint.store import load_tensors
        engine.load_state_dict(load_tensors(out / "full" / "actor.pt"))

    timed("full_load", full_load)
    timed("sync_save", lambda: sc.save(engine.checkpoint_state(), out / "sync" / "actor", out / "sync"))

    def sharded_load():
        state = engine.checkpoint_state()
        sc.load(state, out / "sync" / "actor")
        engine.load_checkpoint_state(state)

    timed("sync_load", sharded_load)

    plain = [_step(engine, batch) for _ in range(steps)]
    dist.barrier()
    t0 = time.perf_counter()
    pending = sc.save_async(engine.checkpoint_state(), out / "async" / "actor", out / "async")
    r["async_blocking"] = time.perf_counter() - t0
    overlapped = []
    while not pending.done() or not overlapped:
        overlapped.append(_step(engine, batch))
    pending.result()
    r["async_total"] = time.perf_counter() - t0
    dist.barrier()
    r["step_plain"] = sorted(plain)[len(plain) // 2]
    r["step_during_async"] = sorted(overlapped)[len(overlapped) // 2]
    r["steps_overlapped"] = len(overlapped)
    r["bytes_full"] = (out / "full" / "actor.pt").stat().st_size
    r["bytes_sharded"] = sum(p.stat().st_size for p in (out / "sync" / "actor").iterdir())
    r["peak_rss_gb"] = __import__("resource").getrusage(__import__("resource").RUSAGE_SELF).ru_maxrss / 1e6
    gathered: list = [None] * world
    dist.all_gather_object(gathered, r)
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    from hybridflow.models.builders import build_smollm2

    cache = Path(os.environ.get("HYBRIDFLOW_MODEL_CACHE", Path.home() / ".cache" / "hybridflow"))
    model_dir = build_smollm2(cache)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        result = work / "result.json"
        mp.start_processes(_rank, args=(2, str(work / "store"), str(model_dir), str(work), args.steps, str(result)),
                           nprocs=2, join=True, start_method="spawn")
        ranks = json.loads(result.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = {k: max(x[k] for x in ranks) for k in ranks[0]}  # the slowest rank is what training waits for
    mb = r["bytes_sharded"] / 1e6
    print(f"SmolLM2-135M, fp32 weights + AdamW, FSDP2 on 2 gloo ranks: full file {r['bytes_full'] / 1e6:.0f} MB, "
          f"sharded {mb:.0f} MB")
    print(f"{'':34}{'seconds':>9}{'MB/s':>8}{'vs full':>9}")
    rows = [("save, full state on rank 0", r["full_save"], r["full_save"]),
            ("save, sharded, sync", r["sync_save"], r["full_save"]),
            ("save, sharded, async (blocking)", r["async_blocking"], r["full_save"]),
            ("save, sharded, async (until on disk)", r["async_total"], r["full_save"]),
            ("load, full state", r["full_load"], r["full_load"]),
            ("load, sharded", r["sync_load"], r["full_load"])]
    for name, secs, base in rows:
        print(f"{name:34}{secs:9.2f}{mb / secs:8.0f}{secs / base:9.2f}x")
    print(f"training step: {r['step_plain']:.2f}s alone, {r['step_during_async']:.2f}s while an async save is written "
          f"({r['step_during_async'] / r['step_plain']:.2f}x, {r['steps_overlapped']:.0f} step(s) overlapped); "
          f"peak RSS per rank {r['peak_rss_gb']:.2f} GB")


if __name__ == "__main__":
    main()
