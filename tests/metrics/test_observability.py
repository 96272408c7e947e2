"""A real Prometheus scrapes a real local RLHF run and a running operator; every dashboard panel's PromQL returns
data and every alert rule evaluates; promtool checks and unit-tests the alerts."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support.paths import ROOT
from support.processes import running
from kube.apiserver_double import RunningApiServer
from kube.harness import Kube, Operator, free_port, wait_for
from prometheus_server import Prometheus, prometheus_binary

from hybridflow.dashboards import AGENTS, DASHBOARDS

pytestmark = pytest.mark.slow
ALERTS = ROOT / "helm" / "hybridflow" / "files" / "alerts.yaml"
DASHBOARD_FILES = ROOT / "helm" / "hybridflow" / "files" / "dashboards"
VARIABLES = {"$namespace": ".*", "$rlhfjob": ".*", "$peak_flops_per_device": "1e12"}
# The panels are queried from step 20 on (about 0.5 s a step here), while the run still runs: measured, the
# queries start at step 20 and take ~0.1 s, so 15 more steps leave them ~7 s of margin.
STEPS = 35


def _promtool() -> str:
    return str(Path(prometheus_binary()).with_name("promtool"))


def test_promtool_checks_and_unit_tests_the_alerts():
    check = subprocess.run([_promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "4 rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([_promtool(), "test", "rules", "alerts_test.yaml"], cwd=ALERTS.parent, capture_output=True,
                          text=True, timeout=120)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def _shipped_queries(uid: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard JSON the chart ships: what Grafana will run."""
    shipped = json.loads((DASHBOARD_FILES / f"{uid}.json").read_text())
    return [(p["title"], t["expr"]) for p in shipped["panels"] for t in p["targets"]]


def _expr(e: str) -> str:
    for k, v in VARIABLES.items():
        e = e.replace(k, v)
    return e


def test_every_panel_and_alert_has_data_from_live_exporters(tmp_path, model_cache, ray_tmp):
    driver_port, prom_port = free_port(), free_port()
    kubeconfig = str(tmp_path / "kubeconfig")
    with RunningApiServer(kubeconfig) as api:
        op = Operator(kubeconfig, tmp_path / "operator.log").start()
        try:
            wait_for(lambda: api.watching("rlhfjobs"), 60, "kopf's watch")
            kube = Kube(kubeconfig)
            # A job on the emulated cluster whose worker fails once: the operator's restart metrics get data.
            doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
            doc["metadata"]["namespace"] = "default"
            kube.create_job(doc)
            wait_for(lambda: len(kube.pods("tiny-grpo")) == 2, 30, "pods")
            kube.set_pod_phase("tiny-grpo-default-0-g0", "Failed", exit_code=1)
            wait_for(lambda: kube.status("tiny-grpo").get("restarts") == 1, 30, "a gang restart")

            job = tmp_path / "job.yaml"
            run_doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
            # long enough to be still running while the panels are queried (from step 20 on), not much longer:
            # the steps after the queries only wait for the run to end
            run_doc["spec"]["trainer"].update(steps=STEPS, saveFreq=10, checkpointDir=str(tmp_path / "run"))
            run_doc["spec"]["algorithm"]["tisCap"] = 10.0  # the trainer/rollout log-prob gap panel needs TIS on
            # Rollout on a pool of its own, asynchronous (the staleness, queue, idle and weight-sync panels): the
            # same two devices, one trainer rank and one rollout rank; a queue deep enough that some groups age
            # past maxStaleness (the stale-drop panel).
            run_doc["spec"]["resourcePools"] = [{"name": "trainer", "devicesPerNode": 1},
                                                {"name": "rollout", "devicesPerNode": 1}]
            run_doc["spec"]["placement"] = {"actor": "trainer", "rollout": "rollout"}
            run_doc["spec"]["rollout"].update(mode="async", maxStaleness=1, queuePrompts=128)
            job.write_text(yaml.safe_dump(run_doc))
            env = {**os.environ, "HYBRIDFLOW_MODEL_CACHE": str(model_cache)}
            run_cmd = [sys.executable, "-m", "hybridflow.cli", "run", str(job), "-q", "--metrics-port",
                       str(driver_port), "--ray-temp-dir", ray_tmp]
            with running(run_cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True) as run:
                _check_panels_and_alerts(run, tmp_path, driver_port, prom_port, op)
        finally:
            op.stop()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_done"] == STEPS


def _check_panels_and_alerts(run, tmp_path, driver_port, prom_port, op):
    targets = {"rlhf-driver": f"127.0.0.1:{driver_port}", "hybridflow-operator": f"127.0.0.1:{op.metrics_port}"}
    with Prometheus(tmp_path, targets, prom_port) as prom:
        steps = tmp_path / "run" / "steps.jsonl"
        wait_for(lambda: steps.exists() and len(steps.read_text().splitlines()) >= 20, 400,
                 "20 training steps")
        wait_for(lambda: all(prom.targets_up().get(t) for t in targets), 60, "both targets up")

        def scrapes(job: str) -> float:  # rate() and increase() panels need a few samples of each target
            r = prom.query(f'count_over_time(up{{job="{job}"}}[1m])')["data"]["result"]
            return float(r[0]["value"][1]) if r else 0.0
        wait_for(lambda: all(scrapes(t) >= 4 for t in targets), 60, "four scrapes of each target")
        at = time.time()
        empty, failed = [], []
        for dash in DASHBOARDS:
            if dash.uid == AGENTS.uid:  # multi-turn rollouts' panels: proven by tests/agents/test_agent_examples.py's run
                continue
            for title, expr in _shipped_queries(dash.uid):
                body = prom.query(_expr(expr), at)
                if body.get("status") != "success":
                    failed.append((dash.uid, title, body.get("error")))
                elif not body["data"]["result"]:
                    empty.append((dash.uid, title, expr))
        assert not failed, failed
        assert not empty, "panels without data:\n" + "\n".join(map(str, empty))
        alerts = yaml.safe_load(ALERTS.read_text())
        for rule in (r for g in alerts["groups"] for r in g["rules"]):
            body = prom.query(rule["expr"], at)
            assert body.get("status") == "success", (rule["alert"], body)
            # an alert on a metric nobody exports evaluates fine, to nothing, forever
            for metric in set(re.findall(r"\b(hybridflow_[a-z_]+)", rule["expr"])):
                series = prom.query(f"count({metric})", at)["data"]["result"]
                assert series, f"alert {rule['alert']}: no exporter has {metric}"
        assert run.wait(timeout=400) == 0, run.stderr.read()[-3000:]


def test_metric_names_follow_prometheus_conventions():
    names = set()
    for dash in DASHBOARDS:
        for panel in dash.panels:
            for expr in panel.exprs:
                names |= set(re.findall(r"\b(hybridflow_[a-z_]+)", expr))
    for n in names:
        base = re.sub(r"_(bucket|count|sum)$", "", n)
        assert not re.search(r"_(ms|milliseconds|kb|mb|gb|percent)\b", base), n
        if "seconds" in base or "bytes" in base:
            assert base.endswith(("_seconds", "_bytes", "_seconds_total", "_bytes_total")) or "_per_second" in base, n
