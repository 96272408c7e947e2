"""Grafana dashboards as data: each panel is a title, a unit and PromQL. `hybridflow dashboards` writes the JSON the
Helm chart ships (Grafana's sidecar loads it), built with Grafana's foundation SDK; a test runs every expression of
the shipped JSON against a real Prometheus.

Template variables: $namespace and $rlhfjob select a job; $peak_flops_per_device is the accelerator's peak
(bf16 dense FLOP/s, default: H100 SXM) for the MFU estimate.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JOB = '{namespace=~"$namespace", rlhfjob=~"$rlhfjob"}'
OP = '{namespace=~"$namespace"}'


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[str, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat
    stacked: bool = False
    legend: str = ""
    width: int = 8
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    panels: tuple[Panel, ...]
    variables: tuple[str, ...] = ("namespace", "rlhfjob")
    tags: tuple[str, ...] = field(default=("hybridflow",))


JOB_OVERVIEW = Dashboard(
    uid="hybridflow-job",
    title="HybridFlow / RLHF job",
    variables=("namespace", "rlhfjob", "peak_flops_per_device"),
    panels=(
        Panel("Phase", (f'max by (rlhfjob, phase) (hybridflow_operator_job_info{JOB})',), kind="stat",
              legend="{{phase}}", width=4, description="From the operator."),
        Panel("Step", (f"max by (rlhfjob) (hybridflow_step{JOB})", f"max by (rlhfjob) (hybridflow_steps_target{JOB})"),
              kind="stat", width=4, legend="{{rlhfjob}}"),
        Panel("ETA", (f"max by (rlhfjob) (hybridflow_eta_seconds{JOB})",), unit="s", kind="stat", width=4),
        Panel("Restarts", (f"max by (rlhfjob) (hybridflow_operator_job_restarts{JOB})",), kind="stat", width=4),
        Panel("Last checkpoint step", (f"max by (rlhfjob) (hybridflow_last_checkpoint_step{JOB})",), kind="stat",
              width=4),
        Panel("Throughput (tokens/s)", (f"sum by (rlhfjob) (hybridflow_throughput_tokens_per_second{JOB})",),
              unit="short", legend="{{rlhfjob}}", width=12,
              description="(prompt + response tokens of a global batch) / iteration time, as in the paper."),
        Panel("Throughput per device (tokens/s)",
              (f"sum by (rlhfjob) (hybridflow_throughput_per_device_tokens_per_second{JOB})",), legend="{{rlhfjob}}",
              width=12),
        Panel("Seconds per stage", (f"max by (stage) (hybridflow_stage_duration_seconds{JOB})",), unit="s",
              stacked=True, legend="{{stage}}", width=12, description="Last iteration, stacked by stage."),
        Panel("Generation throughput (tokens/s)", (f"sum by (rlhfjob) (hybridflow_generation_tokens_per_second{JOB})",),
              legend="{{rlhfjob}}", width=12),
        Panel("MFU estimate", (
            f"6 * max by (rlhfjob) (hybridflow_model_parameters{JOB}) "
            f"* max by (rlhfjob) (hybridflow_throughput_tokens_per_second{JOB}) "
            f"/ (max by (rlhfjob) (hybridflow_devices{JOB}) * $peak_flops_per_device)",),
              unit="percentunit", legend="{{rlhfjob}}", width=8,
              description="6 x parameters x tokens/s / (devices x peak FLOP/s): a dense-training approximation."),
        Panel("Actor update MFU (measured)", (f"avg by (rlhfjob) (hybridflow_actor_update_mfu{JOB})",),
              unit="percentunit", legend="{{rlhfjob}}", width=8,
              description="The update's 6 x parameters x tokens / seconds over each rank's own matmul peak in the "
                          "compute dtype, measured at start: no data sheet needed, CPUs included."),
        Panel("Peak memory", (f"max by (role) (hybridflow_peak_memory_bytes{JOB})",), unit="bytes",
              legend="{{role}}", width=8),
        Panel("Checkpoint size", (f"max by (rlhfjob) (hybridflow_checkpoint_size_bytes{JOB})",), unit="bytes",
              legend="{{rlhfjob}}", width=8, description="Bytes of the last checkpoint; save seconds are the "
              "checkpoint stage in Seconds per stage."),
        Panel("Reshard (train -> generate) per rank",
              ('max by (__name__) ({__name__=~"hybridflow_(reshard_received|reshard_peak|generation_weight)_bytes", '
               'namespace=~"$namespace", rlhfjob=~"$rlhfjob"})',), unit="bytes", legend="{{__name__}}", width=8,
              description="Received: bytes gathered at the transition. Peak: largest transient buffer. "
                          "Generation weight: what a rank holds to generate (1/t_g of the model under HybridFlow)."),
        Panel("Reward", (f"avg by (rlhfjob) (hybridflow_reward_mean{JOB})",
                         f"max by (rlhfjob, phase) (hybridflow_eval_reward_mean{JOB})"), legend="{{rlhfjob}} {{phase}}",
              width=8),
        Panel("KL to reference and its coefficient", (f"avg by (rlhfjob) (hybridflow_kl_mean{JOB})",
                                                      f"avg by (rlhfjob) (hybridflow_kl_coefficient{JOB})"), width=8,
              description="The coefficient moves only with klController adaptive."),
        Panel("Trainer vs rollout log-prob gap", (f"avg by (rlhfjob) (hybridflow_rollout_log_prob_gap{JOB})",),
              width=8, description="With any algorithm.offPolicyCorrection (or tisCap): mean |log pi_train - "
                                   "log pi_rollout| per token; on the same weights near 0 unless the generation "
                                   "engine samples from a different distribution than the trainer computes, and "
                                   "larger as rollout runs older weights (asynchronous modes)."),
        Panel("Importance ratio pi_old / pi_rollout", (
            'avg by (__name__) ({__name__=~"hybridflow_is_(ratio_(mean|std|min|max)|masked_fraction)", '
            'namespace=~"$namespace", rlhfjob=~"$rlhfjob"})',), legend="{{__name__}}", width=8,
              description="With an off-policy correction: the ratio's mean, min, max and std over response tokens "
                          "(min and max: per micro-batch, averaged), and the fraction of tokens the correction "
                          "dropped (masked_is, decoupled with a cap)."),
        Panel("Trajectory staleness (policy versions)", (
            f"histogram_quantile(0.9, sum by (le, rlhfjob) (rate(hybridflow_trajectory_staleness_versions_bucket{JOB}[5m])))",
            f"max by (rlhfjob) (hybridflow_staleness_max{JOB})"), legend="{{rlhfjob}}", width=8,
              description="Rollout on a pool of its own: how many policy versions trained trajectories were behind "
                          "the trainer (p90 of each batch's mean; the last step's max). one_step_off: 1; async: at "
                          "most rollout.maxStaleness."),
        Panel("Trajectory queue and stale drops", (
            f"max by (rlhfjob) (hybridflow_trajectory_queue_depth{JOB})",
            f"sum by (rlhfjob) (increase(hybridflow_trajectories_dropped_stale_total{JOB}[5m]))"),
              legend="{{rlhfjob}}", width=8,
              description="async: finished prompt groups waiting for the trainer, and groups dropped in the last "
                          "5 minutes for being older than maxStaleness."),
        Panel("Idle fraction: trainer vs rollout", (
            'max by (__name__) ({__name__=~"hybridflow_(trainer|rollout)_idle_ratio", namespace=~"$namespace", '
            'rlhfjob=~"$rlhfjob"})',), unit="percentunit", legend="{{__name__}}", width=8,
              description="Of the last step: the trainer waiting for trajectories, the rollout pool not generating. "
                          "The point of asynchronous modes is to bring both down."),
        Panel("Weight sync across pools", (
            f"max by (rlhfjob) (hybridflow_weight_sync_seconds{JOB})",), unit="s", legend="{{rlhfjob}}", width=8,
              description="Seconds of the last trainer -> rollout weight stream (its bytes: the next panel)."),
        Panel("Weight sync bytes and rollout policy version", (
            f"max by (rlhfjob) (hybridflow_weight_sync_bytes{JOB})",
            f"max by (rlhfjob) (hybridflow_rollout_policy_version{JOB})"), legend="{{rlhfjob}}", width=8,
              description="Bytes the last sync delivered to all rollout ranks, and the policy version they hold."),
        Panel("Response length (tokens)", (f"avg by (rlhfjob) (hybridflow_response_length_tokens_mean{JOB})",),
              width=8),
        Panel("Entropy and clip fraction", (f"avg by (rlhfjob) (hybridflow_entropy_mean{JOB})",
                                            f"avg by (rlhfjob) (hybridflow_clip_fraction{JOB})"), width=8),
        Panel("Rows left out of the actor update", (f"avg by (rlhfjob) (hybridflow_update_rows_skipped{JOB})",),
              unit="percentunit", legend="{{rlhfjob}}", width=8,
              description="Share of the step's samples whose advantages were all zero (a group that scored alike), "
                          "which the update did not compute (training.skipZeroAdvantageRows); entropy is then the "
                          "computed samples'. Near 100%: the step learned from almost nothing (all too easy, too "
                          "hard, or collapsed)."),
        Panel("Grad norm", (f"avg by (rlhfjob) (hybridflow_grad_norm{JOB})",), width=8),
        Panel("Iteration time p90", (
            f"histogram_quantile(0.9, sum by (le, rlhfjob) (rate(hybridflow_iteration_duration_seconds_bucket{JOB}[5m])))",),
              unit="s", width=8),
    ),
)

OPERATOR = Dashboard(
    uid="hybridflow-operator",
    title="HybridFlow / operator",
    variables=("namespace",),
    panels=(
        Panel("Jobs by phase", (f"sum by (phase) (hybridflow_operator_jobs{OP})",), stacked=True, legend="{{phase}}",
              width=12),
        Panel("Reconcile rate (1/s)", ("sum(rate(hybridflow_operator_reconcile_duration_seconds_count[5m]))",),
              unit="reqps", width=12),
        Panel("Reconcile latency p50 / p95", (
            "histogram_quantile(0.5, sum by (le) (rate(hybridflow_operator_reconcile_duration_seconds_bucket[5m])))",
            "histogram_quantile(0.95, sum by (le) (rate(hybridflow_operator_reconcile_duration_seconds_bucket[5m])))",
        ), unit="s", width=12),
        Panel("Reconcile errors (1/s)", ("sum(rate(hybridflow_operator_reconcile_errors_total[5m]))",), unit="reqps",
              width=6),
        Panel("Gang restarts (1h)", (f"sum(increase(hybridflow_operator_gang_restarts_total{OP}[1h]))",), width=6),
    ),
)

AGENTS = Dashboard(
    uid="hybridflow-agents",
    title="HybridFlow / agents (multi-turn rollouts)",
    panels=(
        Panel("Turns and tool calls per episode", (f"avg by (rlhfjob) (hybridflow_agent_turns_mean{JOB})",
                                                   f"avg by (rlhfjob) (hybridflow_agent_tool_calls_mean{JOB})"),
              width=8, description="Model turns per episode and tool calls per episode (means over the trained "
                                   "batch)."),
        Panel("Tool-call rate", (f"avg by (rlhfjob) (hybridflow_agent_tool_call_ratio{JOB})",), unit="percentunit",
              width=8, description="Fraction of episodes that called a tool at least once."),
        Panel("Tool errors and timeouts", (f"avg by (rlhfjob) (hybridflow_agent_tool_error_ratio{JOB})",
                                           f"avg by (rlhfjob) (hybridflow_agent_tool_deadline_exceeded_ratio{JOB})"),
              unit="percentunit", width=8, description="Fractions of tool calls that failed, and that ran past "
                                                       "their deadline (the model reads either as the answer)."),
        Panel("Tool seconds per step", (f"sum by (rlhfjob) (hybridflow_agent_tool_seconds{JOB})",), unit="s",
              width=8),
        Panel("Environment reward", (f"avg by (rlhfjob) (hybridflow_agent_environment_reward_mean{JOB})",
                                     f"avg by (rlhfjob) (hybridflow_reward_mean{JOB})"), width=8,
              description="The environment's reward per episode, and the score trained on."),
        Panel("Episodes failed or retried", (f"sum by (rlhfjob) (hybridflow_agent_episodes_failed{JOB})",
                                             f"sum by (rlhfjob) (hybridflow_agent_episodes_retried{JOB})"), width=8,
              description="Episodes that ended on an environment error, and episodes started again after their "
                          "environment replica was lost."),
    ),
)

DASHBOARDS = (JOB_OVERVIEW, OPERATOR, AGENTS)


PROMETHEUS = ("prometheus", "${datasource}")  # every panel's and query variable's data source: the one picked


def _variable(name: str) -> Any:
    """A template variable, built with Grafana's foundation SDK."""
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableOption, VariableRefresh

    if name == "peak_flops_per_device":
        return db.ConstantVariable(name).label("Peak FLOP/s per device").value("989e12")
    if name == "namespace":
        query = "label_values(hybridflow_step, namespace)"
    else:
        query = 'label_values(hybridflow_step{namespace=~"$namespace"}, rlhfjob)'
    return (db.QueryVariable(name).datasource(DataSourceRef(*PROMETHEUS)).query({"query": query, "refId": "vars"})
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True).multi(True).all_value(".*")
            .current(VariableOption(text="All", value="$__all")))


