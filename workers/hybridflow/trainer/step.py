"""The controller's operations for one RLHF iteration, as the algorithms' dataflow programs call them.

`compute` launches every requested stage at once: stages whose roles live on different resource pools run
concurrently, stages colocated on one pool take turns (one process per device hosts them). Each stage's seconds are
measured from when its pool could start it to when it finished, so overlap shows as an iteration shorter than the
sum of its stages.
"""
from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from hybridflow.algorithms.base import ALGORITHMS
from hybridflow.algorithms.core import overlong_penalty, token_rewards, trained_batch_stats
from hybridflow.algorithms.dataflow import Carried
from hybridflow.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS
from hybridflow.data.packing import response_lengths
from hybridflow.flops import pooled_mfu
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.worker_group import PendingResult, RoleHandle, resolve, stuck, wait_done
from hybridflow.roles.config import old_log_probs_from_update
from hybridflow.roles.stages import STAGES, optional_stages, remote_stages
from hybridflow.trainer.episodes import episode_failures, episode_stats
from hybridflow.trainer.generation.rollouts import Rollouts
from hybridflow.trainer.rows import dp_divisor, fitted, is_padding, padded, prompt_groups
from hybridflow.profiling import PROFILE, rank_means
from hybridflow.api import JobSpec

# stage -> (role, worker method), and the stages skipped without their role: derived from the registry
REMOTE_STAGES = remote_stages()
OPTIONAL_STAGES = optional_stages()


@dataclass
class StageClock:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.add(stage, time.perf_counter() - t0)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


def stage_seconds(launched: list[tuple[str, str]], done_at: dict[str, float], t0: float) -> dict[str, float]:
    """Each remote stage's seconds from (stage, pool) in launch order and when each one's last result came: a
    stage's time starts when its pool was free, i.e. at launch or when the pool's previous stage ended. Stages of
    one pool can finish out of launch order (their rows sit on different ranks, a busy machine reorders them):
    such a stage took no time of its own, never negative time."""
    seconds: dict[str, float] = {}
    free_at: dict[str, float] = {}
    for stage, pool in launched:
        start = free_at.get(pool, t0)
        seconds[stage] = max(0.0, done_at[stage] - start)
        free_at[pool] = max(start, done_at[stage])
    return seconds


@dataclass
class AlgorithmState:
    """What an algorithm carries from step to step (saved in checkpoints): the KL coefficient, and whatever the
    algorithm makes for itself (`Algorithm.carried`: safe_rlhf's multiplier), each under its own name."""

    kl: Any
    carried: Mapping[str, Carried]

    @classmethod
    def for_spec(cls, spec: JobSpec) -> "AlgorithmState":
        a = spec.algorithm
        return cls(KL_CONTROLLERS[a.kl_controller](a.kl_coef, a.target_kl, a.kl_horizon),
                   ALGORITHMS[a.name].carried(a))

    def state(self) -> dict[str, Any]:
        return {"kl": self.kl.state(), **{name: c.state() for name, c in self.carried.items()}}

    def load(self, state: dict[str, Any]) -> None:
        if state:
            self.kl.load(state["kl"])
            for name, c in self.carried.items():
                if name in state:  # a checkpoint of another algorithm carries none of this one's state
                    c.load(state[name])


Scorer = Callable[[Batch], "tuple[torch.Tensor, dict[str, float]]"]


def skipped_stages(spec: JobSpec) -> frozenset[str]:
    """The stages a job's programs name that its Step leaves out. On-policy updates take old log-probs from their
    own forward pass (roles.config): the separate stage is skipped. Not when generation runs apart from training:
    the batch is older than the policy, the trainer's own old log-probs are the proximal policy the corrections
    compare the rollout's with."""
    on_policy = old_log_probs_from_update(spec.training, spec.algorithm, spec.trainer.prompts_per_step)
    return frozenset({"old_log_prob"}) if spec.rollout.mode == "sync" and on_policy else frozenset()


