"""A job's setup: its prompts and how responses are scored (the Task), the models on disk, and the worker groups
the algorithm asks for, placed on their resource pools."""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hybridflow.agents.places import job_tools
from hybridflow.api.run_policy import collective_timeout
from hybridflow.api.storage import is_url
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.replicas import REPLICA_BUILD_TIMEOUT_S, RolloutReplicas
from hybridflow.trainer.rollouts import ROLLOUT_MODES, Rollouts
from hybridflow.trainer.weight_sync import ColocatedWeightSync, StreamedWeightSync, WeightSync
from hybridflow.trainer.step import Scorer, generation_rows
from hybridflow.single_controller.allocator import worker_allocator_env
from hybridflow.single_controller.membership import open_membership
from hybridflow.single_controller.resource_pool import RayResourcePool
from hybridflow.single_controller.worker_group import RoleSpec, WorkerGroup
from hybridflow.data.files import PromptRenderer, load_prompt_files
from hybridflow.data.packing import unpack_prompts, unpack_responses
from hybridflow.data.tasks import Sample, arithmetic_samples, increment_samples, products_samples, split_train_eval
from hybridflow.rewards.rules import TASK_DEFAULT_RULE, RewardRule, get_rule
from hybridflow.rewards.text import TextReward
from hybridflow.roles import config as rc
from hybridflow.api import JobSpec, ResourcePool, RLHFJob, SpecError

log = logging.getLogger("hybridflow.trainer.setup")


@dataclass
class Task:
    train: Sequence[Sample]
    eval: Sequence[Sample]
    rule: Callable[..., float] | None  # reward type rule: over token ids
    decode: Callable[[list[int]], str] | None
    stop_token_ids: list[int]
    text_reward: TextReward | None = None  # reward types scorer/function: scored on decoded responses
    data_fingerprint: str | None = None  # prompts from files: a resumed job checks it reads the same rows
    cost_rule: RewardRule | None = None  # safe_rlhf with a cost rule
    episode_score: str | None = None  # multi-turn rollouts: reward, environment or both (spec.rollout.agent.score)

    def close(self) -> None:
        if self.text_reward is not None:
            self.text_reward.close()


def data_cache_default(checkpoint_dir: str) -> Path:
    """<checkpointDir>/data-cache, or a local directory when checkpoints go to object storage (the cache is read
    as files)."""
    if is_url(checkpoint_dir):
        import tempfile

        return Path(tempfile.gettempdir()) / "hybridflow-data-cache"
    return Path(checkpoint_dir) / "data-cache"


