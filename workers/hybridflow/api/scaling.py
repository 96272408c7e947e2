"""An elastic rollout pool (issue 29, item 3): spec.rolloutPool, the one part of a job's pools that may change
while it runs. Only an async job's rollout pool of its own can be elastic: its replicas are independent (each has
its own engine and takes its own prompts), so one more joins by taking the current weights and one less leaves by
finishing the call it is in; every other pool forms one torch.distributed world for the job's life.

`spec.rolloutPool.replicas` is the pool's size now (unset: the pool's `nodes`); like runPolicy it is read afresh
from the live spec at every tick of the operator (the CRD's scale subresource points at it, so `kubectl scale` and
an HorizontalPodAutoscaler work), and the head of each new gang generation is told the size it starts with. The
pool's `nodes` stays what the job was created with: `sized` gives the spec as it runs now. The pool's bounds
(`RolloutPool`) are a section of the spec's fields (api.sections).
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, TypeVar

from hybridflow.api.sections import JobFields, RolloutPool

__all__ = ["RolloutPool", "elastic_problems", "replicas_now", "sized"]


J = TypeVar("J", bound="Job")


class Job(Protocol):
    """What `sized` reads and copies of a job: api.schema.RLHFJob (above the rules, which use this module)."""

    @property
    def spec(self) -> JobFields: ...

    def model_copy(self: J, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> J: ...


def replicas_now(spec: JobFields) -> int | None:
    """The elastic rollout pool's size now, or None when the job has none."""
    if spec.rollout_pool is None:
        return None
    return spec.rollout_pool.replicas or spec.pool("rollout").nodes


def sized(job: J, replicas: int | None = None) -> J:
    """The job as it runs now: its elastic rollout pool's `nodes` set to `replicas` (default: the spec's size now).
    A job without one is returned as it is."""
    if job.spec.rollout_pool is None:
        return job
    out = job.model_copy(deep=True)
    n = replicas if replicas is not None else replicas_now(out.spec)
    out.spec.rollout_pool.replicas = n  # type: ignore[union-attr]
    pool = out.spec.pool("rollout")
    pool.nodes = n  # type: ignore[assignment]
    return out


def elastic_problems(spec: JobFields) -> list[str]:
    """What makes spec.rolloutPool invalid, naming the fields."""
    rp = spec.rollout_pool
    if rp is None:
        return []
    if spec.placed.get("rollout", spec.resource_pools[0].name) not in {p.name for p in spec.resource_pools}:
        return []  # placed on no pool: the placement's own message says so
    out = []
    pool = spec.pool("rollout")
    if not spec.replica_pool(pool.name):
        out.append("spec.rolloutPool: only an async job's rollout pool of its own is elastic (its replicas are "
                   "independent); set spec.rollout.mode async and spec.placement.rollout to a pool no other role "
                   "uses, or remove spec.rolloutPool")
    if rp.min_replicas > rp.max_replicas:
        out.append(f"spec.rolloutPool.minReplicas = {rp.min_replicas} is above maxReplicas = {rp.max_replicas}")
    now = replicas_now(spec)
    what = "spec.rolloutPool.replicas" if rp.replicas is not None else \
        f"spec.resourcePools[{spec.resource_pools.index(pool)}].nodes (the rollout pool's size while " \
        "spec.rolloutPool.replicas is unset)"
    if now is not None and not rp.min_replicas <= now <= rp.max_replicas:
        out.append(f"{what} = {now} is outside spec.rolloutPool.minReplicas..maxReplicas = "
                   f"{rp.min_replicas}..{rp.max_replicas}")
    return out
