"""The memory model (hybridflow.memory) per pool, fast enough for a search: each role's terms are computed once per
(pool size, the settings they read) by memory.terms' own functions and summed as memory.plan.PoolPlan.total sums
them (lasting terms add up, the largest role's transients count). search.py then checks every candidate it ranks
with memory.plan's pool_plans and memory_problems on the resolved spec, the verdict `hybridflow validate` gives."""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.api import JobSpec, ResourcePool
from hybridflow.api.devices import DeviceProfile
from hybridflow.mapping.candidates import Layout
from hybridflow.memory.plan import TRAINED
from hybridflow.memory.shapes import ModelShape
from hybridflow.memory.terms import PHASES, Term, compute_bytes, frozen_terms, rollout_terms, trained_terms


@dataclass(frozen=True)
class RoleMemory:
    """One role's bytes per device by phase (PHASES' order): what it keeps, and its own call's transients."""

    lasting: tuple[int, ...]
    transient: tuple[int, ...]
    kv_cache: int | None = None  # rollout only: its KV cache on a device (generate phase), the batch it allows


def layout_spec(spec: JobSpec, layout: Layout) -> JobSpec:
    """`spec` with the layout's training and generation settings (a copy, not validated: the search's own)."""
    training = spec.training.model_copy(update={"engine": layout.engine, "tensor_parallel": layout.tp,
                                                "pipeline_parallel": layout.pp, "micro_batch_size": layout.micro})
    rollout = spec.rollout.model_copy(update={"tensor_parallel": layout.tg})
    return spec.model_copy(update={"training": training, "rollout": rollout})


def sized_pool(template: ResourcePool, size: int, device: DeviceProfile) -> ResourcePool:
    """A pool of `size` devices like `template`: one node below a node's worth, whole nodes above."""
    per_node = device.devices_per_node
    nodes, per = (1, size) if size < per_node else (size // per_node, per_node)
    gpu = device.name != "cpu"
    return template.model_copy(update={"nodes": nodes, "devices_per_node": per, "device": "gpu" if gpu else "cpu",
                                       "accelerator": device.name if gpu else None})


def _sum(terms: list[Term], transient: bool) -> tuple[int, ...]:
    return tuple(sum(t.phases[p] for t in terms if t.transient == transient) for p in PHASES)


def role_memory(role: str, spec: JobSpec, pool: ResourcePool, shape: ModelShape, device: DeviceProfile,
                rollout_colocated: bool) -> RoleMemory:
    """memory.plan.pool_plans' terms of one role on `pool`, summed by phase."""
    gpu = pool.device == "gpu"
    c = compute_bytes(spec, gpu)
    if role in TRAINED:
        terms = trained_terms(role, spec, pool, shape, c, TRAINED[role])
    elif role == "rollout":
        terms = rollout_terms(spec, pool, shape, c, device, gpu, rollout_colocated)
    else:
        src = spec.models.actor if role == "reference" else getattr(spec.models, role).model
        terms = frozen_terms(role, spec, pool, shape, c, src.dtype, role == "reference")
    kv = next((t.phases["generate"] for t in terms if "KV cache" in t.what), None) if role == "rollout" else None
    return RoleMemory(_sum(terms, False), _sum(terms, True), kv)


def pool_peak(members: list[RoleMemory], device: DeviceProfile) -> int:
    """PoolPlan.total's rule: the runtime, every role's lasting terms, the largest role's transients; the peak is
    the largest phase."""
    peak = 0
    for i in range(len(PHASES)):
        total = device.runtime_bytes + sum(m.lasting[i] for m in members) + max(
            (m.transient[i] for m in members), default=0)
        peak = max(peak, total)
    return peak


def pool_fits(members: list[RoleMemory], device: DeviceProfile) -> bool:
    """What memory_problems refuses: a peak over the device's capacity, or no room left for vLLM's KV cache."""
    if not device.capacity_bytes:
        return True
    if any(m.kv_cache is not None and m.kv_cache <= 0 for m in members):
        return False
    return pool_peak(members, device) <= device.capacity_bytes
