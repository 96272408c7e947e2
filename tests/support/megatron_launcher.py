"""Run one forward/backward of the megatron training engine on N local gloo processes (as torchrun would), in each
of several layouts one after another on the same processes (megatron's process groups made again for each), and
return what rank 0 saw in each: the loss, every response token's log-probability, the whole (TP-gathered)
gradients under HF names and the global gradient norm. Tests compare this against plain HF autograd on one
process, which checks the weight conversion, tensor parallelism, vocab-parallel log-probs/entropy and the
data-parallel reduction at once.

With `pp` > 1 the layers are split into pipeline stages, run by megatron's own schedules (two micro-batches),
point-to-point over gloo.

Test support, not runtime (tests/engines/test_megatron.py; tests/checkpoint/test_megatron_checkpoint.py's ranks use
`objective` and `in_each_layout`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridflow.single_controller.batch import Batch

ENTROPY_COEF = 0.1


def objective(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """A loss that exercises both outputs an actor update uses."""
    return -logp.mean() - ENTROPY_COEF * entropy.mean()


def in_each_layout(rank: int, world: int, init: str, layouts: list[dict], run: Callable[[dict], None]) -> None:
    """`run` each layout in turn on one gloo world, megatron's process groups made anew for each (the engine's
    init_model_parallel): spawning the ranks (importing torch and megatron-core) costs far more than a step of these
    small models, so one spawn serves every layout."""
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for cfg in layouts:
            run(cfg)
            dist.barrier()
            ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def run_layout(rank: int, world: int, cfg: dict) -> None:
    """The engine's own path: log-probs through `forward_micro`, then one `train_mini_batch` over two micro-batches
    (through megatron's 1F1B schedule when the layers are split into pipeline stages)."""
    from hybridflow.engines.train import megatron_model as mm
    from hybridflow.engines.train.megatron import MegatronEngine

    engine = MegatronEngine(Path(cfg["model_dir"]), "float32", cfg["tp"], lr=1e-3, grad_clip=1e9, device="cpu",
                            pp=cfg.get("pp", 1))
    full = Batch(torch.load(cfg["batch"]))
    mine = full.split(len(full) // engine.dp_size)[engine.dp_rank]
    micro = max(1, len(mine) // 2)
    logp = engine.forward_micro(mine, micro, lambda model, mb: engine.log_probs(model, mb, 1.0)[0])

    def loss_fn(model, mb):
        lp, logits = engine.log_probs(model, mb, 1.0)
        loss = objective(lp, engine.entropy(logits))
        return loss, {"loss": loss.detach()}

    from gradients import gradients_at_step  # a rank runs this file as a script: its directory is on sys.path

    with gradients_at_step(engine.optimizer, engine.named_parameters) as raw:  # freed once stepped
        stats = engine.train_mini_batch(mine, micro, loss_fn)  # averages over DP; grad_clip is huge: nothing scaled
    grads = {n: engine.gather_tp(n, raw[n]) for n, p in engine.named_parameters() if p is not engine.tied_copy}
    every: list = [None] * world
    dist.all_gather_object(every, (engine.dp_rank, engine.dp_size, stats["loss"], logp, grads))
    if rank == 0:
        replicas = {dp: (loss, lp) for dp, _, loss, lp, _ in every}  # every rank of a replica returns the same
        merged = {k: v for *_, g in every for k, v in g.items()}
        torch.save({"loss": sum(loss for loss, _ in replicas.values()) / len(replicas),
                    "log_probs": torch.cat([replicas[dp][1] for dp in sorted(replicas)]),
                    "grads": mm.megatron_to_hf(merged, engine.shape), "grad_norm": stats["grad_norm"]}, cfg["out"])


def engine_steps(layouts: list[tuple[str, int, int]], batch: dict[str, torch.Tensor], world: int,
                 timeout: float = 300) -> list[dict[str, Any]]:
    """Launch `world` ranks once and return rank 0's view of one step in each layout, a (model_dir, tp, pp) whose
    data-parallel size is world / (tp * pp)."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(batch, os.path.join(tmp, "batch.pt"))
        cfgs = [{"model_dir": model_dir, "tp": tp, "pp": pp, "batch": os.path.join(tmp, "batch.pt")}
                for model_dir, tp, pp in layouts]
        return spawn_ranks(__file__, Path(tmp), world, cfgs, timeout)


def spawn_ranks(script: str, tmp: Path, world: int, layouts: list[dict], timeout: float = 300) -> list[Any]:
    """Run `script RANK WORLD INIT LAYOUTS` as `world` local processes (tests/ on their PYTHONPATH) and return what
    rank 0 saved at each layout's `out`; the first rank to fail, or the timeout, ends them all (its log's end in the
    error), and none outlives this call."""
    from support.paths import TESTS

    tag = f"megatron-{time.monotonic_ns()}"
    layouts = [{**cfg, "out": str(tmp / f"{tag}-{i}.pt")} for i, cfg in enumerate(layouts)]
    init = f"file://{tmp / f'{tag}.rdzv'}"
    logs = [open(tmp / f"{tag}-{r}.log", "w+") for r in range(world)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, script, str(r), str(world), init, json.dumps(layouts)], env=env,
                              stdout=subprocess.DEVNULL, stderr=logs[r]) for r in range(world)]
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        failed = [r for r, p in enumerate(procs) if p.returncode] or [r for r, p in enumerate(procs)
                                                                     if p.poll() is None]
        if failed:
            r = failed[0]
            what = f"exited with {procs[r].returncode}" if procs[r].returncode else f"still ran after {timeout} s"
            logs[r].seek(0)
            raise RuntimeError(f"{tag} rank {r} {what}:\n{logs[r].read()[-3000:]}")
        return [torch.load(cfg["out"]) for cfg in layouts]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()


if __name__ == "__main__":
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    in_each_layout(rank, world, sys.argv[3], json.loads(sys.argv[4]), lambda cfg: run_layout(rank, world, cfg))
