"""Whether a job fits this machine under `hybridflow run`, decided before anything starts.

On the local Ray every device is one process: a job asking for 16 devices on a 2-core, 24 GiB laptop used to start
them all and die of OOM two minutes later with a Ray memory dump. `local_capacity_problems` (pure) compares floors
of what the job holds with `machine_facts` (read once, at the edge) and names the pools that do not fit."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from hybridflow.api import JobSpec, ModelSource, ResourcePool, RLHFJob, TinyModel
from hybridflow.api.engines import ROLLOUT_ENGINES

GIB = 1 << 30
# Floors of what a local job holds in memory, so that `hybridflow run` refuses a job this machine cannot hold before
# it starts anything: on the local Ray every device is one process, and 16 devices on a 2-core/24 GiB machine used to
# start 16 workers and die of OOM two minutes later. Floors, not estimates (training state, the other models and
# activations come on top), so a job refused here does not fit. Measured on the project's machines: a process with
# torch, transformers and vLLM imported holds 0.6 GiB before any model, a Ray worker a little more; the driver's
# imports plus Ray's head with its object store about 1.5 GiB (STACK.md: ray.init alone ~0.9 GiB).
# SmolLM2-135M-Instruct has 134,515,008 parameters (the step log's generation_weight_bytes: 538,060,032 in float32).
RANK_FLOOR_BYTES = 3 * GIB // 4
DRIVER_FLOOR_BYTES = 3 * GIB // 2
SMOLLM2_PARAMS = 134_515_008
SMOLLM2_KV_SHAPE = (30, 3, 64)  # layers, key/value heads, head size
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# vLLM's KV cache block on CPU, the smallest its CPU attention takes (its default is 128): prefix caching shares
# whole blocks, so the responses of one prompt share all but its last partial block (a 44-token prompt: 32 tokens,
# none at 128), and a sequence wastes less than a block. Measured (SmolLM2 fp32, one thread, 8 prompts x 4 samples
# x 32 tokens): 128 -> 32 with prefix caching 14.0 -> 8.4 s; at 400-token prompts and 128 new tokens both 38.7 s.
KV_BLOCK_TOKENS = 32


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, sequences: int, max_len: int) -> int:
    """KV cache that holds `sequences` sequences of up to `max_len` tokens at once (keys and values of every layer,
    whole blocks): what one generation call of the job needs, instead of a fixed size."""
    blocks = -(-max_len // KV_BLOCK_TOKENS)
    return max(1, sequences) * blocks * KV_BLOCK_TOKENS * 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class Machine:
    """What this machine can hold, read once at the edge (`machine_facts`); `local_capacity_problems` decides."""

    memory_bytes: int  # physical memory, or the cgroup's limit when lower
    gpus: int
    model_dir_bytes: Mapping[str, int] = field(default_factory=dict)  # source=path directory -> its weight files' bytes


def tiny_params(t: TinyModel) -> int:
    """Parameters of the Qwen2-style tiny model (models/builders.py builds it from the same config)."""
    h, kv = t.hidden_size, t.hidden_size // t.num_heads * t.num_kv_heads
    attention = 2 * h * h + 2 * h * kv + h + 2 * kv  # q, o; k, v; the q/k/v biases
    layer = attention + 3 * h * t.intermediate_size + 2 * h  # + MLP + norms
    return t.vocab_size * h * (1 if t.tie_embeddings else 2) + t.num_layers * layer + h


def model_bytes(src: ModelSource, machine: Machine) -> int:
    """The bytes of one full copy of a model's weights (0 for a directory not measured)."""
    if src.source == "tiny":
        return tiny_params(src.tiny) * DTYPE_BYTES[src.dtype]
    if src.source == "smollm2":
        return SMOLLM2_PARAMS * DTYPE_BYTES[src.dtype]
    return machine.model_dir_bytes.get(src.path or "", 0)


def rank_floor(spec: JobSpec, pool: ResourcePool, machine: Machine) -> dict[str, int]:
    """The least host memory one local rank of `pool` holds, by part (the parts name the fields that set them)."""
    parts = {"process": RANK_FLOOR_BYTES}
    if pool.device == "cpu" and pool.name == spec.pool("rollout").name:
        if ROLLOUT_ENGINES[spec.rollout.engine].kv_cache:
            parts["vLLM KV cache (spec.rollout.kvCacheGib)"] = _kv_floor(spec, pool)
        weights = model_bytes(spec.models.actor, machine) // spec.rollout.tensor_parallel
        if spec.training.compute_dtype != "float32" and spec.models.actor.dtype == "float32":
            weights //= 2  # generation runs in the compute dtype, which auto may make bf16
        parts["the actor's generation weights"] = weights
    return parts


