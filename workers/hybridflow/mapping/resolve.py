"""A candidate as the job it means: the user's job with its pools, placement, rollout mode and parallel settings
replaced, everything else as written. Parsed again, so the spec's own validation (schema and api/rules.py) judges
it exactly as `hybridflow validate` would."""
from __future__ import annotations

from typing import Any

from hybridflow.api import RLHFJob, dump_job
from hybridflow.api.plan import overlay
from hybridflow.api.devices import DeviceProfile
from hybridflow.mapping.candidates import Candidate, Placement

def pool_name(group: tuple[str, ...]) -> str:
    """A pool is named after its first role (pool names are lowercase letters and digits)."""
    return group[0].replace("_", "")


def placement_label(placement: Placement, devices: tuple[int, ...] | None = None) -> str:
    """The paper's names for the placements it compares (section 8): colocate (every model on one pool),
    standalone (each model on its own), split (actor, reference and rollout on one pool, critic and reward on
    another); anything else spelled out, e.g. `hybrid (actor+reference+rollout:64, critic:32, reward:32)`."""
    g = placement.groups
    models = [r for grp in g for r in grp if r != "rollout"]
    actor_side = {"actor", "reference"} & set(models)
    if len(g) == 1:
        return f"colocate (all:{devices[0]})" if devices else "colocate"
    if all(len([r for r in grp if r != "rollout"]) <= 1 for grp in g):
        name = "standalone"  # the paper's: every model on devices of its own (generation beside the actor or not)
    elif not placement.rollout_own and {frozenset(x) for x in g} == {
            frozenset(actor_side | {"rollout"}), frozenset(set(models) - actor_side)}:
        name = "split"  # NeMo-Aligner's: actor and reference on one half, critic and reward on the other
    else:
        name = "hybrid"
    counts = devices or (None,) * len(g)
    parts = ", ".join("+".join(grp) + (f":{n}" if n else "") for grp, n in zip(g, counts))
    return f"{name} ({parts})"


def resolve(job: RLHFJob, candidate: Candidate, device: DeviceProfile) -> RLHFJob:
    """The job with the candidate's pools (named after their first role, sized in nodes of the device's node
    size, the other pool settings taken from the job's first GPU pool, else its first), placement, mode and layout
    laid over it (hybridflow.api.plan.overlay, which `placement: auto` jobs share). Raises SpecError if the result
    is invalid (a candidate the enumeration should not make)."""
    pools = dump_job(job)["spec"]["resourcePools"]
    template = next((p for p in pools if p.get("device") == "gpu"), pools[0])
    per_node = device.devices_per_node
    gpu = device.name != "cpu"
    new_pools = []
    for group, size in zip(candidate.placement.groups, candidate.devices):
        nodes, per = (1, size) if size < per_node else (size // per_node, per_node)
        pool = {**template, "name": pool_name(group), "nodes": nodes, "devicesPerNode": per,
                "device": "gpu" if gpu else "cpu"}
        pool.pop("accelerator", None)
        if gpu:
            pool["accelerator"] = device.name
        new_pools.append(pool)
    layout = candidate.layout
    fields: dict[str, Any] = {
        "resourcePools": new_pools,
        "placement": {role: pool_name(group) for group in candidate.placement.groups for role in group},
        "training": {"engine": layout.engine, "tensorParallel": layout.tp, "pipelineParallel": layout.pp,
                     "microBatchSize": layout.micro},
        "rollout": {"mode": candidate.placement.mode, "tensorParallel": layout.tg},
    }
    name = job.metadata.name
    return overlay(job, fields, f"the plan's candidate for '{name}' ({placement_label(candidate.placement)})")
