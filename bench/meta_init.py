"""Per-rank peak memory while an FSDP engine loads a model: meta-device init with sharded loading (each rank reads only
its own rows of the safetensors files) against the old path (the whole model loaded on every rank, then sharded).

    python bench/meta_init.py                    # a 0.5B-shaped Qwen2 (Qwen2.5-0.5B's config, random weights), 2 ranks
    python bench/meta_init.py --ranks 2 --layers 4   # a smaller one, quicker

One invocation measures both paths side by side, each in fresh processes (gloo, one per rank). A rank's load peak is
its resident high-water mark while the engine is built (VmHWM, restarted through /proc/self/clear_refs once torch,
transformers and the process group are up) less what it held then (VmRSS: "the runtime"). The goal (issue 50): peak <= 1.3 x M / N above the runtime, M the model's bytes in its master dtype
(fp32), N the ranks. The checkpoint is written in bf16, as published models are.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

GIB = 1 << 30


def _qwen05b(layers: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


def make_checkpoint(directory: Path, layers: int) -> int:
    """A random model of the shape, saved as bf16 safetensors; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.models.builders import save_hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_qwen05b(layers), dtype=torch.bfloat16)
    save_hf(model, directory)
    return sum(p.numel() for p in model.parameters())


def _rank(rank: int, world: int, store: str, model_dir: str, path: str, out: str) -> None:
    import torch.distributed as dist

    from hybridflow.engines.train import fsdp
    from hybridflow.engines.train.base import TrainSettings
    from hybridflow.roles.common import memory_in_use_bytes, peak_memory_bytes, reset_peak_memory, status_bytes
    from hybridflow.single_controller.context import WorkerContext

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if not reset_peak_memory():  # the high-water mark restarts here: imports' peaks do not count
        raise SystemExit("this kernel cannot reset the resident high-water mark (/proc/self/clear_refs)")
    before, anon_before = memory_in_use_bytes(), status_bytes("RssAnon")
    anon_peak = [anon_before]
    done = threading.Event()

    def sample() -> None:  # the kernel keeps no high-water mark of anonymous memory alone: sampled every 2 ms
        while not done.wait(0.002):
            anon_peak[0] = max(anon_peak[0], status_bytes("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    settings = TrainSettings(Path(model_dir), "bfloat16", "lm", lr=1e-6)
    if path == "old":  # the whole model on every rank, then sharded (the engine before meta-device init)
        model = fsdp.load_hf_model(Path(model_dir), "float32")
        engine = fsdp.FSDPEngine(model, 1e-6, 1.0, "cpu", compute_dtype=fsdp.compute_dtype("bfloat16", "cpu"))
        del model
    else:
        engine = fsdp.build(WorkerContext(rank, world, rank, "cpu"), settings)
    shard = sum(p.to_local().numel() * p.element_size() for p in engine.module.parameters())
    after = peak_memory_bytes()
    done.set()
    sampler.join()
    Path(out, f"{path}-{rank}.json").write_text(json.dumps({"runtime": before, "peak": after, "shard": shard,
                                                            "anon": anon_peak[0] - anon_before}))
    dist.barrier()
    dist.destroy_process_group()


def measure(path: str, model_dir: Path, ranks: int, work: Path) -> list[dict]:
    import torch.multiprocessing as mp

    store = work / f"store-{path}"
    mp.spawn(_rank, args=(ranks, str(store), str(model_dir), path, str(work)), nprocs=ranks, join=True)
    return [json.loads((work / f"{path}-{r}.json").read_text()) for r in range(ranks)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24, help="Qwen2.5-0.5B has 24")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = make_checkpoint(work / "model", args.layers)
        m = params * 4  # fp32 master
        print(f"model: {params / 1e6:.0f} M parameters (0.5B shape, {args.layers} layers), M = {m / GIB:.2f} GiB in "
              f"fp32, checkpoint {sum(f.stat().st_size for f in (work / 'model').glob('*.safetensors')) / GIB:.2f} "
              f"GiB bf16; N = {args.ranks} ranks; goal: load peak <= 1.3 x M/N = {1.3 * m / args.ranks / GIB:.2f} GiB")
        rows = {path: measure(path, work / "model", args.ranks, work) for path in ("old", "meta")}
    print(f"{'path':<6} {'rank':>4} {'runtime GiB':>12} {'load peak GiB':>14} {'of which anon':>14} "
          f"{'shard GiB':>10} {'anon / (M/N)':>13}")
    for path, rs in rows.items():
        for r, row in enumerate(rs):
            load = row["peak"] - row["runtime"]
            print(f"{path:<6} {r:>4} {row['runtime'] / GIB:>12.2f} {load / GIB:>14.2f} {row['anon'] / GIB:>14.2f} "
                  f"{row['shard'] / GIB:>10.2f} {row['anon'] / (m / args.ranks):>13.2f}")
    worst = {path: max(row["anon"] for row in rs) for path, rs in rows.items()}
    print("load peak: resident high-water mark, the checkpoint's mmapped pages included (page cache, shared and "
          "reclaimable; on a GPU they are not device memory); anon: the process's own memory (sampled)")
    print(f"meta / old anon load peak: {worst['meta'] / worst['old']:.2f}x; meta within 1.3 x M/N: "
          f"{worst['meta'] <= 1.3 * m / args.ranks}")
    return 0 if worst["meta"] <= 1.3 * m / args.ranks else 1


if __name__ == "__main__":
    sys.exit(main())
