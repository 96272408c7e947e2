"""A job's setup: the models on disk and its task (trainer.task) before Ray starts (`prepare`), then the worker
groups the algorithm asks for, placed on their resource pools (`build_workers`)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from hybridflow.api.run_policy import collective_timeout, startup_call_timeout
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.generation import rollout_replicas
from hybridflow.trainer.generation.replicas import RolloutReplicas
from hybridflow.trainer.generation.rollouts import ROLLOUT_MODES, Rollouts
from hybridflow.trainer.generation.weight_sync import WeightSync, weight_sync
from hybridflow.trainer.step import generation_rows
from hybridflow.trainer.task import Task, build_task
from hybridflow.single_controller.allocator import worker_allocator_env
from hybridflow.single_controller.membership import open_membership
from hybridflow.single_controller.resource_pool import RayResourcePool
from hybridflow.single_controller.worker_group import RoleHandle, RoleSpec, WorkerGroup
from hybridflow.roles.protocols import PooledRolloutRole, RolloutRole
from hybridflow.roles import config as rc
from hybridflow.api import JobSpec, ResourcePool, RLHFJob
from hybridflow.api.training import actor_is_reference


@dataclass
class Workers:
    """Role name -> handle, the groups that host them (one group per resource pool: colocation), and how the
    actor's weights reach generation (`weights`: in memory beside it, or streamed to a rollout pool of its own)."""

    roles: dict[str, RoleHandle[Any]]
    groups: list[WorkerGroup]
    devices: int
    weights: WeightSync
    spec: JobSpec
    replicas: RolloutReplicas | None = None  # a rollout pool of its own: which replicas take work

    def first_step_done(self) -> None:
        """The gang has started: from now on the controller waits for a worker's answer as long as a step may take
        (the collective timeout), not the start-up's longer bound (api.run_policy.startup_call_timeout)."""
        for group in self.groups:
            group.call_timeout_s = collective_timeout(self.spec.run_policy)

    def sync_weights(self, version: int) -> dict[str, float]:
        return self.weights.sync(version)

    @property
    def rollout(self) -> RoleHandle[RolloutRole]:
        """The rollout role on its replicas there now (a pool of replicas grows and shrinks:
        trainer.generation.scaling)."""
        if self.replicas is None:
            return self.roles["rollout"].typed(RolloutRole)
        return self.replicas.handle(self.replicas.members()).typed(RolloutRole)

    @property
    def rollout_apart(self) -> bool:
        """Whether rollout has a pool of its own (generation and training can overlap)."""
        return self.pools["rollout"] != self.pools["actor"]

    def rollouts(self, prompts: Callable[[], Batch], stop_token_ids: Sequence[int]) -> Rollouts:
        """The source of the job's generations for its spec.rollout.mode, drawing prompts from `prompts`."""
        s = self.spec
        ranks = self.roles["rollout"].dp_sizes["rollout"]
        shape = functools.partial(generation_rows, n=s.rollout.responses_per_prompt)
        return ROLLOUT_MODES[s.rollout.mode](s, self.roles["rollout"], self.weights, prompts, shape, ranks,
                                             tuple(stop_token_ids), self.replicas)

    @property
    def pools(self) -> dict[str, str]:
        """Role -> the name of the pool hosting it (a LoRA actor's pool hosts the reference too: actor_is_reference)."""
        pools = {role: g.pool.name for g in self.groups for role in g.roles}
        if "reference" in self.roles and actor_is_reference(self.spec.training):
            pools["reference"] = pools["actor"]
        return pools

    def shutdown(self) -> None:
        if self.replicas is not None:
            self.replicas.scaling.close()
        close_groups(self.groups)


def _slots(s: JobSpec, pool: ResourcePool) -> list[int] | None:
    """The pod indices a pool of independent replicas (an async job's rollout pool of its own) starts with, each
    node's placement group held to its pod (api.pool_slot_resource): an elastic one its minReplicas (it grows into
    the pods there once running: trainer.generation.replicas), any other all of them. None for every other pool."""
    if not s.replica_pool(pool.name):
        return None
    return list(range(s.rollout_pool.min_replicas if s.rollout_pool is not None else pool.nodes))


def close_groups(groups: list[WorkerGroup]) -> None:
    """Ends each group's worker processes and hands its placement groups back to Ray."""
    for g in groups:
        g.shutdown()
        g.pool.release()