class Step:
    """One iteration: the program calls these in the order of its algorithm; stats and stage times accumulate."""

    def __init__(self, spec: JobSpec, roles: Mapping[str, RoleHandle[Any]], pools: dict[str, str],
                 scorers: dict[str, Scorer], state: AlgorithmState, rollouts: Rollouts,
                 skipped: frozenset[str]) -> None:
        self.spec, self.algo = spec, spec.algorithm
        self.roles, self.pools, self.scorers, self.state = roles, pools, scorers, state
        self.rollouts = rollouts  # where generations come from (spec.rollout.mode) and how weights reach them
        self.skipped = skipped  # the stages the program names that this job leaves out (`skipped_stages`)
        self.begin()

    def begin(self, profiled: bool = False) -> None:
        """A new iteration: built once, a Step is begun afresh for each (its clock, statistics, trained batch and
        episode failures are the iteration's own). `profiled`: the roles profile their generation and update
        (hybridflow.profiling), told through the batches' meta."""
        self.profiled = profiled
        self.clock = StageClock()
        self.stats: dict[str, float] = {}
        self.trained: Batch | None = None
        self.failures = episode_failures(self.spec.rollout.agent)  # its episodes' failures, bounded (trainer.episodes)
        self._generating: list[threading.Thread] = []  # clocks of generations still running

    @property
    def responses_per_prompt(self) -> int:
        return self.spec.rollout.responses_per_prompt

    @property
    def prompts_per_step(self) -> int:
        return self.spec.trainer.prompts_per_step

    @property
    def max_sampling_rounds(self) -> int:
        return int(self.algo.max_sampling_rounds or 1)

    def carried(self, name: str) -> Any:
        return self.state.carried[name]

    def next_prompts(self) -> Batch:
        return self.rollouts.next_prompts()

    # -- generation ----------------------------------------------------------------------------------------------

    def generate(self, prompts: Batch, greedy_baseline: bool = False) -> Any:
        """responsesPerPrompt samples per prompt (groups adjacent); with greedy_baseline also one greedy response
        per prompt from the same engine call, returned apart: (sampled, greedy). Pending results, like every
        stage's: the rollout role's futures go on to the next stage without the controller fetching them."""
        n = self.responses_per_prompt
        t0 = time.perf_counter()
        prompts.meta[PROFILE] = self.profiled  # what was generated ahead (the async modes) was not profiled
        out = self.rollouts.generate(prompts, functools.partial(generation_rows, n=n, greedy_baseline=greedy_baseline))
        if self.spec.rollout.agent is not None and self.spec.rollout.agent.program is not None:  # rows per episode vary
            out = fitted(out, dp_divisor(self.roles), (n + 1) * len(prompts) if greedy_baseline else None)
        if isinstance(out, PendingResult):
            self._clock_generation(out, t0)
        else:  # generated before it was asked for (async): the trainer's wait is the stage's time
            self.clock.add("generate", float(out.meta.get("generate_seconds", 0.0)))
        if not greedy_baseline:
            return out
        k = n * len(prompts)
        both = functools.cache(lambda: resolve(out))  # one fetch for the two parts
        named = (out.method, out.where, out.timeout_s)
        return (PendingResult(out.refs, lambda _: both().index(slice(0, k)), None, *named),
                PendingResult(out.refs, lambda _: both().index(slice(k, None)), None, *named))

    def _clock_generation(self, pending: PendingResult, t0: float) -> None:
        """Generation's seconds, from its launch to its last rank's result, taken by a thread while the program
        goes on: the same seconds the controller measured when it waited for generation itself."""
        clock = self.clock  # this iteration's, whenever the thread ends (a Step is begun afresh for each)

        def wait() -> None:
            try:
                wait_done(pending)
            except Exception:  # noqa: BLE001 - a lost or stuck rank: the program's own fetch of the result raises it
                return
            clock.add("generate", time.perf_counter() - t0)

        waiter = threading.Thread(target=wait, name="generate-clock", daemon=True)
        waiter.start()
        self._generating.append(waiter)

    def _generated(self) -> None:
        """Every generation launched has finished and is on the clock. The stages after it wait for this before
        their own clocks start: they would queue behind generation on its devices, and generation's time is its
        own stage's, not theirs."""
        t0 = time.perf_counter()
        for waiter in self._generating:
            waiter.join()
        if self._generating:  # the trainer waited for generation (idle, when rollout has devices of its own)
            self.stats["trainer_wait_seconds"] = self.stats.get("trainer_wait_seconds", 0.0) + time.perf_counter() - t0
        self._generating.clear()

    # -- stages --------------------------------------------------------------------------------------------------

    def compute(self, batch: Any, *stages: str) -> Batch:
        """Run `stages` on `batch` and return it with their columns; remote stages all start before any is waited
        for, and rule rewards are scored on the controller meanwhile."""
        self._generated()
        launched: dict[str, PendingResult] = {}
        t0 = time.perf_counter()
        for stage in stages:
            st = STAGES[stage]
            if stage in self.skipped:
                continue
            if st.role in self.roles:
                launched[stage] = st.run(self.roles[st.role], batch)
            elif not st.optional and stage not in self.scorers:
                raise RuntimeError(f"stage '{stage}' needs the '{st.role}' role, which this job did not create")
        with ThreadPoolExecutor(1) as waiter:  # remote stages are timed while the controller scores locally
            remote_seconds = waiter.submit(self._wait_stages, launched, t0)
            data = resolve(batch)
            if self.failures is not None:  # a generation's first stage: too many failed episodes stop the job
                self.failures.add(data)
            local: dict[str, torch.Tensor] = {}
            for stage in stages:
                if stage not in launched and stage in self.scorers:
                    with self.clock(stage):
                        local[stage], stats = self.scorers[stage](data)
                    self.stats.update(stats)
            for stage, seconds in remote_seconds.result().items():
                self.clock.add(stage, seconds)
        for stage, pending in launched.items():
            out, scores = resolve(pending), STAGES[stage].scores
            if scores is not None:  # a reward or cost model's scores: set apart, like a rule's
                local[stage] = out[scores]
            else:
                data = data.union(out)
        if "reward" in local:
            scores = local["reward"]
            if self.algo.overlong_buffer:
                lengths = response_lengths(data)
                scores = scores + overlong_penalty(lengths, self.spec.rollout.max_response_length,
                                                   self.algo.overlong_buffer, self.algo.overlong_penalty)
            data = data.with_columns(scores=scores.float())
        if "cost" in local:
            data = data.with_columns(costs=local["cost"].float())
        return data

    def _wait_stages(self, launched: dict[str, PendingResult], t0: float) -> dict[str, float]:
        """Seconds of each stage: from when its pool was free (launch, or the end of the stage launched before it
        on the same pool) to its last result."""
        import ray

        pending = {s: set(p.refs) for s, p in launched.items()}
        done_at: dict[str, float] = {}
        while pending:
            refs = [r for rs in pending.values() for r in rs]
            waiting = [launched[s] for s in pending]
            timeout = max((p.timeout_s for p in waiting if p.timeout_s), default=None)
            ready, _ = ray.wait(refs, num_returns=1, fetch_local=False, timeout=timeout)
            if not ready:  # nothing answered within the calls' timeout: a rank is stuck
                raise stuck(waiting[0])
            now = time.perf_counter()
            for stage in list(pending):
                pending[stage] -= set(ready)
                if not pending[stage]:
                    done_at[stage] = now
                    del pending[stage]
        return stage_seconds([(s, self.pools[STAGES[s].role]) for s in launched], done_at, t0)

    # -- advantages ----------------------------------------------------------------------------------------------

    def advantages(self, batch: Batch, scores: str = "scores", values: str = "values", kl_weight: float = 1.0,
                   baseline: torch.Tensor | None = None, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) by the configured estimator, from per-token rewards: the score on the last token,
        minus kl_weight * coef * KL on every token when KL is in the reward."""
        a = self.algo
        with self.clock("advantages"):
            mask = batch["response_mask"]
            kl = self._kl(batch)
            coef = kl_weight * self.state.kl.value if a.kl_in == "reward" else 0.0
            # an environment's per-turn rewards, on their turns, where the score holds them (costs never do)
            agent = self.spec.rollout.agent
            in_scores = agent is not None and agent.episode_score != "reward" and "env_turn_rewards" in batch
            placed = batch["env_turn_rewards"] if scores == "scores" and in_scores else None
            inputs = AdvantageInputs(
                token_rewards(batch[scores], mask, kl, coef, placed), mask,
                torch.as_tensor(batch["uid"].astype(np.int64)),
                batch[values] if values in batch else None, baseline, a.gamma, a.lam, bool(a.norm_adv_by_std), whiten)
            return ADVANTAGE_ESTIMATORS[a.advantage_estimator or ""](inputs)

    def _kl(self, batch: Batch) -> torch.Tensor | None:
        if "ref_log_probs" not in batch or "old_log_probs" not in batch:  # on-policy: the update reports kl_mean
            return None
        return KL_ESTIMATORS[self.algo.kl_estimator](batch["old_log_probs"], batch["ref_log_probs"])

    # -- dynamic sampling (DAPO) ---------------------------------------------------------------------------------

    def groups_with_varied_scores(self, batch: Batch) -> list[Batch]:
        """The batch's groups (responses to one prompt) whose scores are not all equal."""
        groups = prompt_groups(batch)  # each prompt's rows (an agent program's episode may be several)
        kept = [g for g in groups if _varied(g)]
        self.stats["sampled_groups"] = self.stats.get("sampled_groups", 0.0) + len(groups)
        self.stats["kept_groups"] = self.stats.get("kept_groups", 0.0) + len(kept)
        return kept

    def fill_batch(self, groups: list[Batch], spare: Batch) -> Batch:
        """promptsPerStep groups: the informative ones first; if the last round left it short, the last round's
        uniform groups (zero advantage: they keep the batch its size and teach nothing)."""
        need = self.prompts_per_step
        uniform = [g for g in prompt_groups(spare) if not _varied(g)]
        self.stats["filler_groups"] = float(max(0, need - len(groups)))
        return padded(Batch.concat((groups + uniform)[:need]), dp_divisor(self.roles))

    # -- updates -------------------------------------------------------------------------------------------------

    def update_critic(self, batch: Batch, role: str = "critic") -> None:
        self._generated()
        with self.clock(f"{role}_update"):
            self.stats.update(mean_stats(self.roles[role].update_critic(batch), f"{role}_"))

    def update_actor(self, batch: Batch) -> None:
        batch.meta["kl_coef"] = self.state.kl.value
        batch.meta[PROFILE] = self.profiled
        self._generated()
        self.rollouts.trained(batch)
        with self.clock("actor_update"):
            self.stats.update(mean_stats(self.roles["actor"].update_actor(batch), ""))
        self.trained = batch

    def sync_weights(self) -> None:
        """Train -> generate (the 3D-HybridEngine transition, or FSDP's whole-tensor gather): the rollout role
        takes the actor's new weights through the bridge."""
        self._generated()
        with self.clock("reshard"):
            self.stats.update(self.rollouts.sync())

    # -- after the program ---------------------------------------------------------------------------------------

    def summary(self) -> dict[str, float]:
        """The step's statistics over the batch the actor trained on; updates the KL controller."""
        self._generated()  # the stage times read with the summary include every generation's
        batch = self.trained
        if batch is None:
            raise RuntimeError(f"the {self.algo.name} program never called update_actor")
        kl = self._kl(batch)
        told: dict[str, float] = {}  # what the carried state, the rollouts and the episodes say of the step
        for carried in self.state.carried.values():
            told.update(carried.metrics())
        told.update(self.rollouts.step_stats())
        told.update(episode_stats(batch))
        if self.failures is not None:
            self.failures.report()  # one console line for a step whose episodes failed
        # an on-policy update already put entropy, KL and the rollout gap in self.stats; the batch's own say more,
        # and what was told above has the last word; kl_coef is the coefficient this step trained with
        real = ~is_padding(batch)  # the rows added to divide among the ranks: no sample, no reward, no tokens trained
        out = {**self.stats, "kl_coef": float(self.state.kl.value),
               **trained_batch_stats(batch.index(real).tensors, None if kl is None else kl[torch.as_tensor(real)])}
        if "kl_mean" in out:
            self.state.kl.update(out["kl_mean"], int(real.sum()))
        return {**out, **told}


