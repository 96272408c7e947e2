"""Where a role's process sits in its worker group: its rank, the group's size and its device. Ray-free, so the
engines and roles that take it import no scheduler."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int
    device: str
