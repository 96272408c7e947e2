"""Algorithm 1: every placement, device allocation and layout, scored by the simulator; what the memory model
refuses is dropped; the fastest first.

The loops are those of candidates.enumerate_candidates. What keeps 128 devices x 5 models fast: a pool's stage
times and memory verdict depend only on its roles, its size and the layout settings those roles read, so they are
computed once per (roles, layout) for every pool size at once (a table); a placement then scores all its device
allocations together (numpy over the allocations), keeping per allocation its best layout. The ranked candidates
are resolved to specs and checked by the spec's validation and by memory.plan's pool_plans/memory_problems, the
same verdict as `hybridflow validate`."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import numpy as np

from hybridflow.api import JobSpec, RLHFJob, SpecError
from hybridflow.api.devices import DeviceProfile
from hybridflow.api.engines import TRAIN_ENGINES
from hybridflow.mapping.candidates import (
    MICRO_BATCHES, MODES, Candidate, Layout, Placement, allocations, layout_allows, layouts, placements, pool_sizes,
)
from hybridflow.mapping.fit import RoleMemory, layout_spec, pool_fits, role_memory, sized_pool
from hybridflow.mapping.resolve import placement_label, resolve
from hybridflow.mapping.stage_time import (
    STALENESS, Calibration, Generation, Parallel, calibration_for, fsdp_switched, generate_s, pass_s, side_by_side,
    step_s, stream_s, transition_s,
)
from hybridflow.mapping.workload import (
    GENERATE, PREPARE, TRAINED, UPDATE, Workload, on_policy_update, role_passes, workload,
)
from hybridflow.memory.plan import memory_problems, pool_plans
from hybridflow.memory.shapes import ModelShape

# the columns of a pool's table; prepare and update twice: mode sync (the actor's update may give the old
# log-probs) and the overlapped modes (the trainer runs its own old-log-prob pass: workload.on_policy_update)
GEN, TRANSITION, STREAM, PREP, UPD, PREP_OFF, UPD_OFF = range(7)
COLUMNS = ("generate", "transition", "stream", "prepare", "update", "prepare_off", "update_off")
GIB = 1 << 30


class PlanError(ValueError):
    """Input the planner cannot work with, naming the flag or field."""


@dataclass(frozen=True)
class Ranked:
    """One ranked candidate: its resolved job and what the simulator and the memory model say of it."""

    candidate: Candidate
    job: RLHFJob
    step_seconds: float
    stages: dict[str, float]  # each stage's seconds (the slowest pool's)
    tokens_per_second_per_device: float
    headroom_bytes: int  # the smallest, over the pools, of capacity less the peak (memory.plan)
    staleness: int  # policy versions a trained token may be behind (sync 0, one_step_off 1, async maxStaleness)

    @property
    def label(self) -> str:
        return placement_label(self.candidate.placement, self.candidate.devices)


@dataclass
class SearchResult:
    ranked: list[Ranked]
    considered: int  # candidates scored (placement x allocation x layout)
    feasible: int  # of them, those the memory model and the rules let through
    seconds: float
    rejected_at_check: list[str] = field(default_factory=list)  # ranked, then refused by the full check (a bug)


class _Tables:
    """Stage times and memory verdicts per (roles, layout), for every pool size at once."""

    def __init__(self, spec: JobSpec, shapes: dict[str, ModelShape], device: DeviceProfile, sizes: Sequence[int],
                 cal: Calibration) -> None:
        self.spec, self.shapes, self.device, self.sizes, self.cal = spec, shapes, device, list(sizes), cal
        self.work: Workload = workload(spec)
        self.template = next((p for p in spec.resource_pools if p.device == "gpu"), spec.resource_pools[0])
        self._pools = {n: sized_pool(self.template, n, device) for n in self.sizes}
        self._specs: dict[Layout, JobSpec] = {}
        self._memory: dict[tuple, RoleMemory] = {}
        self._times: dict[tuple, dict[str, float]] = {}
        self._tables: dict[tuple, np.ndarray] = {}

    def _spec(self, layout: Layout) -> JobSpec:
        if layout not in self._specs:
            self._specs[layout] = layout_spec(self.spec, layout)
        return self._specs[layout]

    @staticmethod
    def _role_key(role: str, layout: Layout) -> tuple:
        """The layout settings a role's memory and time read."""
        if role in TRAINED:
            return (layout.engine, layout.tp, layout.pp, layout.micro)
        if role == "rollout":
            return (layout.engine, layout.tp, layout.pp, layout.tg)
        return (layout.micro,)

    def memory(self, role: str, size: int, layout: Layout, colocated: bool) -> RoleMemory:
        key = (role, size, self._role_key(role, layout), colocated)
        if key not in self._memory:
            self._memory[key] = role_memory(role, self._spec(layout), self._pools[size], self.shapes[role],
                                            self.device, colocated)
        return self._memory[key]

    def parallel(self, role: str, size: int, layout: Layout) -> Parallel:
        fp32 = self.spec.training.compute_dtype == "float32" or (
            role in TRAINED and TRAIN_ENGINES[layout.engine].computes_in_model_dtype
            and self.spec.models.actor.dtype == "float32")  # the trained models share the actor's dtype here
        if role in TRAINED and TRAIN_ENGINES[layout.engine].model_parallel:
            return Parallel(size, layout.tp, layout.pp, fsdp=False, micro=layout.micro, fp32=fp32)
        par = Parallel(size, fsdp=True, micro=layout.micro, fp32=fp32)
        return fsdp_switched(par, self.spec.training, self._pools[size].device) if role in TRAINED else par

    def times(self, role: str, size: int, layout: Layout, kv: int | None, mode: str = "sync") -> dict[str, float]:
        """A role's seconds per stage in rollout mode `mode` (sync, or any overlapped one: they price alike)."""
        mode = "sync" if mode == "sync" else "one_step_off"
        key = (role, size, self._role_key(role, layout), kv, mode)
        if key not in self._times:
            out: dict[str, float] = {}
            shape = self.shapes[role]
            row_entropy = role == "actor" and on_policy_update(self.work, mode)
            for stage, kind in role_passes(role, self.work, mode).items():
                if kind == "generate":
                    out[stage] = generate_s(shape, self.work, Generation(size, layout.tg, kv or 0), self.device,
                                            self.cal)
                else:
                    engine = layout.engine if role in TRAINED else "fsdp"
                    out[stage] = pass_s(shape, self.work, self.work.pass_tokens(engine), kind,
                                        self.parallel(role, size, layout), self.device, self.cal, row_entropy)
            self._times[key] = out
        return self._times[key]

    def table(self, roles: tuple[str, ...], layout: Layout, rollout_own: bool) -> np.ndarray:
        """(pool sizes x COLUMNS) seconds of a pool hosting `roles`; a row of inf where the rules or the memory
        model refuse that size."""
        raw = (roles, layout, rollout_own)
        if raw in self._tables:
            return self._tables[raw]
        has_trained = any(r in TRAINED for r in roles)
        norm = layout if "rollout" in roles else replace(layout, tg=1)
        if not has_trained and "rollout" not in roles:
            norm = Layout("fsdp", 1, 1, 1, layout.micro)
        key = (roles, norm, rollout_own)
        if key in self._tables:
            self._tables[raw] = self._tables[key]
            return self._tables[key]
        colocated = "rollout" in roles and "actor" in roles
        tab = np.full((len(self.sizes), len(COLUMNS)), math.inf)
        for i, size in enumerate(self.sizes):
            if not layout_allows(self.spec, layout, roles, size, rollout_own):
                continue
            members = [self.memory(r, size, layout, colocated) for r in roles]
            if not pool_fits(members, self.device):
                continue
            row = [0.0] * len(COLUMNS)
            for role, mem in zip(roles, members):
                t = self.times(role, size, layout, mem.kv_cache)
                row[GEN] += t.get(GENERATE, 0.0)
                row[PREP] += t.get(PREPARE, 0.0)
                row[UPD] += t.get(UPDATE, 0.0)
                off = self.times(role, size, layout, mem.kv_cache, "one_step_off")
                row[PREP_OFF] += off.get(PREPARE, 0.0)
                row[UPD_OFF] += off.get(UPDATE, 0.0)
            if "actor" in roles:
                par = self.parallel("actor", size, layout)
                if colocated:
                    row[TRANSITION] = transition_s(self.shapes["actor"], par, layout.tg, self.device, self.cal)
                if rollout_own:
                    row[STREAM] = stream_s(self.shapes["actor"], par, self.device, self.cal)
            tab[i] = row
        self._tables[key] = self._tables[raw] = tab
        return tab


