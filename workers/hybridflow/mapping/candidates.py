"""What the planner may try (Algorithm 1's loops): placements (set partitions of the job's models into colocated
groups, rollout on the actor's group or a pool of its own, and the rollout mode), device counts per pool, the
training layout (engine, tensor and pipeline parallel sizes; data parallel is what is left of a pool) with the
generation tensor-parallel size t_g, and the micro-batch size.

The spec has one `training` section for every trained role, so the actor, critic and cost critic share one
(engine, t, p) and their data-parallel size follows from their own pool; frozen models (reference, reward, cost)
are FSDP over their pool. Every rule here mirrors one of api/rules.py, so every candidate resolves to a spec that
`hybridflow validate` accepts (tests/mapping/test_mapping.py checks a sample)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from hybridflow.algorithms import ALGORITHMS
from hybridflow.api import JobSpec
from hybridflow.api.devices import DeviceProfile
from hybridflow.api.engines import ROLLOUT_ENGINES, TRAIN_ENGINES
from hybridflow.api.training import actor_is_reference, fsdp_switches_forced_on
from hybridflow.mapping.workload import TRAINED
from hybridflow.memory.shapes import ModelShape

MODES = ("sync", "one_step_off", "async")
MICRO_BATCHES = (1, 2, 4, 8, 16)
MAX_PIPELINE = 16


@dataclass(frozen=True)
class Layout:
    """The parallel settings the spec shares across roles: spec.training.{engine, tensorParallel,
    pipelineParallel, microBatchSize} and spec.rollout.tensorParallel (t_g)."""

    engine: str
    tp: int
    pp: int
    tg: int
    micro: int

    def describe(self) -> str:
        return (f"{self.engine} t={self.tp} p={self.pp} t_g={self.tg} mb={self.micro}" if self.tp * self.pp > 1
                or TRAIN_ENGINES[self.engine].model_parallel else f"{self.engine} t_g={self.tg} mb={self.micro}")


@dataclass(frozen=True)
class Placement:
    """Colocated groups, one pool each: groups[0] holds the actor; rollout is in groups[0] (the 3D-HybridEngine)
    or alone in the last group (a pool of its own, fed by the weight stream)."""

    groups: tuple[tuple[str, ...], ...]
    mode: str

    @property
    def rollout_own(self) -> bool:
        return self.groups[-1] == ("rollout",)


@dataclass(frozen=True)
class Candidate:
    placement: Placement
    devices: tuple[int, ...]  # per group
    layout: Layout

    @property
    def total_devices(self) -> int:
        return sum(self.devices)


def placed_models(spec: JobSpec) -> list[str]:
    """The job's models to place, in ROLES' order (actor first); rollout is placed apart."""
    return [r for r in spec.roles() if r != "rollout"]


def set_partitions(items: Sequence[str]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every partition of `items` into non-empty blocks, each once (blocks ordered by their first item, items in
    each block in the given order): Bell(len(items)) of them."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield ((first,),) + part
        for i in range(len(part)):
            yield tuple(sorted(((first,) + part[i],) + part[:i] + part[i + 1:], key=lambda b: items.index(b[0])))


def rollout_can_stand_alone(spec: JobSpec) -> bool:
    """A rollout pool of its own takes whole tensors from the stream: an engine fed training shards cannot."""
    return ROLLOUT_ENGINES[spec.rollout.engine].fed_by is None


def placements(spec: JobSpec, modes: Iterable[str] = MODES) -> Iterator[Placement]:
    """Each partition of the models with rollout beside the actor (sync only: the other modes generate while the
    actor trains) or on a pool of its own (any mode the job's algorithm allows: async not with a greedy baseline).
    With LoRA the reference is the actor's own base, so it stays in the actor's block (api.rules)."""
    modes = tuple(modes)
    greedy = ALGORITHMS[spec.algorithm.name].greedy_baseline
    own_modes = [m for m in modes if not (m == "async" and greedy)]
    for part in set_partitions(placed_models(spec)):
        if actor_is_reference(spec.training) and any("reference" in b and "actor" not in b for b in part):
            continue
        if "sync" in modes:
            yield Placement(((*part[0], "rollout"),) + part[1:], "sync")
        if rollout_can_stand_alone(spec):
            for mode in own_modes:
                yield Placement(part + (("rollout",),), mode)


def pool_sizes(devices: int, per_node: int) -> list[int]:
    """Device counts a pool may have: powers of two inside one node, whole nodes above."""
    small = [1 << i for i in range(per_node.bit_length()) if (1 << i) < per_node and (1 << i) <= devices]
    return small + list(range(per_node, devices + 1, per_node))


@functools.lru_cache(maxsize=None)
def allocations(groups: int, devices: int, sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every way to give `groups` pools sizes from `sizes` using all `devices` (a device left idle never shortens a
    step in the model, so none is). Ordered: pool i is group i."""
    if groups == 0:
        return ((),) if devices == 0 else ()
    out = []
    for s in sizes:
        if s <= devices - (groups - 1) * sizes[0]:
            out += [(s,) + rest for rest in allocations(groups - 1, devices - s, sizes)]
    return tuple(out)


def _powers(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def train_engines(spec: JobSpec, allowed: Iterable[str] | None = None) -> list[str]:
    """The training engines a candidate may use: those registered (or `allowed`) that the job's rules accept: a
    generation engine fed by one engine's shards keeps that engine; an engine that computes in the model's dtype
    needs a bfloat16 actor when computeDtype is bfloat16; spec.training.lora needs an engine that builds LoRA; an
    FSDP communication switch set "on" needs an engine that gathers (not a model-parallel one)."""
    out = []
    generator = ROLLOUT_ENGINES[spec.rollout.engine]
    for name in (allowed if allowed is not None else TRAIN_ENGINES.names()):
        kind = TRAIN_ENGINES[name]
        if generator.fed_by is not None and name not in generator.fed_by:
            continue
        if spec.training.lora is not None and not kind.lora:
            continue
        if kind.model_parallel and fsdp_switches_forced_on(spec.training):
            continue
        if kind.computes_in_model_dtype and spec.training.compute_dtype == "bfloat16" and \
                spec.models.actor.dtype != "bfloat16":
            continue
        out.append(name)
    return out


def layouts(spec: JobSpec, shapes: dict[str, ModelShape], device: DeviceProfile,
            engines: Iterable[str] | None = None, micro_batches: Sequence[int] = MICRO_BATCHES) -> list[Layout]:
    """The shared layouts: per engine, t up to a node (TP stays on the node's fast link) dividing every trained
    model's heads and key/value heads, p dividing their layers, t_g dividing t (tensor-parallel generation only
    where the generation engine has it and the actor is model-parallel), and the micro-batch sizes (with the job's
    own). A model-parallel engine trains LoRA at t = p = 1 only (api.rules)."""
    r, m = spec.rollout, spec.models.actor
    generator = ROLLOUT_ENGINES[r.engine]
    trained = [shapes[role] for role in spec.roles() if role in TRAINED]
    micros = sorted(set(micro_batches) | {spec.training.micro_batch_size})
    out = []
    for engine in train_engines(spec, engines):
        if not TRAIN_ENGINES[engine].model_parallel or spec.training.lora is not None:
            grid = [(1, 1, 1)]
        else:
            grid = []
            for tp in _powers(device.devices_per_node):
                if any(s.heads % tp or s.kv_heads % tp for s in trained):
                    continue
                if m.source == "tiny" and (m.tiny.vocab_size % tp or m.tiny.num_kv_heads % tp):
                    continue
                for pp in _powers(MAX_PIPELINE):
                    if any(s.layers % pp or s.layers < pp for s in trained):
                        continue
                    for tg in _powers(tp):
                        if tp % tg or (tg > 1 and not generator.tensor_parallel):
                            continue
                        if tg > 1 and m.source == "tiny" and m.tiny.vocab_size % (generator.vocab_padding * tg):
                            continue
                        grid.append((tp, pp, tg))
        out += [Layout(engine, tp, pp, tg, mb) for tp, pp, tg in grid for mb in micros]
    return out


def layout_allows(spec: JobSpec, layout: Layout, roles: Sequence[str], size: int, rollout_own: bool) -> bool:
    """Whether a pool of `size` devices hosting `roles` can run `layout` (api/rules.py's rules): TP x PP divides a
    trained pool, whose data-parallel size divides promptsPerStep and the mini-batch; a frozen pool's does too (it
    splits the batch by rank); a rollout pool of its own has t_g = 1 and splits the step's rows evenly."""
    prompts = spec.trainer.prompts_per_step
    mini = spec.training.mini_batch_size or prompts
    if rollout_own and layout.tg != 1:
        return False
    if any(r in TRAINED for r in roles):
        mp = layout.tp * layout.pp
        if size % mp:
            return False
        dp = size // mp
        return prompts % dp == 0 and mini % dp == 0
    if roles == ("rollout",):
        greedy = int(ALGORITHMS[spec.algorithm.name].greedy_baseline)
        return (prompts * (spec.rollout.responses_per_prompt + greedy)) % size == 0
    return prompts % size == 0


def enumerate_candidates(spec: JobSpec, shapes: dict[str, ModelShape], devices: int, device: DeviceProfile,
                         modes: Iterable[str] = MODES, engines: Iterable[str] | None = None,
                         micro_batches: Sequence[int] = MICRO_BATCHES) -> Iterator[Candidate]:
    """Every candidate the rules allow, before the memory model and the simulator: the plain product of the loops
    (search.py walks the same loops, vectorized over device counts)."""
    sizes = tuple(pool_sizes(devices, device.devices_per_node))
    all_layouts = layouts(spec, shapes, device, engines, micro_batches)
    for placement in placements(spec, modes):
        for alloc in allocations(len(placement.groups), devices, sizes):
            for layout in all_layouts:
                if all(layout_allows(spec, layout, g, n, placement.rollout_own)
                       for g, n in zip(placement.groups, alloc)):
                    yield Candidate(placement, alloc, layout)


def bell(n: int) -> int:
    """Bell numbers: how many set partitions n models have (1, 1, 2, 5, 15, 52, 203)."""
    row = [1]
    for _ in range(n):
        nxt = [row[-1]]
        for x in row:
            nxt.append(nxt[-1] + x)
        row = nxt
    return row[0]


__all__ = ["MODES", "Candidate", "Layout", "Placement", "allocations", "bell", "enumerate_candidates", "layouts",
           "layout_allows", "placed_models", "placements", "pool_sizes", "set_partitions", "train_engines"]
