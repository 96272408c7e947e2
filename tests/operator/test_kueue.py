"""Kueue admission on the operator's side, pure (issue 30 item 1): the Workload the operator makes for a job labelled
kueue.x-k8s.io/queue-name (checked against the Workload CRD written from Kueue's v1beta1 API reference, its CEL rules
included), what an admission, an eviction and a re-admission mean to `decide`, where the admitted pods go, and what
the operator writes back into the Workload. Over HTTP with the real operator: tests/operator/test_operator_kopf_queues.py."""
from __future__ import annotations

import datetime as dt

import celpy
import jsonschema
import pytest
import yaml

from hybridflow.api import SpecError, parse_job
from hybridflow_operator import kueue
from hybridflow_operator import manifests as mf
from hybridflow_operator.phases import PodView, Queue, transition, resting

from support.paths import ROOT

NOW = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.timezone.utc)
NAME = "tiny-async-k8s"
CRDS = {c["spec"]["names"]["kind"]: c for c in yaml.safe_load_all((ROOT / "tests" / "kube" /
                                                                    "kueue-v1beta1.yaml").read_text())}


def _job(rollout_pool: dict | None = None, **run_policy):
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async-k8s.yaml").read_text())
    doc["metadata"] = {"name": NAME, "namespace": "ml"}
    if rollout_pool:
        doc["spec"]["rolloutPool"] = rollout_pool
    doc["spec"].setdefault("runPolicy", {}).update(run_policy)
    return parse_job(doc)


def job_workload(job, priority=None) -> dict:
    return kueue.workload(job, "uid-1", "team-a", mf.gang_pods(job, "uid-1", 0), priority)


def _valid(obj: dict, kind: str = "Workload") -> None:
    """The object against the CRD's schema and CEL rules, as the API server would judge it."""
    schema = CRDS[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.validate(obj, schema)
    env = celpy.Environment()

    def rules(node, value):
        for rule in node.get("x-kubernetes-validations", []):
            program = env.program(env.compile(rule["rule"]))
            assert bool(program.evaluate({"self": celpy.json_to_cel(value)})), rule["message"]
        for key, child in node.get("properties", {}).items():
            if isinstance(value, dict) and key in value:
                rules(child, value[key])
        if "items" in node and isinstance(value, list):
            for item in value:
                rules(node["items"], item)

    rules(schema, obj)


def _admitted(job, counts=None, flavors=None) -> kueue.Admission:
    wl = job_workload(job)
    wl["metadata"].update(generation=1, resourceVersion="7")
    wl["status"] = {
        "conditions": [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "m",
                        "lastTransitionTime": "2026-12-05T11:00:00Z"},
                       {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "m",
                        "lastTransitionTime": "2026-12-05T11:00:00Z"}],
        "admission": {"clusterQueue": "cq", "podSetAssignments": [
            {"name": ps["name"], "flavors": {"cpu": (flavors or {}).get(ps["name"], "default")},
             **({"count": counts[ps["name"]]} if counts and ps["name"] in counts else {})}
            for ps in wl["spec"]["podSets"]]}}
    _valid(wl)
    return kueue.read_workload(wl)


def _evicted(adm: kueue.Admission, reason="Preempted") -> kueue.Admission:
    conds = adm.conditions + [{"type": "Evicted", "status": "True", "reason": reason, "message": "by a higher one",
                               "lastTransitionTime": "2026-12-05T11:30:00Z"}]
    return kueue.Admission(**{**adm.__dict__, "conditions": conds, "evicted": f"{reason}: by a higher one",
                              "evicted_reason": reason})


def _pods(gen: int = 0) -> list[PodView]:
    return [PodView(f"{NAME}-head-g{gen}", "head", gen, "Running", ready=True),
            PodView(f"{NAME}-trainer-0-g{gen}", "worker", gen, "Running", pool="trainer", index=0, ready=True),
            PodView(f"{NAME}-rollout-0-g{gen}", "worker", gen, "Running", pool="rollout", index=0, ready=True)]