def _staleness(spec: JobSpec, mode: str) -> int:
    return STALENESS.get(mode, spec.rollout.max_staleness)


def _check(job: RLHFJob, shapes: dict[str, ModelShape], cand: Candidate,
           device: DeviceProfile) -> tuple[RLHFJob | None, int, str | None]:
    """The candidate's spec as `hybridflow validate` judges it: (job, headroom, None), or (None, 0, why)."""
    try:
        resolved = resolve(job, cand, device)
    except SpecError as err:
        return None, 0, str(err)
    plans = pool_plans(resolved.spec, shapes)
    problems = memory_problems(resolved.spec, plans)
    if problems:
        return None, 0, "; ".join(problems)
    caps = [p.device.capacity_bytes - p.peak for p in plans if p.device is not None and p.device.capacity_bytes]
    return resolved, min(caps) if caps else 0, None


def search(job: RLHFJob, shapes: dict[str, ModelShape], devices: int, device: DeviceProfile, top: int = 10,
           modes: Iterable[str] = MODES, engines: Iterable[str] | None = None,
           micro_batches: Sequence[int] = MICRO_BATCHES, calibration: Calibration | None = None) -> SearchResult:
    """The `top` fastest candidates for `devices` devices of `device`, fastest first (ties: less stale, fewer
    pools). Raises PlanError for input it cannot plan, naming the flag or field."""
    started = time.perf_counter()
    cal = calibration or calibration_for(device)
    spec = job.spec
    modes = tuple(modes)
    if devices < 1:
        raise PlanError(f"--devices: {devices}; give the number of devices to plan for (at least 1)")
    if not device.peak_flops or not device.memory_bandwidth:
        raise PlanError(f"--accelerator: {device.name} has no speeds in its device profile (hybridflow.api.devices);"
                        " name one that has, e.g. h100-80gb")
    if devices > device.devices_per_node and devices % device.devices_per_node:
        raise PlanError(f"--devices: {devices} is not a whole number of {device.name} nodes "
                        f"({device.devices_per_node} devices each); give a multiple of {device.devices_per_node}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise PlanError(f"--modes: {', '.join(bad) or 'none given'}; use some of {', '.join(MODES)}")
    sizes = pool_sizes(devices, device.devices_per_node)
    index = {n: i for i, n in enumerate(sizes)}
    all_layouts = layouts(spec, shapes, device, engines, micro_batches)
    if not all_layouts:
        raise PlanError(f"--train-engines: none of {', '.join(engines or [])} can train this job "
                        f"(spec.rollout.engine {spec.rollout.engine}, spec.models.actor.dtype "
                        f"{spec.models.actor.dtype})")
    tables = _Tables(spec, shapes, device, sizes, cal)
    # placements sharing their groups (the own-pool modes) share every table and stage sum
    by_groups: dict[tuple, list[str]] = {}
    for pl in placements(spec, modes):
        by_groups.setdefault(pl.groups, []).append(pl.mode)
    pools: list[tuple[Placement, np.ndarray, np.ndarray, np.ndarray]] = []
    considered = feasible = 0
    for groups, group_modes in by_groups.items():
        allocs = allocations(len(groups), devices, tuple(sizes))
        if not allocs:
            continue
        own = groups[-1] == ("rollout",)
        tried = [(li, [tables.table(g, layout, own) for g in groups]) for li, layout in enumerate(all_layouts)
                 if not (own and layout.tg != 1)]
        considered += len(allocs) * len(tried) * len(group_modes)
        # a pool size no layout can use (the rules or the memory model refuse it) rules out its allocations
        usable = [np.zeros(len(sizes), dtype=bool) for _ in groups]
        for _, tabs in tried:
            for j, tab in enumerate(tabs):
                usable[j] |= np.isfinite(tab[:, 0])
        rows = np.array([[index[n] for n in a] for a in allocs])
        rows = rows[np.all([usable[j][rows[:, j]] for j in range(len(groups))], axis=0)]
        if not len(rows):
            continue
        best = {m: np.full(len(rows), math.inf) for m in group_modes}
        pick = {m: np.full(len(rows), -1) for m in group_modes}
        gathered: dict[tuple[int, int], np.ndarray] = {}  # a table shared by layouts is gathered once
        for li, tabs in tried:
            cols = []
            for j, tab in enumerate(tabs):
                if (j, id(tab)) not in gathered:
                    gathered[(j, id(tab))] = tab[rows[:, j]].T.copy()  # (COLUMNS, allocations)
                cols.append(gathered[(j, id(tab))])
            gen, trans, stream = (np.add.reduce([c[k] for c in cols]) for k in (GEN, TRANSITION, STREAM))
            # a pool that cannot run is inf in every column, so its allocation's step is inf in every mode
            for mode in group_modes:
                p, u = (PREP, UPD) if mode == "sync" else (PREP_OFF, UPD_OFF)
                prep, upd = (side_by_side(np.maximum.reduce([c[k] for c in cols]), np.add.reduce([c[k] for c in cols]),
                                          cal) for k in (p, u))
                step = step_s(mode, gen, trans, stream, prep, upd, cal.driver_step_s, cal, tables.work.async_waste)
                feasible += int(np.isfinite(step).sum())
                better = step < best[mode]
                best[mode] = np.where(better, step, best[mode])
                pick[mode] = np.where(better, li, pick[mode])
        for mode in group_modes:
            pools.append((Placement(groups, mode), rows, best[mode], pick[mode]))
    order: list[tuple[float, int, int, int, int]] = []  # (seconds, staleness, pools, entry, row)
    for e, (pl, rows, best, _) in enumerate(pools):
        finite = np.flatnonzero(np.isfinite(best))
        if len(finite) > 4 * top:
            finite = finite[np.argpartition(best[finite], 4 * top)[:4 * top]]
        order += [(float(best[r]), _staleness(spec, pl.mode), len(pl.groups), e, int(r)) for r in finite]
    order.sort()
    checked: list[Ranked] = []
    rejected: list[str] = []
    seen: set[tuple] = set()
    for seconds, stale, _, e, r in order:
        if len(checked) == 3 * top:  # enough to break ties by headroom among the first `top`
            break
        pl, rows, _, pick = pools[e]
        cand = Candidate(pl, tuple(sizes[i] for i in rows[r]), all_layouts[int(pick[r])])
        # async and one_step_off price the same where async wastes nothing (the model takes full-length responses,
        # so the queue that lets async absorb their spread gains nothing): list the less stale, or one_step_off, once
        same = (pl.groups, cand.devices, cand.layout, round(seconds, 6))
        if same in seen:
            continue
        resolved, headroom, why = _check(job, shapes, cand, device)
        if resolved is None:
            rejected.append(f"{placement_label(pl, cand.devices)} {cand.layout.describe()}: {why}")
            continue
        seen.add(same)
        checked.append(Ranked(cand, resolved, seconds, _stages(tables, cand), tables.work.step_tokens / seconds /
                              devices, headroom, stale))
    # equal times (within 0.1%): the less stale, fewer pools, a placement the paper names, more headroom first
    checked.sort(key=lambda x: (round(math.log(x.step_seconds) / math.log1p(1e-3)), x.staleness,
                                len(x.candidate.placement.groups), x.label.startswith("hybrid"), -x.headroom_bytes,
                                MODES.index(x.candidate.placement.mode)))
    return SearchResult(checked[:top], considered, feasible, time.perf_counter() - started, rejected)


def predict(job: RLHFJob, shapes: dict[str, ModelShape], candidate: Candidate, device: DeviceProfile,
            calibration: Calibration | None = None) -> tuple[float, dict[str, float]]:
    """One candidate's predicted step seconds and stage seconds, as the search scores it (the memory model's verdict
    aside: a pool it refuses is inf). bench/plan.py compares these with measured steps."""
    cal = calibration or calibration_for(device)
    tables = _Tables(job.spec, shapes, device, pool_sizes(candidate.total_devices, device.devices_per_node), cal)
    s = _stages(tables, candidate)
    return float(step_s(candidate.placement.mode, s["generate"], s["transition"], s["stream"], s["prepare"],
                        s["update"], s["driver"], cal, tables.work.async_waste)), s


def _stages(tables: _Tables, cand: Candidate) -> dict[str, float]:
    """The candidate's stage seconds (each the slowest pool's, generation and the transfers the one pool's; prepare
    and update those of its mode) and the controller's own."""
    own = cand.placement.rollout_own
    rows = [tables.table(g, cand.layout, own)[tables.sizes.index(n)] for g, n in zip(cand.placement.groups,
                                                                                    cand.devices)]
    sync = cand.placement.mode == "sync"
    out = {}
    for name, c in (("generate", GEN), ("transition", TRANSITION), ("stream", STREAM),
                    ("prepare", PREP if sync else PREP_OFF), ("update", UPD if sync else UPD_OFF)):
        vals = [row[c] for row in rows]
        out[name] = side_by_side(max(vals), sum(vals), tables.cal) if name in ("prepare", "update") else sum(vals)
    out["driver"] = tables.cal.driver_step_s
    return out


def render_ranking(result: SearchResult, devices: int, device: DeviceProfile) -> str:
    """The ranking as a table: rank, placement with device counts, mode, layout, predicted step seconds, stage
    seconds, tokens/s per device, staleness and memory headroom per device."""
    lines = [f"{len(result.ranked)} best of {result.feasible} feasible candidates ({result.considered} scored) "
             f"for {devices} x {device.name}, in {result.seconds:.1f} s", "",
             "| # | placement (pool: devices) | mode | layout | step s | gen / trans+stream / prep / update s "
             "| tokens/s/device | staleness | headroom GiB |",
             "|---:|---|---|---|---:|---|---:|---:|---:|"]
    def secs(x: float) -> str:  # tiny models' steps take milliseconds
        return f"{x:.1f}" if x >= 10 else f"{x:.3g}"

    for i, r in enumerate(result.ranked, 1):
        s = r.stages
        lines.append(f"| {i} | {r.label} | {r.candidate.placement.mode} | {r.candidate.layout.describe()} | "
                     f"{secs(r.step_seconds)} | {secs(s['generate'])} / {secs(s['transition'] + s['stream'])} / "
                     f"{secs(s['prepare'])} / {secs(s['update'])} | {r.tokens_per_second_per_device:.0f} | "
                     f"{r.staleness} | {r.headroom_bytes / GIB:.1f} |")
    return "\n".join(lines)
