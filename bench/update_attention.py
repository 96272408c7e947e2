"""One rank's actor update under each attention implementation, alternated in one process (issue 57).

bench/throughput.py's ablation runs whole jobs one after another, whose samples, and so the rows the update skips
(training.skipZeroAdvantageRows), differ from run to run; this times the same update on the same batch instead: the
FSDP engine as the job builds it on one rank (fp32 masters, the compute dtype `auto` picks, weights kept gathered and
gradients reduced once per step, shared prompts, dynamic micro-batches of the job's budget), SmolLM2-135M, a batch of
the throughput job's shape (16 prompts of 40-47 tokens x 4 responses of 8-32 tokens, random advantages), one optimizer
step per update. Between updates the weights and optimizer state are put back, so every implementation steps from
the same state and computes the same loss (printed: a check that they compute the same thing).

Implementations: `sdpa` (HF's, torch's CPU flash-attention kernel, backward in the compute dtype), `eager` (HF's
matmul attention: its probabilities saved for backward, memory quadratic in the sequence) and
engines.train.cpu_attention's (training.fp32AttentionBackward: the flash forward, its backward in fp32).

Usage: python bench/update_attention.py [--reps 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hybridflow.data.packing import pack_rollout  # noqa: E402
from hybridflow.engines.precision import compute_dtype  # noqa: E402
from hybridflow.engines.train import cpu_attention  # noqa: E402
from hybridflow.engines.train.fsdp import FSDPEngine, load_hf_model  # noqa: E402
from hybridflow.models.builders import build_smollm2, model_cache_dir  # noqa: E402
from hybridflow.single_controller.batch import Batch  # noqa: E402

PROMPTS, RESPONSES, P, R, MICRO = 16, 4, 48, 32, 8  # bench/throughput.py's job: microBatchSize 8


def batch() -> Batch:
    g = random.Random(0)
    prompts, responses = [], []
    for _ in range(PROMPTS):
        prompt = [g.randrange(100, 40000) for _ in range(g.randrange(40, P))]
        for _ in range(RESPONSES):
            prompts.append(prompt)
            responses.append([g.randrange(100, 40000) for _ in range(g.randrange(8, R + 1))])
    b = Batch(pack_rollout(prompts, responses, P, R))
    n = len(b)
    advantages = torch.randn(n, 1, generator=torch.Generator().manual_seed(0)).expand(n, R) * b["response_mask"]
    return b.with_columns(advantages=advantages.contiguous())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=4, help="updates per implementation, after one warm-up each")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the one rank's cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    store = tempfile.mkdtemp(prefix="update-attention")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    try:
        computes = compute_dtype("auto", "cpu")
        engine = FSDPEngine(load_hf_model(build_smollm2(model_cache_dir()), "float32"), 2e-6, 1.0, "cpu",
                            compute_dtype=computes, dynamic_batch_size=True, shared_prompt=True, keep_gathered=True,
                            reduce_per_step=True)
        data = batch()

        def loss_fn(model, mb):
            logp, _ = engine.log_probs(model, mb, 1.0)
            mask = mb["response_mask"].to(logp.dtype)
            loss = -(logp * mb["advantages"] * mask).sum() / mask.sum().clamp(min=1)
            return loss, {"loss": loss.item()}

        weights = [p.detach().clone() for p in engine.module.parameters()]
        engine.train_mini_batch(data, MICRO, loss_fn)  # the optimizer's state exists from here on
        state = copy.deepcopy(engine.optimizer.state_dict())
        impls = ["sdpa", "eager", cpu_attention.register()]
        seconds: dict[str, list[float]] = {name: [] for name in impls}
        losses: dict[str, float] = {}
        print(f"compute dtype {computes}; {len(data)} rows; {args.reps} updates each after a warm-up", flush=True)
        for rep in range(args.reps + 1):
            for name in impls:
                engine.module.config._attn_implementation = name
                t0 = time.perf_counter()
                stats = engine.train_mini_batch(data, MICRO, loss_fn)
                if rep:
                    seconds[name].append(time.perf_counter() - t0)
                losses[name] = stats["loss"]
                with torch.no_grad():
                    for p, w in zip(engine.module.parameters(), weights):
                        p.copy_(w)
                engine.optimizer.load_state_dict(state)
        base = statistics.median(seconds["sdpa"])
        print(f"{'attention':24} {'update s (median)':>18} {'/ sdpa':>8}   loss   updates")
        for name in impls:
            med = statistics.median(seconds[name])
            print(f"{name:24} {med:18.3f} {med / base:7.2f}x   {losses[name]:.4f}   "
                  + " ".join(f"{s:.2f}" for s in seconds[name]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
