"""Prometheus metrics of one RLHF job, served by the driver. Base units in names; bounded label sets only
(stage and role come from fixed lists); the job's name is the `rlhfjob` label, never `job` (Prometheus owns it)."""
from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from hybridflow.api.names import SANDBOX_MISSING_METRIC

STAGES = (
    "generate", "old_log_prob", "reference", "values", "cost_values", "reward", "cost", "advantages",
    "critic_update", "cost_critic_update", "actor_update", "reshard", "checkpoint",
)  # fmt: skip

# Step statistics exported as gauges: metric name suffix -> key in the step record.
STEP_GAUGES = {
    "reshard_received_bytes": ("reshard_bytes", "Bytes a rank received in the last train->generate transition (mean)."),
    "reshard_peak_bytes": ("reshard_peak_bytes", "Largest transient buffer of the last transition (max over ranks)."),
    "generation_weight_bytes": ("generation_weight_bytes", "Generation weights a rank holds after the transition (max)."),
    "rollout_sleep_freed_bytes": ("rollout_sleep_freed_bytes", "Memory the generation engine beside the actor freed "
                                  "before the update (vLLM on GPU: sleep; max over ranks)."),
    "rollout_wake_bytes": ("rollout_wake_bytes", "Memory the generation engine took back in the transition (vLLM "
                           "on GPU: wake; max over ranks)."),
    "actor_log_prob_peak_memory_bytes": ("actor_log_prob_peak_memory_bytes", "Peak memory of the actor's log-prob "
                                         "pass alone (max over ranks)."),
    "reward_mean": ("reward_mean", "Mean sequence reward of the step's responses."),
    "response_length_tokens_mean": ("response_length_mean", "Mean response length in tokens."),
    "kl_mean": ("kl_mean", "Mean per-token KL(actor || reference) estimate."),
    "entropy_mean": ("entropy_mean", "Mean per-token entropy of the actor on its samples (those its update computed, "
                     "where the update gives the old log-probs)."),
    "update_rows_skipped": ("update_rows_skipped", "Share of the actor's rows whose advantages were all zero, left "
                            "out of its update (training.skipZeroAdvantageRows)."),
    "clip_fraction": ("clip_frac", "Fraction of tokens where the PPO ratio was clipped."),
    "grad_norm": ("grad_norm", "Actor gradient norm before clipping."),
    "kl_coefficient": ("kl_coef", "KL coefficient in use (moves with klController adaptive)."),
    "rollout_log_prob_gap": ("rollout_log_prob_gap", "Mean |log pi_train - log pi_rollout| per token: how far the "
                             "generation engine's sampler is from the trainer's forward pass."),
    # With spec.algorithm.offPolicyCorrection (or tisCap): pi_prox / pi_behaviour over response tokens, per update.
    "is_ratio_mean": ("is_ratio_mean", "Mean importance ratio pi_old / pi_rollout over response tokens."),
    "is_ratio_std": ("is_ratio_std", "Standard deviation of the importance ratio over response tokens."),
    "is_ratio_max": ("is_ratio_max", "Largest importance ratio (mean over micro-batches and ranks of each one's)."),
    "is_ratio_min": ("is_ratio_min", "Smallest importance ratio (mean over micro-batches and ranks of each one's)."),
    "is_masked_fraction": ("is_masked_fraction", "Fraction of response tokens whose loss the off-policy correction "
                           "dropped (masked_is; decoupled with a cap)."),
    # A rollout pool of its own (spec.placement.rollout; spec.rollout.mode one_step_off / async):
    "trajectory_queue_depth": ("queue_depth", "async: finished prompt groups waiting in the trajectory queue."),
    "trainer_idle_ratio": ("trainer_idle_fraction", "Fraction of the last step the trainer waited for generation."),
    "rollout_idle_ratio": ("rollout_idle_fraction", "Fraction of the last step the rollout pool did not generate."),
    "weight_sync_seconds": ("weight_sync_seconds", "Seconds of the last cross-pool weight sync (slowest rank)."),
    "weight_sync_bytes": ("weight_sync_bytes", "Bytes the last cross-pool weight sync delivered (all rollout ranks)."),
    "rollout_policy_version": ("rollout_policy_version", "Policy version the rollout replicas hold (updates synced)."),
    "staleness_max": ("staleness_max", "Most policy versions a trained trajectory of the last step was behind."),
    "rollout_replicas_working": ("rollout_replicas_working", "async: rollout replicas taking work (a lost one is "
                                 "rebuilt alone and takes work again once it holds the current weights)."),
    "rollout_replicas_replaced": ("rollout_replicas_replaced_total", "async: rollout replicas lost and rebuilt alone "
                                  "since the driver started."),
    "replica_recovery_seconds": ("replica_recovery_seconds", "Seconds from a rollout replica's loss until its "
                                 "rebuilt replacement took work (set at the step it joined)."),
    "rollout_replicas": ("rollout_replicas", "async: rollout replicas the pool holds (working, joining, being "
                         "rebuilt); an elastic pool's follows spec.rolloutPool.replicas."),
    "rollout_replicas_added": ("rollout_replicas_added_total", "async: rollout replicas built for pods added to the "
                               "pool since the driver started (an elastic pool scaled up, a pod back after one left)."),
    "rollout_replicas_left": ("rollout_replicas_left_total", "async: rollout replicas whose pods left the pool given "
                              "notice (scale-down, eviction, drain), each after the call it was in."),
    "replica_join_seconds": ("replica_join_seconds", "Seconds from a pod joining the rollout pool until its replica "
                             "took work (set at the step it joined)."),
    # A generative judge (spec.models.reward.judge), over the last step's batch:
    "judge_requests": ("judge_requests", "Questions the judge answered (after its cache and de-duplication)."),
    "judge_cache_hits": ("judge_cache_hits", "Responses scored from the judge's cache of earlier verdicts."),
    "judge_parse_failures": ("judge_parse_failures", "Judge answers its parser could not read (scored errorScore)."),
    "judge_seconds": ("judge_seconds", "Seconds the judge's engine call took (its latency per step)."),
    "judge_tokens_per_s": ("judge_tokens_per_s", "The judge's answer tokens per second."),
    "judge_rule_agreement": ("judge_rule_agreement", "Share of responses on which the judge and the task's rule give "
                             "the same verdict (pass: score >= 0.5)."),
    # Multi-turn rollouts (spec.rollout.agent), over the trained batch's episodes:
    "agent_turns_mean": ("agent_turns_mean", "Model turns per episode (mean)."),
    "agent_tool_calls_mean": ("agent_tool_calls_mean", "Tool calls per episode (mean)."),
    "agent_tool_call_ratio": ("agent_tool_call_rate", "Fraction of episodes that called a tool."),
    "agent_tool_error_ratio": ("agent_tool_error_rate", "Fraction of tool calls that failed (raised, unreadable, "
                               "a sandbox limit)."),
    "agent_tool_deadline_exceeded_ratio": ("agent_tool_timeout_rate", "Fraction of tool calls past their deadline."),
    "agent_tool_seconds": ("agent_tool_seconds", "Seconds the last step's tool calls took, summed."),
    "agent_environment_reward_mean": ("agent_env_reward_mean", "Environment reward per episode (its steps summed)."),
    "agent_episodes_failed": ("agent_episodes_failed", "Episodes of the last step that ended on an environment "
                              "error (reported with their sample)."),
    "agent_episodes_failed_infrastructure": ("agent_episodes_failed_infrastructure", "Of those, episodes the sandbox "
                                             "pool failed (a replica lost, no sandbox, an HTTP error): not counted "
                                             "against maxFailedFraction."),
    "agent_episodes_retried": ("agent_episodes_retried", "Episodes of the last step started again after their "
                               "environment replica was lost."),
    "agent_environment_requests": ("agent_environment_requests", "Requests the last step sent to the environment "
                                   "pool (spec.environments), all replicas."),
    "cost_mean": ("cost_mean", "safe_rlhf: mean cost of the step's responses."),
    "lagrange_multiplier": ("lagrange_multiplier", "safe_rlhf: the Lagrangian multiplier weighing the cost."),
    "kept_groups": ("kept_groups", "dapo: groups with differing rewards found this step (dynamic sampling)."),
    "actor_update_flops_per_second": ("update_flops_per_s", "Actor update FLOP/s per rank (6 x parameters x tokens "
                                      "/ update seconds), mean over ranks."),
    "checkpoint_size_bytes": ("checkpoint_bytes", "Bytes of the last checkpoint sealed (every role's files); the "
                              "seconds training waited for it are the `checkpoint` stage."),
    "checkpoint_write_seconds": ("checkpoint_write_seconds", "Seconds from the start of the last sealed checkpoint's "
                                 "save to its seal (with trainer.asyncSave, mostly overlapped with training)."),
    "recovery_seconds": ("recovery_seconds", "Seconds from losing a worker to the next step logged, of the last "
                         "in-place recovery (runPolicy.restartPolicy failedPod)."),
    "last_iteration_seconds": ("iteration_seconds", "Wall time of the last RLHF iteration (what the operator's "
                               "default progress deadline scales with)."),
    "actor_update_mfu": ("mfu", "Actor update FLOP/s over the matmul peak the ranks measured in the compute dtype "
                         "(model FLOPs utilisation): the FLOP/s of every data-parallel replica over the peaks of all its ranks, summed."),
}


