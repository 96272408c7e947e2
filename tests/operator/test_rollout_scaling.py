"""An elastic rollout pool on the operator's side (issue 29, item 3): spec.rolloutPool is validated, read live like
runPolicy (not a spec change), and `decide` adds or removes only the rollout pods past the new size, with the head
and every other pod kept and nothing counted as a failure; the pods are built at the size now, each rollout pod
advertising its slot and handing its replicas back in its preStop hook. The driver's side:
tests/trainer/test_elastic_rollout.py; both on a live job: e2e/test_faults.py."""
from __future__ import annotations

import datetime as dt
import json

import pytest
import yaml

from hybridflow.api import SpecError, parse_job, pool_resource, pool_slot_resource
from hybridflow.api.scaling import replicas_now, sized
from hybridflow_operator import manifests as mf
from hybridflow_operator.accept import accepted_job, spec_fields
from hybridflow_operator.watch import pod_view
from hybridflow_operator.phases import PodView, transition, expected_pods

from support.paths import ROOT

NOW = dt.datetime(2026, 12, 4, 12, 0, tzinfo=dt.timezone.utc)
NAME = "tiny-async-k8s"


def _job(replicas: int | None = 1, most: int = 3, least: int = 1, **spec_changes):
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async-k8s.yaml").read_text())
    doc["metadata"] = {"name": NAME, "namespace": "ml"}
    doc["spec"]["rolloutPool"] = {"minReplicas": least, "maxReplicas": most,
                                  **({"replicas": replicas} if replicas is not None else {})}
    doc["spec"].update(spec_changes)
    return parse_job(doc)


def _pods(rollout: int, phase: str = "Running") -> list[PodView]:
    head = PodView(f"{NAME}-head-g0", "head", 0, "Running", ready=True)
    trainer = PodView(f"{NAME}-trainer-0-g0", "worker", 0, "Running", pool="trainer", index=0, ready=True)
    return [head, trainer] + [PodView(f"{NAME}-rollout-{i}-g0", "worker", 0, phase, pool="rollout", index=i,
                                      ready=True) for i in range(rollout)]


def _events(plan, reason: str) -> list[str]:
    return [m for _, r, m in plan.events if r == reason]


@pytest.mark.parametrize("policy", ["failedPod", "gang"])
def test_scaling_up_adds_only_the_new_pods_and_is_no_failure(policy):
    job = _job(2, runPolicy={"restartPolicy": policy})
    plan = transition(job, None, {"phase": "Running", "restarts": 0, "rolloutReplicas": 1}, _pods(1), NOW)
    assert plan.status["phase"] == "Running" and plan.status["restarts"] == 0 and not plan.delete_pods
    assert plan.create_gang == 0 and "podReplacements" not in plan.status  # the missing pod is made, not replaced
    assert plan.status["rolloutReplicas"] == 1  # given once it is there
    assert plan.status["lastRolloutScale"]["from"] == 1 and plan.status["lastRolloutScale"]["to"] == 2
    (event,) = _events(plan, "RolloutScaled")
    assert "rollout pool rollout: 1 -> 2 pods" in event and "take the current weights" in event
    assert plan.status["rolloutSelector"] == "hybridflow.io/job=tiny-async-k8s,hybridflow.io/pool=rollout"
    # the pods the plan creates: the new one, by name, beside those there
    made = [p["metadata"]["name"] for p in mf.gang_pods(job, "uid", 0)]
    assert made == [f"{NAME}-head-g0", f"{NAME}-trainer-0-g0", f"{NAME}-rollout-0-g0", f"{NAME}-rollout-1-g0"]

    # the next tick: the new pod seen (Pending), the size given, no second event, nothing made again
    again = transition(job, None, plan.status, _pods(1) + [_pods(2, "Pending")[-1]], NOW)
    assert again.status["rolloutReplicas"] == 2 and again.create_gang is None and not again.events
    assert again.status["phase"] == "Running"


