"""The single controller: RLHF dataflows as short programs over worker groups (HybridFlow section 4, Figure 4).

`ppo_iteration` is the paper's PPO listing: generate, old log-probs, reference log-probs, values, rewards,
advantages, critic update, actor update, then the hybrid engine's train -> generate transition (weight sync).
GRPO is the same program without the critic and with group-normalised advantages.
"""
from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from hybridflow import checkpoint as ckpt
from hybridflow.algorithms.core import gae, grpo_advantages, kl_estimate, masked_mean, token_rewards
from hybridflow.controller.batch import Batch
from hybridflow.controller.worker_group import ResourcePool, RoleSpec, WorkerGroup, resolve
from hybridflow.data.files import PromptRenderer, load_prompt_files
from hybridflow.data.packing import unpack_prompts, unpack_responses
from hybridflow.data.tasks import (
    PromptStream,
    Sample,
    arithmetic_samples,
    increment_samples,
    split_train_eval,
)
from hybridflow.metrics import JobMetrics
from hybridflow.rewards.rules import TASK_DEFAULT_RULE, get_rule
from hybridflow.rewards.text import TextReward
from hybridflow.spec import RLHFJob

log = logging.getLogger("hybridflow.trainer")


# ---------------------------------------------------------------------------------------------------------------------
# Setup: models, data, worker groups


@dataclass
class Task:
    train: Sequence[Sample]
    eval: Sequence[Sample]
    rule: Callable[..., float] | None  # reward type rule: over token ids
    decode: Callable[[list[int]], str] | None
    stop_token_ids: list[int]
    text_reward: TextReward | None = None  # reward types scorer/function: scored on decoded responses
    data_fingerprint: str | None = None  # prompts from files: a resumed job checks it reads the same rows

    def close(self) -> None:
        if self.text_reward is not None:
            self.text_reward.close()


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
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
        if s.data.source == "files":
            cache = Path(s.data.cache_dir or Path(s.trainer.checkpoint_dir) / "data-cache")
            files = load_prompt_files(s.data, tok, s.rollout.max_prompt_length, cache, s.trainer.prompts_per_step)
            train, held_out, fingerprint = files.train, files.eval, files.fingerprint
        else:
            renderer = PromptRenderer(tok, None, None)  # the model's chat template, one user message
            samples = arithmetic_samples(s.data.train_prompts + s.data.eval_prompts, s.data.seed,
                                         lambda text: renderer.ids(text, "the arithmetic task"))
            too_long = max(len(x.prompt) for x in samples)
            if too_long > s.rollout.max_prompt_length:
                raise ValueError(
                    f"spec.rollout.maxPromptLength={s.rollout.max_prompt_length} is shorter than the task's prompts "
                    f"({too_long} tokens); raise it"
                )
            train, held_out = split_train_eval(samples, s.data.eval_prompts)
    text_reward = TextReward(r) if r.type in ("scorer", "function") else None
    return Task(train, held_out, rule, decode, stop, text_reward, fingerprint)


