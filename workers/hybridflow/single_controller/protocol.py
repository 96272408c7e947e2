"""Transfer protocols: how one controller call fans out to the ranks of a worker group and how results come back.

A worker method declares its protocol with `@register(...)`; the WorkerGroup reads it and does the split and the
gather, so the controller program only says *what* flows (the paper's hierarchical API, section 4).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Sequence

from hybridflow.single_controller.batch import Batch


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"  # same arguments to every rank; a list of every rank's result
    ALL_TO_ALL = "all_to_all"  # argument i (a list of world-size items) to rank i; a list back
    DP_COMPUTE = "dp_compute"  # a Batch split by data-parallel rank; results of the ranks that own a shard, in DP order
    RANK_ZERO = "rank_zero"  # same arguments to every rank; only rank 0's result


@dataclass(frozen=True)
class DPRank:
    """What a rank says about itself: its data-parallel coordinate and whether its output is the shard's answer.

    Under 3D layouts several ranks (a TP/PP group) share one DP rank and only one of them returns data.
    """

    dp_rank: int
    dp_size: int
    collects: bool


_ATTR = "__hybridflow_dispatch__"


@dataclass(frozen=True)
class Protocol:
    dispatch: Dispatch
    blocking: bool
    mesh: str  # which data-parallel layout DP_COMPUTE splits by: "train" or "rollout" (they differ under 3D layouts)


def register(dispatch: Dispatch = Dispatch.ONE_TO_ALL, blocking: bool = True,
             mesh: str = "train") -> Callable[[Callable], Callable]:
    """Mark a worker method as callable from the controller with this protocol.

    blocking=False returns a PendingResult that another worker group accepts as input without the controller
    touching the data. `mesh` names the layout a DP_COMPUTE method is split by: the 3D-HybridEngine generates with
    more data-parallel replicas (d * d_g) than it trains with (d), on the same ranks.
    """

    def deco(fn: Callable) -> Callable:
        setattr(fn, _ATTR, Protocol(Dispatch(dispatch), blocking, mesh))
        return fn

    return deco


def method_protocol(cls: type, name: str) -> Protocol | None:
    return getattr(getattr(cls, name, None), _ATTR, None)


def registered_methods(cls: type) -> dict[str, Protocol]:
    out = {}
    for name in dir(cls):
        proto = method_protocol(cls, name)
        if proto is not None:
            out[name] = proto
    return out


def protocol_methods(protocol: type) -> list[str]:
    """The methods a typing Protocol of a role declares (its own and its bases'), in name order."""
    names = set()
    for base in protocol.__mro__:
        if base is object or base.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n, v in vars(base).items() if callable(v) and not n.startswith("_")}
    return sorted(names)


def validate_dp_layout(layout: Sequence[DPRank]) -> int:
    """Every DP rank must be owned by exactly one collecting rank; returns the DP size."""
    sizes = {r.dp_size for r in layout}
    if len(sizes) != 1:
        raise ValueError(f"ranks disagree on the data-parallel size: {sorted(sizes)}")
    dp_size = sizes.pop()
    collectors = sorted(r.dp_rank for r in layout if r.collects)
    if collectors != list(range(dp_size)):
        raise ValueError(f"each data-parallel rank needs exactly one collecting rank, got {collectors}")
    if any(not 0 <= r.dp_rank < dp_size for r in layout):
        raise ValueError("a data-parallel rank is out of range")
    return dp_size


def split_for_dp(batch: Batch, layout: Sequence[DPRank]) -> list[Batch]:
    """The shard each rank (in rank order) receives."""
    dp_size = validate_dp_layout(layout)
    chunks = batch.chunk(dp_size)
    return [chunks[r.dp_rank] for r in layout]


def collect_dp(outputs: Sequence[Any], layout: Sequence[DPRank]) -> list[Any]:
    """The outputs of collecting ranks, ordered by DP rank."""
    pairs = sorted(((r.dp_rank, out) for r, out in zip(layout, outputs) if r.collects), key=lambda p: p[0])
    return [out for _, out in pairs]


def concat_results(parts: list[Any]) -> Any:
    if parts and all(isinstance(p, Batch) for p in parts):
        return Batch.concat(parts)
    return parts