def _kv_floor(spec: JobSpec, pool: ResourcePool) -> int:
    """The KV cache one generation rank holds: kvCacheGib, or sized from the job as the actor sizes it (the shape
    is known for tiny and smollm2 models; a model directory's counts as 0 here, a floor)."""
    r, src = spec.rollout, spec.models.actor
    if r.kv_cache_gib:
        return int(r.kv_cache_gib * GIB)
    if src.source == "tiny":
        t = src.tiny
        shape = (t.num_layers, t.num_kv_heads, t.hidden_size // t.num_heads)
    elif src.source == "smollm2":
        shape = SMOLLM2_KV_SHAPE
    else:
        return 0
    sequences = max(spec.trainer.prompts_per_step * (r.responses_per_prompt + 1), spec.data.eval_prompts)
    per_rank = -(-sequences // (pool.world_size // r.tensor_parallel))
    narrowest = "bfloat16" if spec.training.compute_dtype != "float32" else src.dtype  # auto may compute in bf16
    return kv_cache_bytes(*shape, DTYPE_BYTES[narrowest], per_rank, r.max_prompt_length + r.max_response_length)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def local_capacity_problems(spec: JobSpec, machine: Machine) -> list[str]:
    """Why this machine cannot run the job under `hybridflow run`: more memory than it has (each device a process
    here), more GPUs than it has, or more than one node; one message per problem, naming the pools."""
    out = []
    for i, pool in enumerate(spec.resource_pools):
        if pool.nodes > 1:
            out.append(f"spec.resourcePools[{i}].nodes = {pool.nodes}: more than one node needs a Ray cluster: use "
                       "`hybridflow driver --address` (or the operator)")
    need, lines = DRIVER_FLOOR_BYTES, []
    for i, pool in enumerate(spec.resource_pools):
        parts = rank_floor(spec, pool, machine)
        need += pool.world_size * sum(parts.values())
        lines.append(f"spec.resourcePools[{i}] ('{pool.name}'): {pool.world_size} devices x "
                     f"{_gib(sum(parts.values()))} ({', '.join(f'{k} {_gib(v)}' for k, v in parts.items())})")
    if need > machine.memory_bytes:
        out.append(f"spec.resourcePools: the job needs at least {_gib(need)} of memory here and this machine has "
                   f"{_gib(machine.memory_bytes)}: " + "; ".join(lines) + f"; plus {_gib(DRIVER_FLOOR_BYTES)} for the "
                   "driver and Ray. Each device is one process on this machine: lower devicesPerNode (and "
                   "spec.rollout.kvCacheGib), or run the job on a cluster (the operator)")
    gpu_pools = [(i, p) for i, p in enumerate(spec.resource_pools) if p.device == "gpu"]
    wanted = sum(p.world_size for _, p in gpu_pools)
    if wanted > machine.gpus:
        asks = ", ".join(f"spec.resourcePools[{i}] ('{p.name}') {p.world_size}" for i, p in gpu_pools)
        out.append(f"spec.resourcePools: the job asks for {wanted} GPUs ({asks}) and this machine has {machine.gpus}; "
                   "lower devicesPerNode, or run the job on a cluster (the operator)")
    return out


def _memory_limit_bytes() -> int:
    """Physical memory, or the cgroup's limit (a container's) when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            total = min(total, int(Path(limit_file).read_text().strip()))  # "max": no limit (ValueError)
    return total


def machine_facts(job: RLHFJob) -> Machine:
    """This machine's memory and GPUs, and the size on disk of the model directories the job names. Total memory,
    not what is free now: the verdict must not change with whatever else happens to run."""
    gpus = 0
    if any(p.device == "gpu" for p in job.spec.resource_pools):
        import torch

        gpus = torch.cuda.device_count()
    m = job.spec.models
    dirs = {src.path for src in (m.actor, m.critic, m.reward.model) if src is not None and src.path}
    sizes = {d: sum(f.stat().st_size for f in Path(d).glob("*") if f.suffix in (".safetensors", ".bin", ".pt"))
             for d in dirs if Path(d).is_dir()}
    return Machine(_memory_limit_bytes(), gpus, sizes)
