"""Where a step's generations come from: the rollout modes (`rollouts`), the replicas of a rollout pool of its own
(`replicas`, with the failure policy that replaces lost ones, `failures`, and the scaling policy that grows and
shrinks the pool, `scaling`), and how the trainer's weights reach generation (`weight_sync`)."""
from __future__ import annotations

from typing import Any

from hybridflow.api.run_policy import RunPolicy
from hybridflow.roles.protocols import PooledRolloutRole
from hybridflow.single_controller.worker_group import RoleHandle, WorkerGroup
from hybridflow.trainer.generation.failures import ReplaceLost
from hybridflow.trainer.generation.replicas import REPLICA_BUILD_TIMEOUT_S, RolloutReplicas
from hybridflow.trainer.generation.scaling import ElasticScaling


def rollout_replicas(group: WorkerGroup, role: RoleHandle[PooledRolloutRole], policy: RunPolicy | None,
                     most: int | None = None, membership: Any = None,
                     build_timeout_s: float = REPLICA_BUILD_TIMEOUT_S) -> RolloutReplicas:
    """The replicas of a rollout pool of its own, with their failure policy (`policy`: runPolicy, for a mode that
    replaces a lost replica alone; None: never) and their scaling policy (up to `most` slots; `membership`: the
    job's single_controller.membership actor)."""
    replicas = RolloutReplicas(group, role, build_timeout_s)
    replicas.failures = ReplaceLost(replicas, policy)
    replicas.scaling = ElasticScaling(replicas, most, membership)
    return replicas
