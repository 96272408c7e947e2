"""A job's memory plan: per pool, per device, every colocated role's terms summed by phase; the verdict and the
messages that name the role, the numbers and the field to change. Pure; `hybridflow plan` and `validate` print it."""
from __future__ import annotations

from dataclasses import dataclass, replace

from hybridflow.api import JobSpec
from hybridflow.api.devices import PROFILES, DeviceProfile, profile
from hybridflow.api.training import role_lora
from hybridflow.memory.shapes import ModelShape
from hybridflow.memory.terms import (
    PHASES, Term, _in, adapted_linears, compute_bytes, cuda_graphs_on, frozen_terms, judge_terms, rollout_terms,
    trained_params, trained_terms,
)

GIB = 1 << 30
TRAINED = {"actor": True, "critic": False, "cost_critic": False}  # role -> has an LM head


@dataclass(frozen=True)
class PoolPlan:
    """One device of one pool: its profile, its terms, and whether the largest phase fits."""

    index: int
    name: str
    world_size: int
    device: DeviceProfile | None  # None: a GPU pool without an accelerator (not checked)
    terms: list[Term]

    def total(self, phase: str) -> int:
        """What the device holds in `phase`: every role's lasting terms, plus the largest role's transients (its
        colocated roles' calls run one at a time: the critic's update, then the actor's)."""
        transients: dict[str, int] = {}
        for t in self.terms:
            if t.transient:
                transients[t.role] = transients.get(t.role, 0) + t.phases[phase]
        return sum(t.phases[phase] for t in self.terms if not t.transient) + max(transients.values(), default=0)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.device is None or not self.device.capacity_bytes or self.peak <= self.device.capacity_bytes


def _field(term_field: str, index: int) -> str:
    return term_field.replace("resourcePools[]", f"resourcePools[{index}]")


