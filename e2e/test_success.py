"""Scenario: success. `kubectl apply` of the async example (examples/tiny-async-k8s.yaml) with `placement: auto` ->
operator -> its plan pod (`hybridflow plan --auto`, issue 52) -> status.plan -> head and the planned trainer and
rollout pool pods -> a Ray cluster of three nodes -> the actor trains on the trainer pod while vLLM generates on the
rollout pod, the weights streamed between them -> Succeeded, with both pools, steps and tokens/s in status, every
step logged once, and a real Prometheus scraping the driver and the operator."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from hybridflow.api import parse_job
from hybridflow.api.plan import PLAN_ENV, apply_plan
from hybridflow.api.status import pool_status
from hybridflow_operator import manifests as mf
from kube.harness import free_port, wait_for
from prometheus_server import Prometheus

from e2e.helpers import PVC, ROOT, live_pod_names, phase, prom_value
from e2e.worlds import current_head

EXAMPLE = ROOT / "examples" / "tiny-async-k8s.yaml"
SPEC = yaml.safe_load(EXAMPLE.read_text())["spec"]
NAME = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
STEPS = SPEC["trainer"]["steps"]
PROBE = Path(__file__).with_name("probe_ray.py")


def test_kubectl_apply_runs_to_succeeded(world, tmp_path):
    kube = world.kube
    claim = yaml.safe_load(PVC.read_text())
    claim["metadata"]["name"] = SPEC["kubernetes"]["checkpointPvc"]
    (tmp_path / "pvc.yaml").write_text(yaml.safe_dump(claim))
    world.kubectl("apply", "--validate=false", "-f", str(tmp_path / "pvc.yaml"))
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["placement"] = "auto"  # the planner places the models onto the pools' 2 devices (issue 52)
    (tmp_path / "auto.yaml").write_text(yaml.safe_dump(doc))
    world.kubectl("apply", "--validate=false", "-f", str(tmp_path / "auto.yaml"))

    def head_log() -> str:  # on a timeout: what the driver, Ray and the pool pods said until then
        return "\n".join(f"{p.metadata.name} log:\n{world.logs(p.metadata.name)[-3000:]}" for p in kube.pods(NAME))

    # its plan pod first, alone; the plan it printed in status.plan; then the gang of the planned pools
    assert [p.metadata.name for p in wait_for(lambda: kube.pods(NAME), 60, "the plan pod")] == [f"{NAME}-plan"]
    plan = wait_for(lambda: (s := kube.status(NAME)).get("plan") or s.get("phase") == "Failed" and s, 120,
                    lambda: f"status.plan; {kube.status(NAME).get('message')}; {head_log()}")
    assert "fields" in plan, (plan.get("reason"), plan.get("message"))  # (not the status of a job that failed)
    job = apply_plan(parse_job(doc), plan["fields"])
    assert plan["summary"]["mode"] == "async" and sum(plan["summary"]["pools"].values()) == 2, plan["summary"]
    assert job.spec.pool("rollout").name != job.spec.pool("actor").name  # async: the rollout on a pool of its own
    planned = sorted([f"{NAME}-head-g0"] + [f"{NAME}-{p.name}-{i}-g0" for p in job.spec.resource_pools
                                            for i in range(p.nodes)])
    wait_for(lambda: live_pod_names(kube, NAME) == planned, 60, lambda: f"{planned}; {live_pod_names(kube, NAME)}")
    for p in kube.pods(NAME):  # each builds the job the operator built
        assert json.loads(next(e.value for e in p.spec.containers[0].env if e.name == PLAN_ENV)) == plan
    wait_for(lambda: phase(world, NAME) == "Running", 300, lambda: f"phase Running; {head_log()}")
    # status.pools: the trainer pool and the rollout pool apart, each with its roles and its one pod Ready
    pools = wait_for(lambda: (p := kube.status(NAME).get("pools")) and all(x["ready"] == 1 for x in p) and p, 60,
                     lambda: f"both pools Ready in status; {kube.status(NAME).get('pools')}")
    assert pools == pool_status(job.spec, [(p.name, True) for p in job.spec.resource_pools])
    outsider = _start_outsider_probe(world, tmp_path)  # while the job trains
    scraped = [current_head(kube, NAME)]
    with Prometheus(tmp_path, world.metrics_targets(NAME), free_port()) as prom:
        def follow(cond):
            """Evaluate cond while scraping the current head: should the gang restart, the new head is scraped."""
            head = current_head(kube, NAME)
            if head != scraped[-1]:  # new targets only then (on a real cluster, each call starts port-forwards)
                prom.retarget(world.metrics_targets(NAME))
                scraped.append(head)
            return cond()

        up = wait_for(lambda: follow(lambda: (t := prom.targets_up()) and all(t.get(j) for j in prom.targets) and t),
                      120, "driver and operator scraped")
        assert up == {"driver": True, "operator": True}
        # the driver's worker groups span the two pools' devices (one each): Ray saw both nodes join
        assert wait_for(lambda: follow(lambda: prom_value(prom.query(f'hybridflow_devices{{rlhfjob="{NAME}"}}'))),
                        120, lambda: f"devices gauge; {head_log()}") == 2
        # the operator polls the driver's progress into status while the job runs
        assert wait_for(lambda: 0 < kube.status(NAME).get("step", 0) < STEPS and kube.status(NAME)["step"], 300,
                        "a step in status before the end")
        wait_for(lambda: follow(lambda: phase(world, NAME) in ("Succeeded", "Failed")), 600,
                 lambda: f"the end; {head_log()}")
        window = f'{{rlhfjob="{NAME}"}}[10m]'
        assert prom_value(prom.query(f"max_over_time(hybridflow_step{window})")) == STEPS  # lingerSeconds: final scrape
        assert prom_value(prom.query(f"max_over_time(hybridflow_throughput_tokens_per_second{window})")) > 0
        wait_for(lambda: prom_value(prom.query(f'hybridflow_operator_job_info{{rlhfjob="{NAME}",phase="Succeeded"}}')),
                 30, "the operator's view of the job")
        running = prom.query('max_over_time(hybridflow_operator_jobs{namespace="default",phase="Running"}[10m])')
        assert prom_value(running) == 1
    st = kube.status(NAME)
    head = current_head(kube, NAME)
    assert st["phase"] == "Succeeded", f"{st}; {world.logs(head)[-4000:]}"
    assert st["totalSteps"] == STEPS and float(st["tokensPerSecond"]) > 0
    assert "held-out reward after training" in world.logs(head)
    assert world.step_log(NAME) == list(range(1, STEPS + 1))  # every step exactly once
    # trained asynchronously, within the bound: no batch older than maxStaleness policy versions
    staleness = [r["staleness_max"] for r in world.step_records(NAME)]
    assert len(staleness) == STEPS and max(staleness) <= SPEC["rollout"]["maxStaleness"], staleness
    assert st["plan"] == plan and [p["name"] for p in st["pools"]] == [p.name for p in job.spec.resource_pools]
    out = world.kubectl("get", "rlhfjobs").stdout
    assert NAME in out and "Succeeded" in out

    # A pod that is not part of the job reached the head, and Ray refused it: no job submission, no GCS call
    # without the job's token (the same call with the token went through, so the network path was open).
    wait_for(lambda: kube.core.read_namespaced_pod(outsider, "default").status.phase in ("Succeeded", "Failed"), 120,
             f"the probe; {world.logs(outsider)}")
    probe = json.loads(world.logs(outsider).strip().splitlines()[-1])
    assert probe["job_agent"] == 401, probe
    assert probe["gcs_without_token"] == probe["gcs_with_a_wrong_token"] == "UNAUTHENTICATED", probe
    assert probe["gcs_with_the_token"] == "OK", probe
    assert st["restarts"] == 0, "the probe disturbed the job"


def _start_outsider_probe(world, tmp_path) -> str:
    """A pod with no part in the job (no job labels) that probes its head (e2e/probe_ray.py); returns its name."""
    name = "outsider-probe"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "probe", "image": "hybridflow/worker-cpu:0.1.0",
               "command": ["python3", "-c", PROBE.read_text(), f"{NAME}-head.default.svc", str(mf.RAY_PORT),
                           str(mf.RAY_AGENT_PORT)],
               "env": [{"name": "PROBE_TOKEN", "valueFrom": {"secretKeyRef": {"name": f"{NAME}-ray-token",
                                                                               "key": "token"}}}]}]}}
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump(pod))
    world.kubectl("apply", "--validate=false", "-f", str(path))
    return name
