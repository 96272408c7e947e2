"""How a node given notice leaves a pool of independent replicas without losing their work (issue 29, item 3).

On Kubernetes a pod is told it will go (a scale-down, an eviction, a node drain, a spot preemption) by its preStop
hook, which runs `hybridflow leave-pool` in the pod: it names the pod's Ray node to the controller through a named
actor in the job's Ray cluster, `PoolMembership`, and waits until the controller has let the node's replicas finish
the call they are in and ended them (`released`). Only then does the pod stop. The actor is reached with the Ray
cluster's token like everything else in the job: nothing new listens. A pod killed outright never says so: its
replicas are lost, and rebuilt in its replacement (trainer.generation's replicas).
"""
from __future__ import annotations

import socket
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

MEMBERSHIP_ACTOR = "hybridflow-pool-membership"
MEMBERSHIP_NAMESPACE = "hybridflow"  # the driver's own namespace is anonymous: a named actor there is unreachable


Leaving = tuple[int, str]  # (pod index, Ray node id): a replacement pod has the index, never the node


@ray.remote(num_cpus=0)
class PoolMembership:
    """Pods announced as leaving, by pool, and those the controller has let go. Calls are short and never block."""

    def __init__(self) -> None:
        self._leaving: dict[str, set[Leaving]] = {}  # pool -> (index, node) announced
        self._released: set[tuple[str, int, str]] = set()

    def leave(self, pool: str, index: int, node_id: str) -> None:
        self._leaving.setdefault(pool, set()).add((index, node_id))

    def leaving(self, pool: str) -> list[Leaving]:
        """Every pod of `pool` announced as leaving, released or not (its node, still up for a while, is never
        taken for capacity)."""
        return sorted(self._leaving.get(pool, ()))

    def release(self, pool: str, index: int, node_id: str) -> None:
        self._released.add((pool, index, node_id))

    def released(self, pool: str, index: int, node_id: str) -> bool:
        return (pool, index, node_id) in self._released


def open_membership(timeout_s: float = 60.0) -> ray.actor.ActorHandle:
    """The job's membership actor, on the driver's own node and nowhere else (created by the controller; one per
    Ray cluster): on a pool's node it would die with the first pod that leaves, and every later one would go
    unheard. Returns once it answers."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = PoolMembership.options(name=MEMBERSHIP_ACTOR, namespace=MEMBERSHIP_NAMESPACE, get_if_exists=True,
                                   scheduling_strategy=here).remote()
    ray.get(actor.leaving.remote(""), timeout=timeout_s)
    return actor


def leave(address: str, pool: str, index: int, timeout_s: float, poll_s: float = 0.5) -> str:
    """From pod `index` of `pool`, given notice: announce it as leaving and wait until the controller released it,
    at most `timeout_s`. Returns what happened, in words. Never raises for a job that is gone or never ran a controller:
    then there is nothing to hand back, and the pod may stop at once."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), 3).close()
    except OSError as err:
        return f"the Ray head at {address} is not reachable ({err}): nothing to hand back"
    deadline = time.monotonic() + timeout_s
    try:
        ray.init(address=address, namespace=MEMBERSHIP_NAMESPACE, logging_level="ERROR", log_to_driver=False)
    except Exception as err:  # noqa: BLE001 - a head going away as the job ends
        return f"could not join the Ray cluster at {address} ({err}): nothing to hand back"
    try:
        return _announce(pool, index, deadline, poll_s, timeout_s)
    except ray.exceptions.RayError as err:  # the controller went (the job ended, or recovers as a whole)
        return f"the controller went away ({type(err).__name__}): pod {index} leaves pool {pool} as it is"
    finally:
        ray.shutdown()


def _announce(pool: str, index: int, deadline: float, poll_s: float, timeout_s: float) -> str:
    node = ray.get_runtime_context().get_node_id()
    try:
        actor = ray.get_actor(MEMBERSHIP_ACTOR, namespace=MEMBERSHIP_NAMESPACE)
    except ValueError:
        return f"no controller follows pool membership in this job: pod {index} leaves pool {pool} as it is"
    ray.get(actor.leave.remote(pool, index, node), timeout=max(1.0, deadline - time.monotonic()))
    while time.monotonic() < deadline:
        if ray.get(actor.released.remote(pool, index, node), timeout=max(1.0, deadline - time.monotonic())):
            return f"pod {index} left pool {pool}: the controller released its replicas"
        time.sleep(poll_s)
    return (f"pod {index} of pool {pool}: the controller did not release its replicas within {timeout_s:.0f} s; "
            "leaving anyway")