EVAL_REWARD = "hybridflow_eval_reward_mean"  # labelled phase=before|after


class JobMetrics:
    def __init__(self, job_name: str, registry: CollectorRegistry | None = None, primed: bool = True) -> None:
        """`primed`: the counters the dashboards rate() start at 0 before their first event (the served endpoint);
        off for step_scalars, which must hold only what one step set."""
        self.registry = registry or CollectorRegistry()
        r, lbl = self.registry, ["rlhfjob"]
        self.job = job_name
        self.step = Gauge("hybridflow_step", "Last completed RLHF iteration.", lbl, registry=r)
        self.total_steps = Gauge("hybridflow_steps_target", "Iterations requested.", lbl, registry=r)
        self.tokens = Counter("hybridflow_tokens", "Prompt + response tokens processed.", lbl, registry=r)
        self.throughput = Gauge(
            "hybridflow_throughput_tokens_per_second",
            "Prompt + response tokens of the global batch / iteration time (HybridFlow's throughput).", lbl, registry=r,
        )
        self.throughput_per_device = Gauge(
            "hybridflow_throughput_per_device_tokens_per_second", "Throughput divided by devices in use.", lbl,
            registry=r,
        )
        self.generation_throughput = Gauge(
            "hybridflow_generation_tokens_per_second", "Response tokens / generation stage time.", lbl, registry=r
        )
        self.iteration = Histogram(
            "hybridflow_iteration_duration_seconds", "Wall time of one RLHF iteration.", lbl, registry=r,
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
        )
        self.stage = Gauge("hybridflow_stage_duration_seconds", "Seconds of the last iteration per stage.",
                           [*lbl, "stage"], registry=r)
        self.stage_total = Counter("hybridflow_stage_seconds", "Cumulative seconds per stage.", [*lbl, "stage"],
                                   registry=r)
        self.peak_memory = Gauge("hybridflow_peak_memory_bytes", "Peak memory of a role's processes (max over ranks).",
                                 [*lbl, "role"], registry=r)
        self.eval_reward = Gauge(EVAL_REWARD, "Mean reward on held-out prompts (greedy).",
                                 [*lbl, "phase"], registry=r)
        self.checkpoint_step = Gauge("hybridflow_last_checkpoint_step", "Step of the newest checkpoint.", lbl,
                                     registry=r)
        self.eta = Gauge("hybridflow_eta_seconds", "Estimated seconds to the last step.", lbl, registry=r)
        self.devices = Gauge("hybridflow_devices", "Devices (ranks) the job's worker groups use.", lbl, registry=r)
        self.sandbox_missing = Gauge(SANDBOX_MISSING_METRIC, "1 for each layer of the sandbox that the job's sandbox pool "
                                     "runs user code without (spec.sandbox.allowPartial).", [*lbl, "layer"],
                                     registry=r)
        self.parameters = Gauge("hybridflow_model_parameters", "Parameters of the actor model.", lbl, registry=r)
        self.reward_errors = Counter("hybridflow_reward_errors", "Samples whose reward function raised, timed out or "
                                     "returned no score (they score errorScore).", lbl, registry=r)
        self.staleness = Histogram(
            "hybridflow_trajectory_staleness_versions", "Policy versions each trained batch was behind the trainer "
            "(its mean over trajectories; oldest token of each).", lbl, buckets=(0, 1, 2, 3, 4, 6, 8, 16), registry=r)
        self.dropped_stale = Counter("hybridflow_trajectories_dropped_stale", "async: prompt groups dropped for "
                                     "being more than maxStaleness versions old.", lbl, registry=r)
        self.recoveries = Counter("hybridflow_recoveries", "In-place recoveries: the controller rebuilt its worker "
                                  "groups after losing a worker (runPolicy.restartPolicy failedPod).", lbl, registry=r)
        self.gauges = {
            key: Gauge(f"hybridflow_{name}", doc, lbl, registry=r) for name, (key, doc) in STEP_GAUGES.items()
        }
        if primed:
            self.total_steps.labels(self.job)
            self.dropped_stale.labels(self.job)  # 0 until a group is dropped: increase() has a series from the start
            self.recoveries.labels(self.job)

    def serve(self, port: int, address: str) -> int:
        """Start the HTTP exporter; returns the bound port (useful with port 0 in tests)."""
        server, _ = start_http_server(port, addr=address, registry=self.registry)
        return server.server_port

    def scalars(self) -> dict[str, float]:
        """This job's series as the endpoint serves them now, one value each, under their names (another label's
        value after a slash: hybridflow_stage_duration_seconds/generate). A histogram gives its _sum."""
        out = {}
        for metric in self.registry.collect():
            for sample in metric.samples:
                labels = dict(sample.labels)
                if labels.pop("rlhfjob", None) != self.job or sample.name.endswith(("_bucket", "_count", "_created")):
                    continue
                out["/".join([sample.name, *labels.values()])] = float(sample.value)
        return out

    def record_step(self, rec: Mapping[str, float], stages: Mapping[str, float]) -> None:
        j = self.job
        self.step.labels(j).set(rec["step"])
        self.tokens.labels(j).inc(rec["tokens"])
        self.throughput.labels(j).set(rec["throughput_tokens_per_s"])
        self.throughput_per_device.labels(j).set(rec["throughput_per_device"])
        self.generation_throughput.labels(j).set(rec["generation_tokens_per_s"])
        self.iteration.labels(j).observe(rec["iteration_seconds"])
        self.eta.labels(j).set(rec["eta_seconds"])
        if "staleness_mean" in rec:
            self.staleness.labels(j).observe(rec["staleness_mean"])
        if rec.get("dropped_stale"):
            self.dropped_stale.labels(j).inc(rec["dropped_stale"])
        if rec.get("reward_errors"):
            self.reward_errors.labels(j).inc(rec["reward_errors"])
        for stage, secs in stages.items():
            self.stage.labels(j, stage).set(secs)
            self.stage_total.labels(j, stage).inc(max(0.0, secs))  # a counter refuses less; a metric never fails a job
        for key, gauge in self.gauges.items():
            if key in rec:
                gauge.labels(j).set(rec[key])
        for role in ("actor", "critic", "cost_critic"):
            if f"{role}_peak_memory_bytes" in rec:
                self.peak_memory.labels(j, role).set(rec[f"{role}_peak_memory_bytes"])


def step_scalars(job_name: str, rec: Mapping[str, Any]) -> dict[str, float]:
    """What one step record sets on the endpoint, under the endpoint's names: what experiment trackers log at the
    step. Through a registry of its own, so a gauge another step set is not repeated here and a counter gives
    this step's increment (a resumed driver's endpoint starts its counters at 0 again; a step's own do not)."""
    one = JobMetrics(job_name, primed=False)
    one.record_step(rec, rec["stages"])
    return one.scalars()


def eval_scalars(metrics: JobMetrics, phase: str) -> dict[str, float]:
    """The held-out reward `phase` ("before" or "after" training) as the endpoint serves it."""
    return {k: v for k, v in metrics.scalars().items() if k == f"{EVAL_REWARD}/{phase}"}