def generation_rows(prompts: Batch, n: int, greedy_baseline: bool = False) -> Batch:
    """What generation gets for a step's prompts: each prompt n times (groups adjacent, sampled), and with
    greedy_baseline one more greedy row per prompt after them."""
    batch = prompts.repeat(n)
    batch.non_tensors["greedy"] = np.zeros(len(batch), dtype=bool)
    if greedy_baseline:
        greedy = prompts.with_columns()
        greedy.non_tensors["greedy"] = np.ones(len(prompts), dtype=bool)
        batch = Batch.concat([batch, greedy])
    return batch


def _varied(group: Batch) -> bool:
    return float(group["scores"].max() - group["scores"].min()) > 1e-6


def run_program(spec: JobSpec, step: Step, prompts: Batch) -> tuple[dict[str, float], dict[str, float]]:
    """One iteration of the algorithm's program on `prompts`: (statistics, seconds per stage)."""
    ALGORITHMS[spec.algorithm.name].program(step, prompts)
    return step.summary(), step.clock.seconds


# Per-token columns the rollout log carries where the trained batch has them, besides the advantages.
ROLLOUT_TOKEN_COLUMNS = ("old_log_probs", "ref_log_probs", "rollout_log_probs", "values", "returns", "cost_values",
                         "cost_returns")


