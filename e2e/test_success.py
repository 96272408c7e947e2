"""Scenario: success. `kubectl apply` of the example -> operator -> head and worker pods as processes -> a Ray
cluster of three nodes -> the controller trains on the worker pods -> Succeeded, with steps and tokens/s in status,
and a real Prometheus scraping the driver and the operator."""
from __future__ import annotations

import yaml
from kube.harness import free_port, wait_for
from prometheus_server import Prometheus

from e2e.helpers import EXAMPLE, PVC, pod_ip, prom_value, step_log

NAME = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]


def test_kubectl_apply_runs_to_succeeded(world, tmp_path):
    kube = world.kube
    world.kubectl("apply", "--validate=false", "-f", str(PVC))
    world.kubectl("apply", "--validate=false", "-f", str(EXAMPLE))
    pods = wait_for(lambda: len(kube.pods(NAME)) == 3 and kube.pods(NAME), 60, "head + 2 worker pods")
    assert sorted(p.metadata.name for p in pods) == [f"{NAME}-default-0-g0", f"{NAME}-default-1-g0", f"{NAME}-head-g0"]

    head_ip = wait_for(lambda: pod_ip(kube, f"{NAME}-head-g0"), 60, "head pod IP")
    wait_for(lambda: kube.status(NAME).get("phase") == "Running", 120, "phase Running")
    with Prometheus(tmp_path, {"driver": f"{head_ip}:8000", "operator": f"127.0.0.1:{world.operator.metrics_port}"},
                    free_port()) as prom:
        wait_for(lambda: (kube.status(NAME).get("step") or 0) >= 2, 300,
                 f"training steps; head log:\n{world.kubelet.logs('default', f'{NAME}-head-g0')}")
        up = wait_for(lambda: (t := prom.targets_up()) and all(t.get(j) for j in ("driver", "operator")) and t, 60,
                      "both targets up")
        assert up == {"driver": True, "operator": True}
        # Ray saw the cluster the pods formed: the head (no devices) and two pool nodes with one device each.
        nodes = wait_for(lambda: prom_value(prom.query(f'hybridflow_devices{{rlhfjob="{NAME}"}}')), 60, "devices gauge")
        assert nodes == 2
        wait_for(lambda: kube.status(NAME).get("phase") in ("Succeeded", "Failed"), 600,
                 f"the end of training; head log:\n{world.kubelet.logs('default', f'{NAME}-head-g0')}")
        tokens = wait_for(lambda: prom_value(prom.query(f'max_over_time(hybridflow_throughput_tokens_per_second'
                                                      f'{{rlhfjob="{NAME}"}}[10m])')), 30, "throughput series")
        assert tokens > 0
        steps = prom_value(prom.query(f'max_over_time(hybridflow_step{{rlhfjob="{NAME}"}}[10m])'))
        assert steps == 12
        jobs = wait_for(lambda: prom_value(prom.query('hybridflow_operator_jobs{phase="Succeeded"}')), 30,
                        "operator's jobs-by-phase series")
        assert jobs == 1
    st = kube.status(NAME)
    assert st["phase"] == "Succeeded", (st, world.kubelet.logs("default", f"{NAME}-head-g0"))
    assert st["step"] == 12 and st["totalSteps"] == 12
    assert float(st["tokensPerSecond"]) > 0
    # the rollout/actor workers ran on the pool pods, not the head: their Ray logs say so
    log = world.kubelet.logs("default", f"{NAME}-head-g0")
    assert "held-out reward" in log
    assert step_log(world, NAME) == list(range(1, 13))
    out = world.kubectl("get", "rlhfjobs").stdout
    assert NAME in out and "Succeeded" in out