def _panel(i: int, p: Panel, x: int, y: int, h: int) -> Any:
    """One panel at (x, y): stat or timeseries, its PromQL targets A, B, ... on the picked data source."""
    from grafana_foundation_sdk.builders import common, prometheus, stat, timeseries
    from grafana_foundation_sdk.models.common import StackingMode
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos

    panel = stat.Panel() if p.kind == "stat" else timeseries.Panel()
    panel.id(i + 1).title(p.title).description(p.description).unit(p.unit).datasource(DataSourceRef(*PROMETHEUS))
    panel.grid_pos(GridPos(h=h, w=p.width, x=x, y=y))
    for j, e in enumerate(p.exprs):
        panel.with_target(prometheus.Dataquery().expr(e).legend_format(p.legend or "__auto").ref_id(chr(65 + j))
                          .datasource(DataSourceRef(*PROMETHEUS)))
    if isinstance(panel, timeseries.Panel):
        panel.fill_opacity(30 if p.stacked else 0).stacking(
            common.StackingConfig().mode(StackingMode.NORMAL if p.stacked else StackingMode.NONE).group("A"))
    return panel


def render(d: Dashboard) -> dict[str, Any]:
    """Grafana dashboard JSON, built with Grafana's foundation SDK (grafana-foundation-sdk, the schema of Grafana
    11.6). Panels flow left to right in rows of 24 columns; a panel that does not fit starts the next row (the
    SDK's own layout would let it overflow)."""
    try:
        from grafana_foundation_sdk.builders import dashboard as db
        from grafana_foundation_sdk.cog.encoder import JSONEncoder
    except ImportError as e:
        raise ImportError("the dashboards are built with Grafana's foundation SDK: pip install -c constraints/cpu.txt "
                          "grafana-foundation-sdk (make install does)") from e

    out = (db.Dashboard(d.title).uid(d.uid).tags(list(d.tags)).editable().refresh("30s").time("now-6h", "now")
           .with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    for v in d.variables:
        out.with_variable(_variable(v))
    x = y = row_h = 0
    for i, p in enumerate(d.panels):
        h = 4 if p.kind == "stat" else 8
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        out.with_panel(_panel(i, p, x, y, h))
        x += p.width
        row_h = max(row_h, h)
    return json.loads(json.dumps(out.build(), cls=JSONEncoder))


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in DASHBOARDS:
        p = out_dir / f"{d.uid}.json"
        p.write_text(json.dumps(render(d), indent=1, sort_keys=False) + "\n")
        paths.append(p)
    return paths
