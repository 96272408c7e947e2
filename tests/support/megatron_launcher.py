"""Run one forward/backward of the megatron training engine on N local gloo processes (as torchrun would) and
return what rank 0 saw: the loss, every response token's log-probability, the whole (TP-gathered) gradients under
HF names and the global gradient norm. Tests compare this against plain HF autograd on one process, which checks
the weight conversion, tensor parallelism, vocab-parallel log-probs/entropy and the data-parallel reduction at once.

`pipeline` mode does the same with the layers split into pipeline stages, run by megatron's own 1F1B schedule
(two micro-batches), point-to-point over gloo.

Test support, not runtime (tests/test_megatron.py; tests/test_megatron_checkpoint.py's ranks use `objective`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.single_controller.batch import Batch

ENTROPY_COEF = 0.1


def objective(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """A loss that exercises both outputs an actor update uses."""
    return -logp.mean() - ENTROPY_COEF * entropy.mean()


def run_rank(rank: int, world: int, init: str, cfg: dict) -> None:
    from hybridflow.engines.train import megatron_model as mm
    from hybridflow.engines.train.megatron import MegatronEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if cfg.get("pp", 1) > 1:
        return run_pipeline_rank(rank, world, cfg)
    engine = MegatronEngine(Path(cfg["model_dir"]), "float32", cfg["tp"], lr=1e-3, grad_clip=1e9, device="cpu")
    full = Batch(torch.load(cfg["batch"]))
    mine = full.split(len(full) // engine.dp_size)[engine.dp_rank]
    logp, logits = engine.log_probs(engine.module, mine, 1.0)
    loss = objective(logp, engine.entropy(logits))
    loss.backward()
    norm = engine.clip_grad_norm()  # averages over DP; grad_clip is huge, so nothing is scaled
    grads = {n: engine.gather_tp(n, p.grad) for n, p in engine.module.named_parameters()}
    hf_grads = mm.megatron_to_hf(grads, engine.shape)
    logps = [torch.empty_like(logp) for _ in range(world)]
    dist.all_gather(logps, logp.detach().contiguous())
    losses = [None] * world
    dist.all_gather_object(losses, loss.item())
    if rank == 0:
        tp0 = [r for r in range(world) if r % cfg["tp"] == 0]  # one rank per DP replica, in DP order
        torch.save({"loss": sum(losses[r] for r in tp0) / len(tp0), "log_probs": torch.cat([logps[r] for r in tp0]),
                    "grads": hf_grads, "grad_norm": float(norm)}, cfg["out"])
    dist.barrier()
    dist.destroy_process_group()


def run_pipeline_rank(rank: int, world: int, cfg: dict) -> None:
    """One 1F1B step over `world` pipeline stages (TP = DP = 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from transformers import AutoConfig

    from hybridflow.engines.train import megatron_model as mm
    from hybridflow.engines.train.megatron import (
        attention_inputs,
        init_model_parallel,
        load_hf_state,
        vocab_parallel_entropy,
        vocab_parallel_log_probs,
    )

    init_model_parallel(1, world)
    shape = mm.shape_from_hf(AutoConfig.from_pretrained(cfg["model_dir"]))
    tcfg = mm.transformer_config(shape)
    stage, per = ps.get_pipeline_model_parallel_rank(), shape.layers // world
    model = mm.build_gpt(tcfg, shape, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage())
    full = mm.hf_to_megatron(load_hf_state(Path(cfg["model_dir"])), shape)
    own = model.state_dict()
    own.update({k: full[mm.global_layer_name(k, stage * per)] for k in own if not k.endswith("_extra_state")})
    model.load_state_dict(own)
    batch = torch.load(cfg["batch"])
    ids, pos, mask = attention_inputs(batch)
    R, half = batch["responses"].shape[1], len(ids) // 2
    micro = [{"ids": ids[i:i + half], "pos": pos[i:i + half], "mask": mask[i:i + half],
              "responses": batch["responses"][i:i + half]} for i in (0, half)]

    def forward_step(data, m):
        mb = next(data)
        out = m(mb["ids"], mb["pos"], attention_mask=mb["mask"])

        def loss_func(logits):
            lg = logits[:, -R - 1: -1].float()
            logp = vocab_parallel_log_probs(lg, mb["responses"])
            loss = objective(logp, vocab_parallel_entropy(lg))
            return loss, {"loss": loss.detach(), "log_probs": logp.detach()}

        return out, loss_func

    tcfg.variable_seq_lengths = False
    outs = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                                       num_microbatches=2, seq_length=ids.shape[1], micro_batch_size=half)
    grads = {mm.global_layer_name(n, stage * per): p.grad for n, p in model.named_parameters()}
    every: list = [None] * world
    dist.all_gather_object(every, (grads, outs))
    if rank == 0:
        merged = {k: v for g, _ in every for k, v in g.items()}
        last = every[-1][1]  # the schedule scales each micro-batch loss by 1/num_microbatches
        torch.save({"loss": float(sum(o["loss"] for o in last)),
                    "log_probs": torch.cat([o["log_probs"] for o in last]),
                    "grads": mm.megatron_to_hf(merged, shape),
                    "grad_norm": float(torch.sqrt(sum(g.double().pow(2).sum() for g in merged.values())))},
                   cfg["out"])
    dist.barrier()
    dist.destroy_process_group()


def engine_step(model_dir: str, batch: dict[str, torch.Tensor], tp: int, world: int, pp: int = 1,
                timeout: float = 300) -> dict[str, Any]:
    """Launch `world` ranks (tp * dp, or pp stages) and return rank 0's view of one step."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"model_dir": model_dir, "tp": tp, "pp": pp, "batch": os.path.join(tmp, "batch.pt"),
               "out": os.path.join(tmp, "out.pt")}
        torch.save(batch, cfg["batch"])
        init = f"file://{os.path.join(tmp, 'rdzv')}"
        # each rank runs this file as a script: it needs only the installed hybridflow, not tests/ on sys.path
        procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), init, json.dumps(cfg)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        try:
            for p in procs:
                _, err = p.communicate(timeout=timeout)
                if p.returncode:
                    raise RuntimeError(f"megatron rank exited with {p.returncode}: {err[-3000:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        return torch.load(cfg["out"])


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