def build_workers(job: RLHFJob, model_dir: Path, task: Task, critic_dir: Path | None, rm_dir: Path | None,
                  cost_dir: Path | None = None) -> Workers:
    """The roles the algorithm needs (actor and rollout always; reference when KL is used; critics, reward and cost
    models as the algorithm and the spec say), grouped by resource pool: roles on one pool share its processes.
    The rollout role comes right after the actor: it is built in the actor's processes on the actor's engine."""
    from hybridflow.roles.actor import ActorWorker
    from hybridflow.roles.rollout import PooledRolloutWorker, RolloutWorker
    from hybridflow.roles.critic import CriticWorker
    from hybridflow.roles.reference import ReferenceWorker
    from hybridflow.roles.reward_model import RewardModelWorker

    s = job.spec
    critic = {"config": rc.critic_config(s), "model_dir": str(critic_dir or model_dir)}
    actor = rc.actor_config(s)
    apart = s.pool("rollout").name != s.pool("actor").name
    wanted: dict[str, RoleSpec] = {
        "actor": RoleSpec(ActorWorker, {"config": actor, "model_dir": str(model_dir)}),
        "rollout": RoleSpec(PooledRolloutWorker, {"config": actor, "stop_token_ids": task.stop_token_ids,
                                                  "model_dir": str(model_dir)}, independent=True) if apart else
        RoleSpec(RolloutWorker, {"config": actor, "stop_token_ids": task.stop_token_ids}, colocated=("actor",)),
    }
    runs = set(s.roles())  # the one list of the job's roles (status.pools shows the same)
    if "reference" in runs and not actor_is_reference(s.training):
        wanted["reference"] = RoleSpec(ReferenceWorker, {"config": rc.reference_config(s), "model_dir": str(model_dir)})

    def beside(role: str) -> tuple[str, ...]:  # a critic on the actor's devices: the generation engine there, to
        return ("rollout",) if not apart and s.pool(role).name == s.pool("actor").name else ()  # free before it trains

    if "critic" in runs:
        wanted["critic"] = RoleSpec(CriticWorker, critic, colocated=beside("critic"))
    if "cost_critic" in runs:
        wanted["cost_critic"] = RoleSpec(CriticWorker, {**critic, "prefix": "cost_"}, colocated=beside("cost_critic"))
    if "judge" in runs:
        from hybridflow.roles.judge import JudgeWorker

        if task.reward.judge is None:
            raise ValueError("the job's judge model was not materialized (prepare() gives its directory)")
        j = task.reward.judge
        wanted["judge"] = RoleSpec(JudgeWorker, {"config": rc.judge_config(s), "model_dir": str(j.model_dir),
                                                 "stop_token_ids": j.stop_token_ids})
    for judge, where in (("reward", rm_dir), ("cost", cost_dir)):
        if judge in runs:
            if where is None:
                raise ValueError(f"the job's {judge} model was not materialized (prepare() gives its directory)")
            wanted[judge] = RoleSpec(RewardModelWorker, {"config": rc.scoring_model_config(s, judge), "model_dir": str(where)})
    by_pool: dict[str, dict[str, RoleSpec]] = {}
    for role, rs in wanted.items():
        by_pool.setdefault(s.pool(role).name, {})[role] = rs
    env = {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    groups: list[WorkerGroup] = []
    roles: dict[str, RoleHandle[Any]] = {}
    try:  # whatever fails half-way (a worker lost while the groups form) leaves no group holding devices
        for index, pool_spec in enumerate(s.resource_pools):
            if pool_spec.name not in by_pool:
                continue
            threads = max(1, int(pool_spec.cpus_per_device))
            slots = _slots(s, pool_spec)
            pool = RayResourcePool(pool_spec.name, len(slots) if slots is not None else pool_spec.nodes,
                                   pool_spec.devices_per_node, pool_spec.device, pool_spec.cpus_per_device,
                                   slots=slots)
            allocator = worker_allocator_env(pool_spec.allocator, f"spec.resourcePools[{index}].allocator")
            group = WorkerGroup(pool, by_pool[pool_spec.name], env={**env, "OMP_NUM_THREADS": str(threads)},
                                process_env=allocator, collective_timeout_s=collective_timeout(s.run_policy),
                                call_timeout_s=startup_call_timeout(s.run_policy))  # until first_step_done
            groups.append(group)
            roles.update({r: group[r] for r in group.roles})
        if "reference" in runs and actor_is_reference(s.training):
            roles["reference"] = roles["actor"]  # its compute_ref_log_prob: the base, adapters off
        devices = sum(g.pool.world_size for g in groups)
        replicas = None
        if apart:
            rollout_group = next(g for g in groups if "rollout" in g.roles)
            # async replaces a lost replica alone; the other modes wait on its generation and recover as a whole
            policy = s.run_policy if s.rollout.mode == "async" else None
            most = s.pool("rollout").nodes if s.rollout_pool is None else s.rollout_pool.max_replicas
            membership = open_membership() if rollout_group.pool.slots is not None else None
            pooled = roles["rollout"].typed(PooledRolloutRole)
            replicas = rollout_replicas(rollout_group, pooled, policy, most, membership)
        weights = weight_sync(roles, replicas, s.rollout.weight_sync_timeout_seconds)
    except BaseException:
        close_groups(groups)
        raise
    return Workers(roles, groups, devices, weights, s, replicas)


@dataclass
class Prepared:
    """What a job needs before its workers start: model directories, and the prompts and the reward."""

    model_dir: Path
    critic_dir: Path | None
    rm_dir: Path | None
    task: Task
    cost_dir: Path | None = None

    def close(self) -> None:
        self.task.close()  # a reward function's worker processes


def prepare(job: RLHFJob, progress: bool = True) -> Prepared:
    """Models and data, before Ray starts: a bad data file is exit 2 with nothing started, and tokenizing does not
    hold a cluster's devices."""
    from hybridflow.models.builders import materialize, model_cache_dir

    s = job.spec
    cache = model_cache_dir()
    if progress:
        print(f"job {job.metadata.name}: {s.algorithm.name} on {s.models.actor.source} model, rollout "
              f"{s.rollout.engine}, {s.trainer.steps} steps x {s.trainer.prompts_per_step} prompts x "
              f"{s.rollout.responses_per_prompt} samples")
    model_dir = materialize(s.models.actor, cache, s.trainer.seed)
    critic_dir = materialize(s.models.critic, cache, s.trainer.seed) if s.models.critic else None
    rm_dir = materialize(s.models.reward.model, cache, s.trainer.seed) if s.models.reward.model else None
    cost = s.models.cost.model if s.models.cost is not None else None
    cost_dir = materialize(cost, cache, s.trainer.seed) if cost is not None else None
    judge = s.models.reward.judge
    task = build_task(job, model_dir, materialize(judge.model, cache, s.trainer.seed) if judge else None)
    if progress:
        print(f"prompts: {len(task.train)} for training, {len(task.eval)} held out")
    return Prepared(model_dir, critic_dir, rm_dir, task, cost_dir)
