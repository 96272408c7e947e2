"""Meta-device init + sharded load: one rank builds a Qwen2.5-1.5B-shaped actor (random bf16 safetensors written
first) through fsdp.build, in this process: the model on the meta device, sharded, then only its shards read.
torch's CUDA allocator peak while it builds is judged against the goal (<= 1.3 x M/N) and the memory model's
prediction (within 15%). The CPU smoke run: a small shape, the resident anonymous memory reported, not judged."""
from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_harness import Record, Settings, limit

from support.gpu_jobs import GIB, LOAD_GOAL, LOAD_TOLERANCE, QWEN25_15B, SMALL_LOAD, job_doc, parse

pytestmark = [pytest.mark.gpu, limit("T_META_LOAD", 60)]


def write_checkpoint(directory: Path, config: dict[str, Any], gpu: bool) -> dict[str, int]:
    """A random Qwen2 model of `config`, written as one bf16 safetensors file (as published models are) with its
    config.json. Tensors are drawn one at a time (on the GPU when there is one), so the writer never holds more than
    the checkpoint's bf16 bytes in host memory."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**config)
    with init_empty_weights():
        shapes = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    shapes.tie_weights()  # from_config leaves a tied head a parameter of its own (fsdp.empty_hf_model does the same)
    device = "cuda" if gpu else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    weights: dict[str, Any] = {}
    for name, p in shapes.named_parameters():  # tied: lm_head shares embed_tokens and is listed once
        t = torch.empty(tuple(p.shape), dtype=torch.bfloat16, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=gen)
        weights[name] = t.cpu()
        del t
    directory.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(directory)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    largest = max(weights.values(), key=lambda t: t.numel())
    out = {"params": sum(t.numel() for t in weights.values()), "largest_numel": largest.numel(),
           "checkpoint_bytes": (directory / "model.safetensors").stat().st_size}
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return out


def predicted_load_bytes(model_dir: Path, device: str, ranks: int) -> dict[str, Any]:
    """What one rank should hold once the engine is built, and at most while it loads: the memory model's actor
    "fp32 master weights" term per device (hybridflow.memory.pool_plans over the model directory's shapes), plus the
    load's transient, which the memory model has no phase for: the largest tensor in fp32 (one checkpoint tensor
    converted from bf16 into its fp32 shard)."""
    from hybridflow.memory import pool_plans, read_shapes

    doc = job_doc("fsdp", device, 1, str(model_dir.parent / "ckpt"), "hf")
    doc["spec"]["models"]["actor"] = {"source": "path", "path": str(model_dir), "dtype": "bfloat16"}
    doc["spec"]["resourcePools"][0]["devicesPerNode"] = ranks
    job = parse(doc)
    shapes = read_shapes(job.spec, model_dir)
    plan = next(p for p in pool_plans(job.spec, shapes) if p.index == 0)
    term = next(t for t in plan.terms if t.role == "actor" and t.what.startswith("fp32 master weights"))
    return {"master": int(term.phases["update"]), "model_params": shapes["actor"].params,
            "source": f"hybridflow.memory: the actor's '{term.what}' term ({shapes['actor'].params} parameters)"}


class AnonPeak:
    """The process's resident anonymous memory (RssAnon), sampled every 2 ms on a thread (the kernel keeps no
    high-water mark of it; VmHWM would count the checkpoint's mmapped page cache): the rise over its start."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = self._peak = 0

    @staticmethod
    def _anon() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._done.wait(0.002):
            self._peak = max(self._peak, self._anon())

    def start(self) -> None:
        self._start = self._peak = self._anon()
        self._thread.start()

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        self._peak = max(self._peak, self._anon())
        return self._peak - self._start


def loaded_equal(module, model_dir: Path) -> dict[str, bool]:
    """A few of the engine's fp32 shards against the checkpoint's bf16 tensors cast to fp32 (rank 0 of 1: whole)."""
    import torch
    from safetensors import safe_open

    names = dict(module.named_parameters())
    out = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as st:
        keys = list(st.keys())
        for key in [k for k in keys if "embed_tokens" in k] + [k for k in keys if "layers.0." in k][:2] + \
                [k for k in keys if k.endswith("norm.weight") and "layers" not in k]:
            p = names.get(key)
            if p is None:
                out[key] = False
                continue
            have = (p.to_local() if hasattr(p, "to_local") else p).detach().cpu()
            out[key] = bool(torch.equal(have, st.get_tensor(key).to(torch.float32)[:have.shape[0]]))
    return out