def pool_plans(spec: JobSpec, shapes: dict[str, ModelShape], native_bf16: bool = True) -> list[PoolPlan]:
    """The plan of every pool that hosts a role. A CPU pool uses the `cpu` profile (its runtime term; host memory
    is hybridflow.capacity's check)."""
    out = []
    for i, pool in enumerate(spec.resource_pools):
        gpu = pool.device == "gpu"
        dev = (profile(pool.accelerator) if pool.accelerator else None) if gpu else PROFILES["cpu"]
        c = compute_bytes(spec, gpu, native_bf16)
        runtime = (dev or PROFILES["h100-80gb"]).runtime_bytes
        roles = [r for r in spec.roles() if spec.pool(r).name == pool.name]
        if not roles:
            continue
        terms = [Term("runtime", "process runtime (CUDA context, NCCL, allocator)" if gpu else
                      "process runtime (torch, vLLM engine, Ray)", "-", _in(PHASES, runtime))]
        for role in roles:
            s = shapes[role]
            if role in TRAINED:
                terms += trained_terms(role, spec, pool, s, c, TRAINED[role])
            elif role == "rollout":
                colocated = spec.pool("actor").name == pool.name
                terms += rollout_terms(spec, pool, s, c, dev or PROFILES["h100-80gb"], gpu, colocated)
            elif role == "judge":
                terms += judge_terms(spec, pool, s, c, dev or PROFILES["h100-80gb"], gpu)
            else:
                src = spec.models.actor if role == "reference" else getattr(spec.models, role).model
                terms += frozen_terms(role, spec, pool, s, c, src.dtype, role == "reference")
        out.append(PoolPlan(i, pool.name, pool.world_size, dev, [replace(t, field=_field(t.field, i)) for t in terms]))
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _by_role(p: PoolPlan, phase: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in p.terms:
        out[t.role] = out.get(t.role, 0) + t.phases[phase]
    return out


def memory_problems(spec: JobSpec, plans: list[PoolPlan]) -> list[str]:
    """Why the job cannot fit its devices: one message per pool, naming the role that holds most in the phase
    that overflows, its largest terms and the fields that move them."""
    out = []
    for p in plans:
        if p.device is None or not p.device.capacity_bytes:
            continue
        pool = f"spec.resourcePools[{p.index}] ('{p.name}')"
        share = spec.rollout.gpu_memory_utilization
        kv = next((t for t in p.terms if "KV cache (gpuMemoryUtilization" in t.what), None)
        if kv is not None and kv.phases["generate"] <= 0:
            out.append(f"{pool}: rollout: spec.rollout.gpuMemoryUtilization {share} x {_gib(p.device.capacity_bytes)}"
                       f" leaves no room for vLLM's KV cache after its weights and workspace; raise "
                       "spec.rollout.gpuMemoryUtilization or spec.rollout.tensorParallel")
        if p.fits:
            continue
        phase = p.peak_phase
        roles = _by_role(p, phase)
        role = max((r for r in roles if r != "runtime"), key=roles.__getitem__)
        top = sorted((t for t in p.terms if t.role == role and t.phases[phase]), key=lambda t: -t.phases[phase])[:3]
        fields = sorted({t.field for t in top if t.field != "-"})
        others = ", ".join(f"{r} {_gib(b)}" for r, b in roles.items() if r != role and b)
        out.append(f"{pool}: {role} does not fit a {p.device.name} ({_gib(p.device.capacity_bytes)} per device): in "
                   f"the {phase} phase one device needs {_gib(p.peak)}, {role} {_gib(roles[role])} of it ("
                   + ", ".join(f"{t.what} {_gib(t.phases[phase])}" for t in top) + f"; with {others}). Change "
                   + " or ".join(fields) + f" (more devices shard the trained state), or spec.resourcePools"
                   f"[{p.index}].accelerator for a larger device")
    return out


def lora_summary(spec: JobSpec, role: str, s: ModelShape) -> list[str]:
    """What LoRA trains of `role` (none without it): the plan's reader sees the trained share beside the base."""
    lora = role_lora(role, spec.training)
    if lora is None:
        return []
    held = trained_params(role, spec, s, TRAINED[role])
    return [f"{role}: LoRA rank {lora.rank} on {', '.join(n.split('.')[-1] for n in adapted_linears(s, lora))}: "
            f"{held.trained / 1e6:.1f}M trained parameters ({held.trained / held.frozen:.2%} of the base, which is "
            "frozen; spec.training.lora)"]


def render(spec: JobSpec, plans: list[PoolPlan], shapes: dict[str, ModelShape]) -> str:
    """The plan as a table per pool: one row per role's term, one column per phase, in GiB per device."""
    lines = []
    for role in dict.fromkeys(r for r in spec.roles() if r in shapes):
        s = shapes[role]
        lines.append(f"{role}: {s.params / 1e9:.2f}B parameters ({s.layers} layers, hidden {s.hidden}, vocabulary "
                     f"{s.vocab}) from {s.source}")
        lines += lora_summary(spec, role, s)
    for p in plans:
        on_gpu = spec.resource_pools[p.index].device == "gpu"
        graphs = f"; CUDA graphs {'on' if cuda_graphs_on(spec) else 'off (eager)'}" if on_gpu else ""
        dev = p.device.name if p.device else "no accelerator named (set the pool's accelerator to check)"
        cap = f", {_gib(p.device.capacity_bytes)} each" if p.device and p.device.capacity_bytes else ""
        lines += ["", f"pool '{p.name}' (spec.resourcePools[{p.index}]): {p.world_size} x {dev}{cap}; GiB per "
                  f"device by phase{graphs}", ""]
        head = f"| role | term | {' | '.join(PHASES)} |"
        lines += [head, "|---|---|" + "---:|" * len(PHASES)]
        for t in p.terms:
            cells = " | ".join(f"{t.phases[ph] / GIB:.2f}" if t.phases[ph] else "-" for ph in PHASES)
            lines.append(f"| {t.role} | {t.what} | {cells} |")
        lines.append("| **total** | | " + " | ".join(f"**{p.total(ph) / GIB:.2f}**" for ph in PHASES) + " |")
        verdict = ("fits" if p.fits else "DOES NOT FIT") if p.device and p.device.capacity_bytes else "not checked"
        of = f" of {_gib(p.device.capacity_bytes)}" if p.device and p.device.capacity_bytes else ""
        lines += ["", f"peak {_gib(p.peak)}{of} per device ({p.peak_phase} phase): {verdict}"]
    return "\n".join(lines)