def rollout_records(batch: Batch, decode: Callable[[list[int]], str] | None = None) -> list[dict[str, Any]]:
    """The batch the actor trained on (`Step.trained`), one JSON-able record per sample in the batch's order
    (trainer.rolloutLog): its group uid, prompt and response token ids, reward (and cost), and its per-token columns
    over its response tokens; with `decode` (a task with a tokenizer) also the prompt and response text. Reads the
    batch only."""
    from hybridflow.data.packing import unpack_prompts, unpack_responses, unpack_trajectories

    keep = ~is_padding(batch)  # the rows added to divide among the ranks are no sample
    ages = [a for a, k in zip(batch.meta.get("staleness", ()), keep) if k]  # per row, as the batch was
    batch = batch.index(keep)
    prompts, responses = unpack_prompts(batch), unpack_responses(batch)
    multi_turn = "agent_turns" in batch
    trajectories = unpack_trajectories(batch) if multi_turn else None
    real = batch["response_mask"].bool()  # the response's own tokens, as unpack_responses takes them
    columns = [c for c in ("advantages", *ROLLOUT_TOKEN_COLUMNS) if c in batch.tensors]
    scores = batch["scores"].tolist() if "scores" in batch else None
    costs = batch["costs"].tolist() if "costs" in batch else None
    out = []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        rec: dict[str, Any] = {"uid": _plain(batch["uid"][i]) if "uid" in batch else None, "prompt_ids": prompt,
                               "response_ids": response}
        if decode is not None:
            rec.update(prompt=decode(prompt), response=decode(response))
        if trajectories is not None:  # every token after the prompt, the answers of tools included, and which
            n = len(trajectories[i])    # are the model's (loss mask 1)
            rec.update(trajectory_ids=trajectories[i], loss_mask=batch["response_mask"][i][:n].tolist(),
                       turns=int(batch["agent_turns"][i]), tool_calls=int(batch["agent_tool_calls"][i]),
                       env_reward=float(batch["env_reward"][i]))
            if decode is not None:
                rec["trajectory"] = decode(trajectories[i])
        if scores is not None:
            rec["score"] = scores[i]
        if costs is not None:
            rec["cost"] = costs[i]
        rec.update({c: batch[c][i][real[i]].float().tolist() for c in columns})
        if "token_versions" in batch:  # the policy version of each response token, and how stale it was trained
            rec["token_versions"] = batch["token_versions"][i][real[i]].tolist()
        if "staleness" in batch.meta:
            rec.update(trainer_version=batch.meta["trainer_version"], staleness=ages[i])
        out.append(rec)
    return out