def test_meta_load(suite: Settings, check: Record) -> None:
    """Meta-device init + sharded load (Qwen2.5-1.5B shape, 1 rank): peak memory vs the goal and the memory model."""
    import torch
    import torch.distributed as dist

    from hybridflow.engines.train import fsdp
    from hybridflow.engines.train.base import TrainSettings
    from hybridflow.single_controller.context import WorkerContext
    from hybridflow.single_controller.local_devices import process_group_backend

    c, gpu = check, not suite.cpu
    config = SMALL_LOAD if suite.cpu else QWEN25_15B
    work = Path(tempfile.mkdtemp(prefix="gpu_check_meta", dir=os.environ.get("GPU_CHECK_TMP", "/tmp")))
    model_dir = work / "model"
    c.facts["config"] = config
    try:
        if gpu:
            torch.cuda.set_device(0)
        t0 = time.perf_counter()
        ck = write_checkpoint(model_dir, config, gpu)
        c.facts.update(ck, write_seconds=round(time.perf_counter() - t0, 2))
        m = 4 * ck["params"]  # M: the model in fp32 (its master dtype); N = 1 rank
        dist.init_process_group(process_group_backend(suite.device), init_method=f"file://{work / 'store'}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=120))
        c.facts["backend"] = str(dist.get_backend())
        anon = AnonPeak()
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            free0, total = torch.cuda.mem_get_info()
        else:
            anon.start()
        t0 = time.perf_counter()
        engine = fsdp.build(WorkerContext(0, 1, 0, suite.device), TrainSettings(model_dir, "bfloat16", "lm", lr=1e-6))
        if gpu:
            torch.cuda.synchronize()
        c.facts["load_seconds"] = load_s = round(time.perf_counter() - t0, 2)
        if gpu:
            peak = torch.cuda.max_memory_allocated() - base
            held = torch.cuda.memory_allocated() - base
            free1, _ = torch.cuda.mem_get_info()
            c.facts.update(peak_allocated=peak, held_allocated=held, reserved=torch.cuda.memory_reserved(),
                           device_used_before=total - free0, device_used_after=total - free1, device_total=total,
                           gpu=torch.cuda.get_device_name())
        else:
            peak, held = anon.stop(), None
            c.facts["anon_peak"] = peak
        params = list(engine.module.parameters())
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        shard_bytes = sum(t.numel() * t.element_size() for t in local)
        c.facts.update(param_dtypes=sorted({str(p.dtype) for p in params}),
                       shard_devices=sorted({str(t.device) for t in local}), shard_bytes=shard_bytes,
                       compute_dtype=str(engine.compute_dtype), meta_left=sum(p.is_meta for p in params))
        c.expect(c.facts["param_dtypes"] == ["torch.float32"], f"parameters in {c.facts['param_dtypes']}")
        c.expect(c.facts["meta_left"] == 0, f"{c.facts['meta_left']} parameters still on the meta device")
        c.expect(str(engine.compute_dtype) == "torch.bfloat16", f"compute dtype {engine.compute_dtype}")
        if gpu:
            c.expect(all(d.startswith("cuda") for d in c.facts["shard_devices"]),
                     f"shards on {c.facts['shard_devices']}")
        c.facts["loaded_equal"] = same = loaded_equal(engine.module, model_dir)
        c.expect(all(same.values()), f"loaded weights differ from the checkpoint's (cast to fp32): {same}")
        pred = predicted_load_bytes(model_dir, suite.device, 1)
        pred["transient"] = 4 * ck["largest_numel"]
        pred["predicted"] = pred["master"] + pred["transient"]
        c.facts["prediction"] = pred
        c.expect(pred["model_params"] == ck["params"], f"the memory model counts {pred['model_params']} "
                                                       f"parameters, the checkpoint has {ck['params']}")
        ratio = peak / pred["predicted"]
        c.facts["peak_over_predicted"] = round(ratio, 4)
        c.facts["peak_over_m_per_n"] = round(peak / m, 4)
        what = "CUDA allocator peak" if gpu else "anonymous-memory peak (sampled)"
        c.summary = (f"{ck['params'] / 1e6:.1f} M params, load {load_s:.1f} s; {what} {peak / GIB:.2f} GiB = "
                     f"{peak / m:.2f} x M/N (goal <= {LOAD_GOAL}); predicted {pred['predicted'] / GIB:.2f} GiB "
                     f"(master {pred['master'] / GIB:.2f} + transient {pred['transient'] / GIB:.2f}): "
                     f"measured/predicted {ratio:.2f}")
        if gpu:
            c.summary += f"; held after the load {held / GIB:.2f} GiB"
            c.expect(peak <= LOAD_GOAL * m, f"load peak {peak / GIB:.2f} GiB > {LOAD_GOAL} x M/N = "
                                            f"{LOAD_GOAL * m / GIB:.2f} GiB")
            c.expect(abs(ratio - 1) <= LOAD_TOLERANCE, f"load peak {peak / GIB:.2f} GiB is {ratio:.2f} x the "
                                                       f"prediction {pred['predicted'] / GIB:.2f} GiB (tolerance "
                                                       f"{LOAD_TOLERANCE:.0%})")
            c.expect(held >= shard_bytes, f"held {held / GIB:.2f} GiB after the load, less than the fp32 shards "
                                          f"{shard_bytes / GIB:.2f} GiB")
        else:
            c.note("CPU smoke run: a small shape; the memory is reported, not judged (on the GPU: torch's allocator "
                   "peak against the goal and the prediction)")
        c.note(f"prediction source: {pred['source']}; plus the load transient, the largest tensor in fp32")
        del engine, params, local
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if gpu:
            torch.cuda.empty_cache()
        shutil.rmtree(work, ignore_errors=True)
    c.verdict()
