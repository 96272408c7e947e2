"""Run one forward/backward of a megatron GPTModel at a given TP size on spawned gloo processes and return the
loss and the full (unsharded) gradients: how the tests show that TP=2 computes what TP=1 computes."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.engines import megatron_model as mm

CFG = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
VOCAB, SEQ = 32, 12


def run_rank(rank: int, tp: int, init: str, state_path: str, tokens: torch.Tensor, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    from hybridflow.engines.megatron_cpu import apply_cpu_fallbacks

    apply_cpu_fallbacks()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(0)
    model = mm.build_gpt(mm.transformer_config(**CFG), VOCAB, 64, tie_embeddings=False)
    if not os.path.exists(state_path):  # first run: this (TP=1) model's weights become the reference
        assert tp == 1
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")},
                   state_path)
    full = torch.load(state_path)
    own = model.state_dict()
    own.update({k: mm.shard(k, v, tp, rank) for k, v in full.items()})
    model.load_state_dict(own)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    loss = model(ids, pos, attention_mask=None, labels=labels).float().mean()  # vocab-parallel cross entropy
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        parts = [torch.empty_like(p.grad) for _ in range(tp)]
        dist.all_gather(parts, p.grad.contiguous())
        grads[name] = mm.unshard(name, parts)
    if rank == 0:
        torch.save({"loss": loss.item(), "grads": grads}, out_path)
    dist.barrier()
    dist.destroy_process_group()


def loss_and_grads(tp: int, state_path: str, tokens: torch.Tensor, timeout: float = 300) -> dict[str, Any]:
    """Launch `tp` processes (as torchrun would) and return rank 0's loss and full gradients."""
    with tempfile.TemporaryDirectory() as tmp:
        tok_path, out_path = os.path.join(tmp, "tokens.pt"), os.path.join(tmp, "out.pt")
        torch.save(tokens, tok_path)
        init = f"file://{os.path.join(tmp, 'rdzv')}"
        procs = [subprocess.Popen([sys.executable, "-m", "hybridflow.engines.megatron_check", str(r), str(tp), init,
                                   state_path, tok_path, out_path], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for r in range(tp)]
        try:
            for p in procs:
                _, err = p.communicate(timeout=timeout)
                if p.returncode:
                    raise RuntimeError(f"megatron rank exited with {p.returncode}: {err[-2000:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        return torch.load(out_path)


if __name__ == "__main__":
    r, w, init_, state, tok, out = sys.argv[1:7]
    run_rank(int(r), int(w), init_, state, torch.load(tok), out)