def build_task(job: RLHFJob, model_dir: Path) -> Task:
    """The prompts (generated, or the user's files tokenized once) and how responses are scored."""
    s = job.spec
    r = s.models.reward
    # A generated task always has its rule: with a reward model it still scores the held-out evaluation.
    rule = get_rule(r.rule or TASK_DEFAULT_RULE[s.data.task]) if s.data.source == "generated" else None
    decode, stop, fingerprint = None, [], None
    if s.data.source == "generated" and s.data.task == "increment":
        vocab = s.models.actor.tiny.vocab_size if s.models.actor.source == "tiny" else _vocab_size(model_dir)
        n = s.data.train_prompts + s.data.eval_prompts
        train, held_out = split_train_eval(increment_samples(n, vocab, min(8, s.rollout.max_prompt_length),
                                                             s.data.seed), s.data.eval_prompts)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        tools = [t.offered() for t in job_tools(s.rollout.agent).values()] if s.rollout.agent else []
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
        if s.data.source == "files":
            cache = Path(s.data.cache_dir or data_cache_default(s.trainer.checkpoint_dir))
            files = load_prompt_files(s.data, tok, s.rollout.max_prompt_length, cache, s.trainer.prompts_per_step,
                                      tools)
            train, held_out, fingerprint = files.train, files.eval, files.fingerprint
        else:
            renderer = PromptRenderer(tok, None, None, tools)  # the model's chat template, one user message
            make = products_samples if s.data.task == "products" else arithmetic_samples
            samples = make(s.data.train_prompts + s.data.eval_prompts, s.data.seed,
                           lambda text: renderer.ids(text, f"the {s.data.task} task"))
            too_long = max(len(x.prompt) for x in samples)
            if too_long > s.rollout.max_prompt_length:
                raise ValueError(
                    f"spec.rollout.maxPromptLength={s.rollout.max_prompt_length} is shorter than the task's prompts "
                    f"({too_long} tokens); raise it"
                )
            train, held_out = split_train_eval(samples, s.data.eval_prompts)
    if s.data.source == "generated" and len(train) < s.trainer.prompts_per_step:  # the stream would refuse later
        raise SpecError(f"spec.data.trainPrompts = {s.data.train_prompts}: only {len(train)} generated prompts are "
                        f"left to train on once those repeating one of the {len(held_out)} held-out prompts are "
                        f"dropped (the {s.data.task} task has few distinct prompts), fewer than "
                        f"spec.trainer.promptsPerStep = {s.trainer.prompts_per_step}; raise trainPrompts or lower "
                        "promptsPerStep or evalPrompts")
    text_reward = TextReward(r) if r.type in ("scorer", "function") else None
    c = s.models.cost
    cost_rule = get_rule(c.rule) if c is not None and c.type == "rule" and c.rule else None
    score = s.rollout.agent.episode_score if s.rollout.agent else None
    return Task(train, held_out, rule, decode, stop, text_reward, fingerprint, cost_rule, score)