def _vocab_size(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


@dataclass
class Workers:
    """Role name -> handle, and the groups that host them (one group per resource pool: colocation)."""

    roles: dict[str, Any]
    groups: list[WorkerGroup]
    devices: int

    def shutdown(self) -> None:
        for g in self.groups:
            g.shutdown()
            g.pool.release()


def build_workers(job: RLHFJob, model_dir: Path, task: Task, critic_dir: Path | None, rm_dir: Path | None) -> Workers:
    from hybridflow.roles.actor import ActorRolloutWorker
    from hybridflow.roles.critic import CriticWorker
    from hybridflow.roles.reference import ReferenceWorker
    from hybridflow.roles.reward_model import RewardModelWorker

    s = job.spec
    spec = s.model_dump()
    wanted: dict[str, RoleSpec] = {
        "actor": RoleSpec(ActorRolloutWorker, {"spec": spec, "model_dir": str(model_dir), "stop_token_ids": task.stop_token_ids})
    }
    if s.models.reference:
        wanted["reference"] = RoleSpec(ReferenceWorker, {"spec": spec, "model_dir": str(model_dir)})
    if s.algorithm.name == "ppo":
        wanted["critic"] = RoleSpec(CriticWorker, {"spec": spec, "model_dir": str(critic_dir or model_dir)})
    if rm_dir is not None:
        wanted["reward"] = RoleSpec(RewardModelWorker, {"spec": spec, "model_dir": str(rm_dir)})
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
    groups, roles = [], {}
    for pool_spec in s.resource_pools:
        if pool_spec.name not in by_pool:
            continue
        threads = max(1, int(pool_spec.cpus_per_device))
        pool = ResourcePool(
            pool_spec.name, pool_spec.nodes, pool_spec.devices_per_node, pool_spec.device, pool_spec.cpus_per_device
        )
        group = WorkerGroup(pool, by_pool[pool_spec.name], env={**env, "OMP_NUM_THREADS": str(threads)})
        groups.append(group)
        roles.update({r: group[r] for r in group.roles})
    devices = sum(g.pool.world_size for g in groups)
    return Workers(roles, groups, devices)


# ---------------------------------------------------------------------------------------------------------------------
# Pure pieces of the dataflow


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


def real_tokens(batch: Batch) -> int:
    return int(batch["attention_mask"].sum())


@dataclass
class StageClock:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------------
# One RLHF iteration


def rlhf_iteration(job: RLHFJob, w: Workers, task: Task, prompts: Batch) -> tuple[dict[str, float], dict[str, float]]:
    s, algo = job.spec, job.spec.algorithm
    actor, ref, critic, rm = (w.roles.get(r) for r in ("actor", "reference", "critic", "reward"))
    clock = StageClock()
    batch = prompts.repeat(s.rollout.responses_per_prompt)  # n responses per prompt, groups adjacent

    with clock("generate"):
        rollout = actor.generate(batch)  # futures: the next calls take them without the controller touching data
        _wait(rollout)
    with clock("old_log_prob"):
        old = actor.compute_log_prob(rollout)
        _wait(old)
    if ref is not None:
        with clock("reference"):
            ref_lp = ref.compute_ref_log_prob(rollout)
            _wait(ref_lp)
    if critic is not None:
        with clock("values"):
            values = critic.compute_values(rollout)
            _wait(values)
    with clock("reward"):
        data = resolve(rollout).union(resolve(old))
        if ref is not None:
            data = data.union(resolve(ref_lp))
        if critic is not None:
            data = data.union(resolve(values))
        reward_stats: dict[str, float] = {}
        if rm is not None:
            scores = resolve(rm.compute_rm_scores(data))["rm_scores"]
        else:
            scores, reward_stats = reward_scores(data, task)
    with clock("advantages"):
        mask = data["response_mask"]
        kl = kl_estimate(data["old_log_probs"], data["ref_log_probs"], algo.kl_estimator) if ref else None
        kl_reward = algo.kl_coef if algo.kl_in == "reward" else 0.0
        if algo.name == "grpo":
            adv = grpo_advantages(scores - _seq_kl(kl, mask, kl_reward), torch.as_tensor(data["uid"].astype(np.int64)),
                                  mask, algo.norm_adv_by_std)
            data.tensors["advantages"] = adv
        else:
            rewards = token_rewards(scores, mask, kl, kl_reward)
            adv, returns = gae(rewards, data["values"], mask, algo.gamma, algo.lam)
            data.tensors.update(advantages=adv, returns=returns)
    stats: dict[str, float] = dict(reward_stats)
    if critic is not None:
        with clock("critic_update"):
            stats.update(_mean_stats(critic.update_critic(data), "critic_"))
    with clock("actor_update"):
        stats.update(_mean_stats(actor.update_actor(data), ""))
    with clock("reshard"):  # train -> generate (the 3D-HybridEngine transition, or FSDP's whole-tensor gather)
        sync = actor.sync_rollout_weights()
    stats.update(reshard_stats(sync))

    resp_len = mask.sum(1).float()
    stats.update(
        reward_mean=float(scores.mean()),
        response_length_mean=float(resp_len.mean()),
        entropy_mean=float(masked_mean(data["entropy"], mask)),
        tokens=float(real_tokens(data)),
        response_tokens=float(resp_len.sum()),
    )
    if kl is not None:
        stats["kl_mean"] = float(masked_mean(kl, mask))
    return stats, clock.seconds


def reshard_stats(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Bytes received per rank (mean), the largest transient buffer and generation weights held (max)."""
    return {"reshard_bytes": float(np.mean([x["bytes"] for x in per_rank])),
            "reshard_peak_bytes": float(max(x["peak_bytes"] for x in per_rank)),
            "generation_weight_bytes": float(max(x["generation_bytes"] for x in per_rank))}


def _seq_kl(kl: torch.Tensor | None, mask: torch.Tensor, coef: float) -> torch.Tensor:
    if kl is None or not coef:
        return torch.zeros(mask.shape[0])
    return coef * (kl * mask).sum(1)


def _wait(pending: Any) -> None:
    import ray

    ray.wait(pending.refs, num_returns=len(pending.refs), fetch_local=False)


def _mean_stats(per_rank: list[dict[str, float]], prefix: str) -> dict[str, float]:
    keys = per_rank[0].keys()
    out = {f"{prefix}{k}": float(np.mean([r[k] for r in per_rank])) for k in keys}
    if "peak_memory_bytes" in keys:
        out[f"{prefix or 'actor_'}peak_memory_bytes"] = float(max(r["peak_memory_bytes"] for r in per_rank))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation, checkpoints, the loop


def evaluate(w: Workers, task: Task, samples: Sequence[Sample]) -> float:
    """Mean reward of greedy responses to held-out prompts."""
    dp = w.roles["actor"].dp_size
    usable = samples[: len(samples) // dp * dp]
    out = resolve(w.roles["actor"].generate(prompt_batch(usable), greedy=True))
    if task.rule is None and task.text_reward is None:  # files scored by a reward model only: it judges
        return float(resolve(w.roles["reward"].compute_rm_scores(out))["rm_scores"].mean())
    return float(reward_scores(out, task)[0].mean())


def save(job: RLHFJob, w: Workers, root: Path, step: int, stream: PromptStream,
         data_fingerprint: str | None = None) -> Path:
    staging = ckpt.staging_dir(root, step)
    for role in ("actor", "critic"):
        if role in w.roles:
            w.roles[role].save_checkpoint(str(staging))
    state = {"data_position": stream.position, "data_fingerprint": data_fingerprint, "job": job.metadata.name}
    return ckpt.seal(root, staging, step, state, job.spec.trainer.keep_checkpoints)


def restore(w: Workers, root: Path, data_fingerprint: str | None = None) -> tuple[int, int]:
    """(step, data position) of the checkpoint loaded, or (0, 0) for a fresh start."""
    found = ckpt.latest_good(root)
    if found is None:
        return 0, 0
    path, state = found
    if data_fingerprint != state.get("data_fingerprint", data_fingerprint):
        log.warning("the training prompts differ from the ones %s was trained on (files or their settings changed): "
                    "continuing at position %d of the new prompt order", path, state["data_position"])
    for role in ("actor", "critic"):
        if role in w.roles:
            w.roles[role].load_checkpoint(str(path))
    w.roles["actor"].sync_rollout_weights()
    dropped = ckpt.rewind_step_log(root, state["step"])
    log.info("resumed from %s (step %d); %d logged step(s) after it will be redone", path, state["step"], dropped)
    return int(state["step"]), int(state["data_position"])


@dataclass
class RunSummary:
    steps_done: int
    start_step: int
    eval_before: float | None
    eval_after: float | None
    seconds: float
    mean_throughput: float
    records: list[dict[str, Any]]


def fit(
    job: RLHFJob,
    w: Workers,
    task: Task,
    metrics: JobMetrics,
    progress: Callable[[str], None] = print,
) -> RunSummary:
    s = job.spec
    root = Path(s.trainer.checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    start_step, position = restore(w, root, task.data_fingerprint) if s.trainer.resume == "auto" else (0, 0)
    stream = PromptStream(task.train, s.trainer.prompts_per_step, s.data.seed, position)
    metrics.total_steps.labels(metrics.job).set(s.trainer.steps)
    metrics.devices.labels(metrics.job).set(w.devices)
    metrics.parameters.labels(metrics.job).set(w.roles["actor"].num_parameters())
    metrics.step.labels(metrics.job).set(start_step)
    metrics.checkpoint_step.labels(metrics.job).set(start_step)  # 0: none yet

    eval_before = None
    if s.trainer.eval and start_step == 0:
        eval_before = evaluate(w, task, task.eval)
        metrics.eval_reward.labels(metrics.job, "before").set(eval_before)
        progress(f"held-out reward before training: {eval_before:.3f} ({len(task.eval)} prompts, greedy)")
    t_start = time.perf_counter()
    records = []
    for step in range(start_step + 1, s.trainer.steps + 1):
        t0 = time.perf_counter()
        prompts = prompt_batch(stream.next_batch(), uid_offset=step * s.trainer.prompts_per_step)
        stats, stages = rlhf_iteration(job, w, task, prompts)
        saved = None
        if (s.trainer.save_freq and step % s.trainer.save_freq == 0) or step == s.trainer.steps:
            c0 = time.perf_counter()
            saved = save(job, w, root, step, stream, task.data_fingerprint)
            stages["checkpoint"] = time.perf_counter() - c0
            metrics.checkpoint_step.labels(metrics.job).set(step)
        it = time.perf_counter() - t0
        done = step - start_step
        eta = (time.perf_counter() - t_start) / done * (s.trainer.steps - step)
        rec = {
            "step": step,
            **stats,
            "iteration_seconds": it,
            "throughput_tokens_per_s": stats["tokens"] / it,
            "throughput_per_device": stats["tokens"] / it / w.devices,
            "generation_tokens_per_s": stats["response_tokens"] / max(stages["generate"], 1e-9),
            "eta_seconds": eta,
            "stages": stages,
            "checkpoint": str(saved) if saved else None,
            "time": time.time(),
        }
        ckpt.append_step_log(root, rec)
        metrics.record_step(rec, stages)
        records.append(rec)
        progress(progress_line(rec, s.trainer.steps))
    eval_after = None
    if s.trainer.eval:
        eval_after = evaluate(w, task, task.eval)
        metrics.eval_reward.labels(metrics.job, "after").set(eval_after)
        progress(f"held-out reward after training: {eval_after:.3f}")
    secs = time.perf_counter() - t_start
    tput = float(np.mean([r["throughput_tokens_per_s"] for r in records])) if records else 0.0
    return RunSummary(len(records), start_step, eval_before, eval_after, secs, tput, records)


def progress_line(rec: dict[str, Any], total: int) -> str:
    st = rec["stages"]
    eta = rec["eta_seconds"]
    parts = [
        f"step {rec['step']}/{total}",
        f"reward {rec['reward_mean']:.3f}",
        f"{rec['throughput_tokens_per_s']:.0f} tok/s",
        f"gen {st.get('generate', 0):.2f}s",
        f"train {st.get('actor_update', 0) + st.get('critic_update', 0):.2f}s",
        f"reshard {st.get('reshard', 0):.2f}s",
        f"ETA {int(eta // 60)}m{int(eta % 60):02d}s" if math.isfinite(eta) else "ETA ?",
    ]
    if rec.get("checkpoint"):
        parts.append("saved")
    return " | ".join(parts)