def test_scaling_down_deletes_only_the_pods_past_the_new_size():
    job = _job(1)
    pods = _pods(3)
    plan = transition(job, None, {"phase": "Running", "restarts": 0, "rolloutReplicas": 3}, pods, NOW)
    assert plan.delete_pods == [f"{NAME}-rollout-1-g0", f"{NAME}-rollout-2-g0"]
    assert plan.status["phase"] == "Running" and plan.create_gang is None and plan.status["restarts"] == 0
    assert plan.status["rolloutReplicas"] == 1 and "podReplacements" not in plan.status
    (event,) = _events(plan, "RolloutScaled")
    assert "3 -> 1 pods" in event and "finish the generation they are in first" in event
    # while they terminate (or once gone) nothing is missing, nothing replaced
    going = pods[:3] + [PodView(p.name, "worker", 0, "Running", deleting=True, pool="rollout", index=p.index)
                        for p in pods[3:]]
    for seen in (going, pods[:3]):
        plan = transition(job, None, plan.status, seen, NOW)
        assert plan.status["phase"] == "Running" and not plan.events and plan.create_gang is None
        assert not plan.delete_pods and "podReplacements" not in plan.status


def test_a_lost_pod_within_the_size_is_still_replaced_and_counted():
    """Scaling is not a loss, and a loss is not scaling: a failed rollout pod below the size is replaced alone."""
    job = _job(2)
    pods = _pods(2)
    pods[-1] = PodView(pods[-1].name, "worker", 0, "Failed", pool="rollout", index=1)
    plan = transition(job, None, {"phase": "Running", "restarts": 0, "rolloutReplicas": 2}, pods, NOW)
    assert plan.delete_pods == [f"{NAME}-rollout-1-g0"] and plan.status["podReplacements"] == 1
    assert not _events(plan, "RolloutScaled")


def test_a_gang_start_makes_the_pool_at_its_size_now_and_volcano_waits_for_its_minimum():
    job = _job(3, least=2)
    assert expected_pods(job) == 1 + 1 + 3
    pods = mf.gang_pods(job, "uid", 1)
    rollout = [p for p in pods if p["metadata"]["labels"].get(mf.LABEL_POOL) == "rollout"]
    assert len(rollout) == 3
    assert mf.podgroup(job, "uid")["spec"]["minMember"] == 1 + 1 + 2
    assert job.spec.pool("rollout").nodes == 1, "the spec itself keeps the size it was written with"


def test_each_rollout_pod_advertises_its_slot_and_hands_its_replicas_back_before_it_stops():
    job = _job(2)
    pod = mf.worker_pod(sized(job), "uid", sized(job).spec.pool("rollout"), 1, 0)
    c = pod["spec"]["containers"][0]
    start = c["command"][-1]
    advertised = json.loads(start.split("--resources=")[1].split("'")[1])
    assert advertised == {pool_resource("rollout"): 1, pool_slot_resource("rollout", 1): 1}
    hook = c["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["hybridflow", "leave-pool"] and "--pool=rollout" in hook and "--index=1" in hook
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > int(job.spec.rollout.weight_sync_timeout_seconds) and f"--timeout={grace - 10}" in hook
    # the trainer's pods, and a sync job's rollout pods, neither: their ranks form one world
    trainer = mf.worker_pod(job, "uid", job.spec.pool("trainer"), 0, 0)["spec"]
    assert "lifecycle" not in trainer["containers"][0] and trainer["terminationGracePeriodSeconds"] == 30
    assert "_slot" not in trainer["containers"][0]["command"][-1]
    assert pod_view(pod).index == 1


def test_the_size_is_read_live_and_is_not_a_spec_change():
    created = _job(1)
    memo = {"accepted": created, "accepted_fields": spec_fields(mf.resolved_job(created))}
    live = _job(2, most=4)
    job, changed = accepted_job(None, live, "uid", {}, memo)
    assert not changed and replicas_now(job.spec) == 2 and job.spec.rollout_pool.max_replicas == 4
    edited = _job(2, data={**live.spec.data.model_dump(by_alias=True, exclude_none=True), "trainPrompts": 700})
    assert accepted_job(None, edited, "uid", {}, memo)[1], "another field's edit is still a change"
    assert replicas_now(created.spec) == 1, "the accepted spec itself is not edited"


@pytest.mark.parametrize("changes, message", [
    ({"rolloutPool": {"replicas": 4, "maxReplicas": 3}}, "spec.rolloutPool.replicas = 4 is outside"),
    ({"rolloutPool": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas = 3 is above maxReplicas = 2"),
    ({"rolloutPool": {"minReplicas": 2, "maxReplicas": 3}}, "spec.resourcePools[1].nodes (the rollout pool's size"),
    ({"rolloutPool": {"maxReplicas": 2}, "placement": {}}, "only an async job's rollout pool of its own is elastic"),
])
def test_a_bad_elastic_pool_is_refused_naming_the_field(changes, message):
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async-k8s.yaml").read_text())
    doc["spec"].update(changes)
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    assert message in str(err.value)