def _vocab_size(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


@dataclass
class Workers:
    """Role name -> handle, the groups that host them (one group per resource pool: colocation), and how the
    actor's weights reach generation (`weights`: in memory beside it, or streamed to a rollout pool of its own)."""

    roles: dict[str, Any]
    groups: list[WorkerGroup]
    devices: int
    weights: WeightSync
    spec: JobSpec
    replicas: RolloutReplicas | None = None  # a rollout pool of its own: which replicas take work

    def sync_weights(self, version: int) -> dict[str, float]:
        return self.weights.sync(version)

    @property
    def rollout(self) -> Any:
        """The rollout role on its replicas there now (a pool of replicas grows and shrinks: trainer.replicas)."""
        if self.replicas is None:
            return self.roles["rollout"]
        return self.replicas.handle(self.replicas.members())

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
        """Role -> the name of the pool hosting it."""
        return {role: g.pool.name for g in self.groups for role in g.roles}

    def shutdown(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
        close_groups(self.groups)


def _slots(s: JobSpec, pool: ResourcePool) -> list[int] | None:
    """The pod indices a pool of independent replicas (an async job's rollout pool of its own) starts with, each
    node's placement group held to its pod (api.pool_slot_resource): an elastic one its minReplicas (it grows into
    the pods there once running: trainer.replicas), any other all of them. None for every other pool."""
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
    if "reference" in runs:
        wanted["reference"] = RoleSpec(ReferenceWorker, {"config": rc.reference_config(s), "model_dir": str(model_dir)})
    if "critic" in runs:
        wanted["critic"] = RoleSpec(CriticWorker, critic)
    if "cost_critic" in runs:
        wanted["cost_critic"] = RoleSpec(CriticWorker, {**critic, "prefix": "cost_"})
    for judge, where in (("reward", rm_dir), ("cost", cost_dir)):
        if judge in runs:
            if where is None:
                raise ValueError(f"the job's {judge} model was not materialized (prepare() gives its directory)")
            wanted[judge] = RoleSpec(RewardModelWorker, {"config": rc.judge_config(s, judge), "model_dir": str(where)})
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
    roles = {}
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
                                process_env=allocator, collective_timeout_s=collective_timeout(s.run_policy))
            groups.append(group)
            roles.update({r: group[r] for r in group.roles})
        devices = sum(g.pool.world_size for g in groups)
        replicas = None
        weights: WeightSync = ColocatedWeightSync(roles["rollout"])
        if apart:
            rollout_group = next(g for g in groups if "rollout" in g.roles)
            # async replaces a lost replica alone; the other modes wait on its generation and recover as a whole
            policy = s.run_policy if s.rollout.mode == "async" else None
            most = s.pool("rollout").nodes if s.rollout_pool is None else s.rollout_pool.max_replicas
            membership = open_membership() if rollout_group.pool.slots is not None else None
            replicas = RolloutReplicas(rollout_group, roles["rollout"], policy, REPLICA_BUILD_TIMEOUT_S, most,
                                       membership)
            weights = StreamedWeightSync(roles["actor"], replicas, s.rollout.weight_sync_timeout_seconds)
    except BaseException:
        close_groups(groups)
        raise
    return Workers(roles, groups, devices, weights, s, replicas)


def prompt_batch(samples: list[Sample], uid_offset: int = 0) -> Batch:
    return Batch(
        non_tensors={
            "prompt_ids": [s.prompt for s in samples],
            "truth": [s.truth for s in samples],
            "data_source": [s.data_source for s in samples],
            "extra_info": [s.extra_info for s in samples],
            "uid": list(range(uid_offset, uid_offset + len(samples))),
        }
    )


def reward_scores(batch: Batch, task: Task) -> tuple[torch.Tensor, dict[str, float]]:
    """Scores of the batch's responses by the task's rule or text reward, and reward statistics for the step log
    (failed samples, and the means of a reward function's extra metrics)."""
    if task.episode_score is not None and task.episode_score != "reward":  # the environment's rewards
        env = batch["env_reward"].float()
        if task.episode_score == "environment":
            return env, {}
        scores, stats = reward_scores(batch, replace(task, episode_score=None))
        return scores + env, stats
    prompts, responses = unpack_prompts(batch), unpack_responses(batch)
    if task.text_reward is None:
        assert task.rule is not None
        scores = [task.rule(p, r, t, task.decode) for p, r, t in zip(prompts, responses, batch["truth"])]
        return torch.tensor(scores, dtype=torch.float32), {}
    assert task.decode is not None
    n = len(responses)
    out = task.text_reward.score(list(batch["data_source"]), [task.decode(r) for r in responses],
                                 list(batch["truth"]), [dict(x) for x in batch["extra_info"]])
    stats = {"reward_errors": float(len(out.errors))}
    for key, values in out.extras.items():
        got = [v for v in values if v == v]  # NaN: that sample's result had no such key
        if got:
            stats[f"reward_{key}_mean"] = float(np.mean(got))
    if out.errors:
        log.warning("%d of %d samples could not be scored; first: %s", len(out.errors), n, out.errors[0])
    return torch.tensor(out.scores, dtype=torch.float32), stats




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
    task = build_task(job, model_dir)
    if progress:
        print(f"prompts: {len(task.train)} for training, {len(task.eval)} held out")
    return Prepared(model_dir, critic_dir, rm_dir, task, cost_dir)


def cost_scores(batch: Batch, task: Task) -> tuple[torch.Tensor, dict[str, float]]:
    """The cost rule over each response (safe_rlhf with spec.models.cost.type rule)."""
    assert task.cost_rule is not None
    prompts, responses = unpack_prompts(batch), unpack_responses(batch)
    costs = [task.cost_rule(p, r, t, task.decode) for p, r, t in zip(prompts, responses, batch["truth"])]
    return torch.tensor(costs, dtype=torch.float32), {}


def controller_scorers(task: Task) -> dict[str, Scorer]:
    """The stages scored on the controller rather than by a model: rules and reward functions."""
    out: dict[str, Scorer] = {}
    if task.rule is not None or task.text_reward is not None or task.episode_score not in (None, "reward"):
        out["reward"] = lambda batch: reward_scores(batch, task)
    if task.cost_rule is not None:
        out["cost"] = lambda batch: cost_scores(batch, task)
    return out
