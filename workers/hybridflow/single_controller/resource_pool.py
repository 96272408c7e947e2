"""A pool's devices as Ray reserves them: one placement group per node (pod), one bundle per device. The worker
groups (single_controller.worker_group) place their processes in its bundles."""
from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from hybridflow.api import pool_resource, pool_slot_resource


@dataclass
class RayResourcePool:
    """A virtualised set of devices: one placement group per node, one bundle per device. With `slots` (a pool of
    independent replicas), node k's placement group asks for the slot resource of pod index slots[k]
    (api.pool_slot_resource): only that pod, or its replacement, holds it; the pool can then grow and shrink by
    node while it runs (`add_node`, `remove_node`)."""

    name: str
    nodes: int
    devices_per_node: int
    device: str = "cpu"
    cpus_per_device: float = 1.0
    placement_groups: list[PlacementGroup] = field(default_factory=list)
    slots: list[int] | None = None  # the pod index each placement group is held to, in order; None: any node
    _slot_by_group: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # group id -> slot

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def bundle(self, slot: int | None = None) -> dict[str, float]:
        b = {"CPU": self.cpus_per_device, pool_resource(self.name): 1.0}
        if slot is not None:
            b[pool_slot_resource(self.name, slot)] = 1.0
        if self.device == "gpu":
            b["GPU"] = 1.0
        return b

    def _placement_group(self, i: int) -> PlacementGroup:
        slot = self.slots[i] if self.slots is not None else None
        pg = placement_group([self.bundle(slot)] * self.devices_per_node, strategy="STRICT_PACK",
                             name=f"{self.name}-{i if slot is None else slot}")
        if slot is not None:
            self._slot_by_group[pg.id.hex()] = slot
        return pg

    def acquire(self, timeout_s: float = 300) -> list[tuple[PlacementGroup, int]]:
        """Reserve the devices; returns (placement group, bundle index) per rank, ranks packed node by node."""
        if not self.placement_groups:
            self.placement_groups = [self._placement_group(i) for i in range(self.nodes)]
            try:
                ray.get([pg.ready() for pg in self.placement_groups], timeout=timeout_s)
            except BaseException:  # not placed in time (a replacement pod still starting): none is left pending
                self.release()
                raise
        return [(pg, i) for pg in self.placement_groups for i in range(self.devices_per_node)]

    def release(self) -> None:
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []
        self._slot_by_group.clear()

    def slot_of(self, pg: PlacementGroup) -> int | None:
        """The pod index `pg` is held to (None: unslotted, or given back)."""
        return self._slot_by_group.get(pg.id.hex())

    def add_node(self, slot: int, timeout_s: float) -> list[tuple[PlacementGroup, int]]:
        """The node of pod index `slot` joins the pool (slotted pools only): its (placement group, bundle index) per
        device, once Ray placed it there."""
        assert self.slots is not None, f"pool {self.name} is not slotted"
        self.slots.append(slot)
        pg = self._placement_group(len(self.slots) - 1)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except BaseException:
            self.slots.pop()
            self._slot_by_group.pop(pg.id.hex(), None)
            remove_placement_group(pg)
            raise
        self.placement_groups.append(pg)
        self.nodes += 1
        return [(pg, i) for i in range(self.devices_per_node)]

    def remove_node(self, pg: PlacementGroup) -> None:
        """A node given back (its ranks retired): Ray does not place its bundles again anywhere."""
        self._slot_by_group.pop(pg.id.hex(), None)
        if pg in self.placement_groups:
            k = self.placement_groups.index(pg)
            del self.placement_groups[k]
            if self.slots is not None:
                del self.slots[k]
            self.nodes -= 1
        remove_placement_group(pg)