def test_the_workload_has_a_podset_per_pool_and_the_head_and_passes_kueues_schema():
    job = _job({"minReplicas": 1, "maxReplicas": 3, "replicas": 2}, priorityClassName="research")
    pods = mf.gang_pods(job, "uid-1", 0)
    wl = kueue.workload(job, "uid-1", "team-a", pods, ("research", 1000))
    _valid(wl)
    assert wl["metadata"]["name"] == f"{NAME}-workload" and wl["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert wl["spec"]["queueName"] == "team-a" and wl["spec"]["active"] is True
    assert (wl["spec"]["priorityClassName"], wl["spec"]["priority"]) == ("research", 1000)
    sets = {ps["name"]: ps for ps in wl["spec"]["podSets"]}
    assert list(sets) == ["head", "trainer", "rollout"]
    assert (sets["head"]["count"], sets["trainer"]["count"]) == (1, 1)
    # the elastic rollout pool asks for its most, at least its fewest (Kueue's partial admission)
    assert (sets["rollout"]["count"], sets["rollout"]["minCount"]) == (3, 1)
    head = next(p for p in pods if p["metadata"]["name"].endswith("head-g0"))
    assert sets["head"]["template"]["spec"]["containers"][0]["resources"] == head["spec"]["containers"][0]["resources"]
    # what Kueue's API refuses, the schema here refuses too
    broken = job_workload(job)
    broken["spec"]["priorityClassName"] = "research"
    with pytest.raises(AssertionError, match="priority should not be nil"):
        _valid(broken)
    broken = job_workload(job)
    broken["spec"]["podSets"][2]["minCount"] = 4
    with pytest.raises(AssertionError, match="minCount should be positive"):
        _valid(broken)


def test_environment_pods_are_a_podset_and_a_pool_named_like_one_is_refused_naming_it():
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async-k8s.yaml").read_text())
    doc["metadata"] = {"name": NAME}
    doc["spec"]["resourcePools"][0]["name"] = "head"
    doc["spec"]["placement"] = {k: ("head" if v == "trainer" else v) for k, v in doc["spec"]["placement"].items()}
    job = parse_job(doc)
    with pytest.raises(SpecError, match=r"spec.resourcePools\[0\].name: 'head' is the name of the job's head podSet"):
        job_workload(job)
    pods = mf.gang_pods(_job(), "uid-1", 0)
    pods[1]["metadata"]["labels"] = {mf.LABEL_ROLE: mf.ENVIRONMENT_ROLE}  # an environment pod's labels
    assert [kueue.podset_of(p) for p in pods] == ["head", "environments", "rollout"]


def test_a_queued_job_has_no_pods_until_admitted_then_starts_on_the_flavors_assigned():
    job = _job()
    plan = transition(job, None, {}, [], NOW, queue=Queue("team-a", None))
    assert plan.status["phase"] == "Queued" and plan.create_gang is None and plan.create_static
    assert "LocalQueue team-a" in plan.status["message"]
    assert resting(job, plan.status, NOW).why == "queued"
    pending = kueue.read_workload({**job_workload(job), "status": {"conditions": [
        {"type": "QuotaReserved", "status": "False", "reason": "Pending", "lastTransitionTime": "2026-12-05T11:00:00Z",
         "message": "couldn't assign flavors to pod set trainer: insufficient quota for cpu"}]}})
    plan = transition(job, None, plan.status, [], NOW, queue=Queue("team-a", pending))
    assert plan.status["phase"] == "Queued" and plan.create_gang is None
    assert "insufficient quota for cpu" in plan.status["message"]  # Kueue's own words
    adm = _admitted(job, flavors={"trainer": "spot"})
    plan = transition(job, None, plan.status, [], NOW, queue=Queue("team-a", adm))
    assert plan.status["phase"] == "Pending" and plan.create_gang == 0 and plan.status["reason"] == "Admitted"
    assert "ClusterQueue cq" in plan.status["message"] and "creating" in plan.status["message"]
    # placed on the flavors: node labels and tolerations, as Kueue's own integrations place pods
    flavors = {"default": {"spec": {"nodeLabels": {"pool": "general"}}},
               "spot": {"spec": {"nodeLabels": {"pool": "spot", "zone": "a"},
                                 "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}}}
    pods = kueue.place(mf.gang_pods(job, "uid-1", 0), kueue.placements(adm, flavors))
    by_set = {p["metadata"]["labels"][kueue.PODSET_LABEL]: p["spec"] for p in pods}
    assert by_set["trainer"]["nodeSelector"] == {"pool": "spot", "zone": "a"}
    assert by_set["trainer"]["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert by_set["head"]["nodeSelector"] == {"pool": "general"} and "tolerations" not in by_set["head"]


def test_a_pool_selecting_other_nodes_than_its_flavor_fails_naming_both():
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async-k8s.yaml").read_text())
    doc["metadata"] = {"name": NAME}
    doc["spec"]["resourcePools"][0]["nodeSelector"] = {"pool": "a100"}
    job = parse_job(doc)
    adm = _admitted(job, flavors={"trainer": "spot"})
    with pytest.raises(SpecError, match=r"nodeSelector: pool='a100', but Kueue admitted the pool on nodes with "
                                        r"pool='spot'"):
        kueue.place(mf.gang_pods(job, "uid-1", 0),
                    kueue.placements(adm, {"default": {}, "spot": {"spec": {"nodeLabels": {"pool": "spot"}}}}))


def test_an_eviction_suspends_gives_the_quota_back_once_the_pods_are_gone_and_readmission_resumes():
    job = _job()
    adm = _admitted(job)
    running = {"phase": "Running", "restarts": 0, "startTime": "2026-12-05T11:00:00Z", "step": 4,
               "conditions": [{"type": "Created", "status": "True", "reason": "Admitted", "message": "",
                               "lastTransitionTime": "2026-12-05T11:00:00Z"}]}
    # running and admitted: PodsReady for Kueue's waitForPodsReady
    patch = kueue.status_patch(adm, "Running", 3, "", NOW)
    ready = next(c for c in patch["status"]["conditions"] if c["type"] == "PodsReady")
    assert ready["status"] == "True" and patch["metadata"]["resourceVersion"] == "7"
    evicted = _evicted(adm)
    plan = transition(job, None, running, _pods(), NOW, queue=Queue("team-a", evicted))
    assert plan.status["phase"] == "Suspending" and plan.status["reason"] == "Evicted"
    assert sorted(plan.delete_pods) == sorted(p.name for p in _pods()) and plan.create_gang is None
    assert "Preempted: by a higher one" in plan.status["message"]
    assert kueue.status_patch(evicted, "Suspending", 3, "", NOW) is None  # the quota stays while pods remain
    plan = transition(job, None, plan.status, [], NOW, queue=Queue("team-a", evicted))
    assert plan.status["phase"] == "Queued" and plan.status["reason"] == "Evicted" and plan.status["step"] == 4
    patch = kueue.status_patch(evicted, "Queued", 0, "", NOW)
    conds = {c["type"]: c for c in patch["status"]["conditions"]}
    assert patch["status"]["admission"] is None  # a merge patch's null: the admission removed
    assert (conds["QuotaReserved"]["status"], conds["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert conds["Admitted"]["status"] == "False" and conds["Requeued"]["status"] == "True"
    assert conds["Evicted"]["status"] == "True"  # Kueue resets it when it reserves quota again
    released = kueue.read_workload({**job_workload(job), "status": {**patch["status"], "admission": None}})
    _valid({**job_workload(job), "status": {k: v for k, v in patch["status"].items() if v is not None}})
    plan = transition(job, None, plan.status, [], NOW, queue=Queue("team-a", released))
    assert plan.status["phase"] == "Queued" and plan.create_gang is None
    plan = transition(job, None, plan.status, [], NOW, queue=Queue("team-a", _admitted(job)))
    assert plan.status["phase"] == "Pending" and plan.create_gang == 0 and plan.status["restarts"] == 0
    assert "resuming from the last checkpoint" in plan.status["message"]
    # a deactivation (Kueue's own, or runPolicy.suspend through spec.active) is not requeued by Kueue
    patch = kueue.status_patch(_evicted(adm, "Deactivated"), "Queued", 0, "", NOW)
    assert next(c for c in patch["status"]["conditions"] if c["type"] == "Requeued")["status"] == "False"


def test_finished_jobs_release_their_quota_and_suspend_is_spec_active():
    job = _job()
    adm = _admitted(job)
    patch = kueue.status_patch(adm, "Succeeded", 1, "the controller finished every step", NOW)
    fin = next(c for c in patch["status"]["conditions"] if c["type"] == "Finished")
    assert (fin["status"], fin["reason"]) == ("True", "Succeeded")
    assert kueue.status_patch(_admitted(job), "Failed", 0, "x", NOW)["status"]["conditions"][-1]["reason"] == "Failed"
    # runPolicy.suspend as spec.active: recorded once the Workload holds it, written only when suspend changes
    assert kueue.active_update(adm, suspend=False, recorded=None) == (None, True)
    assert kueue.active_update(adm, suspend=True, recorded=True) == ({"spec": {"active": False}}, None)
    assert kueue.active_update(adm, suspend=False, recorded=True) == (None, None)
    suspended = transition(_job(suspend=True), None, {"phase": "Queued", "restarts": 0}, [], NOW,
                       queue=Queue("team-a", adm))
    assert suspended.status["phase"] == "Suspending"
    # Kueue deactivated it itself (its requeuing limit): not undone, and the job waits saying so
    wl = job_workload(job)
    wl["spec"]["active"] = False
    wl["status"] = {"conditions": [{"type": "Evicted", "status": "True", "reason": "Deactivated",
                                    "message": "exceeded the requeuing limit", "lastTransitionTime": "2026-12-05T11:00:00Z"}]}
    off = kueue.read_workload(wl)
    assert kueue.active_update(off, suspend=False, recorded=True) == (None, None)
    plan = transition(job, None, {"phase": "Queued", "restarts": 0}, [], NOW, queue=Queue("team-a", off))
    assert plan.status["phase"] == "Queued" and plan.create_gang is None
    assert "is inactive" in plan.status["message"] and "runPolicy.suspend true, then false" in plan.status["message"]


def test_an_elastic_rollout_pool_stays_within_the_pods_kueue_admitted():
    """Kueue admitted 2 of the 3 pods asked for (partial admission): the job runs at 2 (its gang, the pods it
    expects), no pod made past them, nothing counted as lost; RolloutCapped says why, and clears once within."""
    from hybridflow_operator.phases import expected_pods

    asked = _job({"minReplicas": 1, "maxReplicas": 3, "replicas": 3})
    adm = _admitted(asked, counts={"rollout": 2})
    job, wanted = kueue.within_admission(asked, adm)
    assert wanted == 3 and expected_pods(job) == 4
    assert [p["metadata"]["name"] for p in mf.gang_pods(job, "uid", 0)][-1] == f"{NAME}-rollout-1-g0"
    running = _pods() + [PodView(f"{NAME}-rollout-1-g0", "worker", 0, "Running", pool="rollout", index=1, ready=True)]
    st = {"phase": "Running", "restarts": 0, "rolloutReplicas": 2}
    for _ in range(3):  # tick after tick: nothing made, nothing deleted, no restart
        plan = transition(job, None, st, running, NOW, queue=Queue("team-a", adm), rollout_asked=wanted)
        assert plan.create_gang is None and not plan.delete_pods and plan.status["phase"] == "Running"
        st = plan.status
    (capped,) = [c for c in st["conditions"] if c["type"] == "RolloutCapped"]
    assert capped["status"] == "True" and "Kueue admitted 2 pod(s)" in capped["message"]
    within, none = kueue.within_admission(_job({"minReplicas": 1, "maxReplicas": 3, "replicas": 2}), adm)
    assert none is None
    plan = transition(within, None, st, running, NOW, queue=Queue("team-a", adm))
    assert next(c for c in plan.status["conditions"] if c["type"] == "RolloutCapped")["status"] == "False"


def test_pods_ready_uses_kueues_reasons_and_the_queue_is_the_one_accepted():
    from hybridflow_operator.accept import queue_of

    job = _job()
    adm = _admitted(job)
    started = kueue.status_patch(adm, "Running", 3, "", NOW)["status"]["conditions"]
    assert next(c for c in started if c["type"] == "PodsReady")["reason"] == "Started"
    after = kueue.Admission(**{**adm.__dict__, "conditions": started, "pods_ready": True})
    lost = kueue.status_patch(after, "Restarting", 3, "", NOW)["status"]["conditions"]
    assert next(c for c in lost if c["type"] == "PodsReady")["reason"] == "WaitForRecovery"  # what Kueue times out
    labelled = {"metadata": {"labels": {kueue.QUEUE_LABEL: "team-b"}}}
    assert queue_of(labelled, {}) == "team-b"  # accepted now
    assert queue_of(labelled, {"phase": "Running", "queueName": "team-a"}) == "team-a"  # renamed later: kept
    assert queue_of(labelled, {"phase": "Queued", "queueName": "team-a"}) == "team-b"  # still waiting: moved
    assert queue_of({"metadata": {}}, {"phase": "Queued", "queueName": "team-a"}) == "team-a"  # removed: kept
    assert queue_of(labelled, {"phase": "Running"}) is None  # added to a job accepted without one: nothing


def test_more_pools_than_a_workload_holds_podsets_are_refused_naming_them():
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async-k8s.yaml").read_text())
    doc["metadata"] = {"name": NAME}
    doc["spec"]["resourcePools"] += [{"name": f"extra{i}"} for i in range(6)]
    problems = kueue.podset_problems(parse_job(doc))
    assert problems and "8 pools make 9 Kueue podSets" in problems[0] and "at most 8" in problems[0]