def _plain(x: Any) -> Any:
    """A numpy scalar as the Python value JSON takes."""
    return x.item() if isinstance(x, np.generic) else x


def mean_stats(per_rank: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Each statistic's mean over the ranks that report it (a profile may be missing where a rank's profiler could
    not run), memory peaks' max and sum; the MFU pooled, not the ranks' ratios' mean (flops.pooled_mfu)."""
    keys = dict.fromkeys(k for r in per_rank for k in r)
    out = {f"{prefix}{k}": v for k, v in rank_means(per_rank).items()}
    if (mfu := pooled_mfu(per_rank)) is not None:
        out[f"{prefix}mfu"] = mfu
    if "peak_memory_bytes" in keys:
        out[f"{prefix or 'actor_'}peak_memory_bytes"] = float(max(r["peak_memory_bytes"] for r in per_rank))
        out[f"{prefix or 'actor_'}peak_memory_bytes_total"] = float(sum(r["peak_memory_bytes"] for r in per_rank))
    if "log_prob_peak_memory_bytes" in keys:  # the log-prob pass's own peak (roles.common.memory_phase)
        out[f"{prefix or 'actor_'}log_prob_peak_memory_bytes"] = float(max(r["log_prob_peak_memory_bytes"]
                                                                           for r in per_rank))
    return out

