"""The operator for real with Kueue (a job queued, admitted, evicted and resumed) and `placement: auto` (its
plan pod first)."""
import json

import pytest
import yaml

from kube.harness import Kube, wait_for
from support.operator_views import plan_record
from kube.operator_cluster import (
    ROOT, job_doc, _started_cluster, _wait_ticks, _phase, _message, _reasons, _pod_names, _run_all, VERBS, GROUPS,
)


def _granted_with(combo: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) every Role and ClusterRole of the chart rendered with `combo` grants."""
    from support.helm import render_chart

    return {(g, r, v) for d in render_chart(combo) if d["kind"] in ("Role", "ClusterRole") for rule in d["rules"]
            for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


KUEUE_GROUPS = {"workloads": "kueue.x-k8s.io", "resourceflavors": "kueue.x-k8s.io",
                "priorityclasses": "scheduling.k8s.io"}


def test_a_job_queued_through_kueue_waits_for_admission_is_evicted_and_resumes(tmp_path):
    """Issue 30 item 1, the real operator over HTTP with Kueue on (the chart's kueue.enabled), Kueue's controller
    played by the test (kube/kueue_double.py, writing what Kueue writes): a job labelled with a LocalQueue gets a
    Workload and no pod while it is not admitted; admitted, its pods carry the assigned flavors' node labels and
    tolerations; evicted (preempted), its pods go, the quota is given back, and it waits again; re-admitted, it
    resumes (same gang generation); finished, the Workload says Finished. Every request the operator made for it is
    one the chart (kueue.enabled) grants, and each Kueue right granted was used."""
    from kube.kueue_double import KueueDouble, condition

    with pytest.MonkeyPatch.context() as env:
        env.setenv("HYBRIDFLOW_KUEUE", "true")
        env.setenv("HYBRIDFLOW_ALLOWED_PRIORITY_CLASSES", "research")
        with _started_cluster(tmp_path) as (api, kubeconfig, op):
            env.undo()
            kube = Kube(kubeconfig)
            kueue = KueueDouble(kube.api, "default")
            kueue.flavor("general", {"pool": "general"})
            kueue.flavor("spot", {"pool": "spot"}, [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}])
            kube.custom.create_cluster_custom_object("scheduling.k8s.io", "v1", "priorityclasses", {
                "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "research"},
                "value": 1000})
            refused = job_doc("jqbad", priorityClassName="forbidden")
            refused["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
            kube.create_job(refused)  # judged before it queues: no Workload holds quota for a job never to run
            st = wait_for(lambda: (s := kube.status("jqbad")).get("phase") == "Failed" and s, 30, "Failed")
            assert "priorityClassName 'forbidden' is not allowed" in st["message"]
            assert kueue.workload("jqbad-workload") is None
            doc = job_doc("jq", priorityClassName="research")
            doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
            kube.create_job(doc)
            wl = wait_for(lambda: kueue.workload("jq-workload"), 30, "the job's Workload")
            assert wl["spec"]["queueName"] == "team-a" and wl["metadata"]["ownerReferences"][0]["name"] == "jq"
            assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("head", 1), ("default", 1)]
            assert (wl["spec"]["priorityClassName"], wl["spec"]["priority"]) == ("research", 1000)
            wait_for(lambda: _phase(kube, "jq") == "Queued", 30, "Queued")
            kueue.pend("jq-workload", "couldn't assign flavors to pod set default: insufficient quota for cpu")
            wait_for(lambda: "insufficient quota" in _message(kube, "jq"), 30, "Kueue's reason in the job's status")
            _wait_ticks(op, kube, "jq")
            assert kube.pods("jq") == [] and not api.requests("POST", "pods"), "no pod before admission"

            kueue.admit("jq-workload", "cq", {"head": "general", "default": "spot"})
            pods = wait_for(lambda: len(kube.pods("jq")) == 2 and kube.pods("jq"), 30,
                            lambda: f"the admitted gang; the job's status: {kube.status('jq')}")
            placed = {p.metadata.name: p.spec for p in pods}
            assert placed["jq-head-g0"].node_selector == {"pool": "general"}
            assert placed["jq-default-0-g0"].node_selector == {"pool": "spot"}
            assert [t.key for t in placed["jq-default-0-g0"].tolerations] == ["spot"]
            assert {p.metadata.labels["kueue.x-k8s.io/podset"] for p in pods} == {"head", "default"}
            _run_all(kube, "jq")
            wait_for(lambda: _phase(kube, "jq") == "Running", 30, "Running")
            wait_for(lambda: condition(kueue.workload("jq-workload"), "PodsReady").get("status") == "True", 30,
                     "PodsReady in the Workload")

            kueue.evict("jq-workload")
            wait_for(lambda: _phase(kube, "jq") == "Queued" and not kube.pods("jq"), 30, "evicted: pods gone, Queued")
            wl = wait_for(lambda: (w := kueue.workload("jq-workload")) and not (w.get("status") or {}).get(
                "admission") and w, 30, "the quota given back")
            assert condition(wl, "QuotaReserved")["status"] == "False"
            assert condition(wl, "Requeued")["status"] == "True" and condition(wl, "Admitted")["status"] == "False"
            st = kube.status("jq")
            assert st["reason"] == "Evicted" and "Preempted" in st["message"] and st["restarts"] == 0
            assert "Evicted" in _reasons(kube, "jq")

            kueue.admit("jq-workload", "cq", {"head": "general", "default": "general"})
            wait_for(lambda: _pod_names(kube, "jq") == ["jq-default-0-g0", "jq-head-g0"], 30, "resumed")
            assert kube.pods("jq")[0].spec.node_selector == {"pool": "general"}
            assert "resuming from the last checkpoint" in _message(kube, "jq")
            _run_all(kube, "jq")
            wait_for(lambda: _phase(kube, "jq") == "Running", 30, "Running again")
            # runPolicy.suspend is the Workload's spec.active (Kueue then evicts it, Deactivated, and its quota goes)
            kube.patch_job("jq", {"spec": {"runPolicy": {"suspend": True}}})
            wait_for(lambda: kueue.workload("jq-workload")["spec"]["active"] is False, 30, "spec.active false")
            kueue.evict("jq-workload", "Deactivated", "The workload is deactivated")
            wait_for(lambda: _phase(kube, "jq") == "Suspended" and not (kueue.workload("jq-workload").get(
                "status") or {}).get("admission"), 30, "Suspended, the quota given back")
            kube.patch_job("jq", {"spec": {"runPolicy": {"suspend": False}}})
            wait_for(lambda: kueue.workload("jq-workload")["spec"]["active"] is True, 30, "spec.active true")
            kueue.admit("jq-workload", "cq", {"head": "general", "default": "general"})
            wait_for(lambda: len(kube.pods("jq")) == 2, 30, "admitted again")
            _run_all(kube, "jq")
            wait_for(lambda: _phase(kube, "jq") == "Running", 30, "Running once more")
            kube.set_pod_phase("jq-head-g0", "Succeeded", exit_code=0)
            wait_for(lambda: condition(kueue.workload("jq-workload"), "Finished").get("reason") == "Succeeded", 30,
                     "Finished in the Workload")
            kube.delete_job("jq")
            wait_for(lambda: kube.job("jq") is None and kueue.workload("jq-workload") is None, 30,
                     "the job and its Workload gone")

            # issue 52: a placement: auto job plans first, outside the queue; its Workload asks for the planned pools
            auto = _auto_doc("jqa")
            auto["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
            kube.create_job(auto)
            wait_for(lambda: _pod_names(kube, "jqa") == ["jqa-plan"], 30, "the plan pod, before any Workload")
            _wait_ticks(op, kube, "jqa")
            assert kueue.workload("jqa-workload") is None and _phase(kube, "jqa") == "Queued"
            _plan_pod_ended(kube, "jqa-plan", 0, json.dumps(plan_record()))
            wl = wait_for(lambda: kueue.workload("jqa-workload"), 30, lambda: f"its Workload; {kube.status('jqa')}")
            assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("head", 1), ("learner", 1),
                                                                                ("gen", 1)]
            wait_for(lambda: _pod_names(kube, "jqa") == [], 30, "the plan pod gone; no pod before admission")
            kueue.admit("jqa-workload", "cq", {"head": "general", "learner": "general", "gen": "general"})
            wait_for(lambda: _pod_names(kube, "jqa") == ["jqa-gen-0-g0", "jqa-head-g0", "jqa-learner-0-g0"], 30,
                     "the admitted planned gang")
            kube.delete_job("jqa")
            wait_for(lambda: kube.job("jqa") is None, 30, "jqa gone")

            used = {(KUEUE_GROUPS.get(r.plural, GROUPS.get(r.plural, "")), r.plural,
                     VERBS.get(r.action.name, "patch" if r.method == "PATCH" else "update"))
                    for r in list(api.handler.log) if r.agent.startswith(("kopf", "hybridflow-operator")) and r.plural}
            granted = _granted_with("cluster-wide-kueue")
            granted |= {(g, r.split("/")[0], v) for g, r, v in granted if r.endswith("/status")}
            assert used - granted == set(), "requests the chart's role would refuse"
            kueue_rights = {(g, r, v) for g, r, v in granted if r in KUEUE_GROUPS}
            assert kueue_rights - used == set(), "Kueue rights granted but never used: trim them"


def test_a_job_labelled_for_kueue_is_refused_where_the_operator_has_no_kueue(cluster):
    _, kube, _ = cluster
    doc = job_doc("jnq")
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    kube.create_job(doc)
    st = wait_for(lambda: (s := kube.status("jnq")).get("phase") == "Failed" and s, 30, "Failed")
    assert "metadata.labels[kueue.x-k8s.io/queue-name]" in st["message"] and "kueue.enabled" in st["message"]
    assert kube.pods("jnq") == []


def _auto_doc(name: str, **run_policy) -> dict:
    """The async example with `placement: auto` (issue 52), without its checkpoint claim."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-async-k8s.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["placement"] = "auto"
    doc["spec"]["kubernetes"].pop("checkpointPvc")
    doc["spec"]["runPolicy"] = {"backoffLimit": 2, **run_policy}
    return doc


def _plan_pod_ended(kube, name: str, exit_code: int, message: str) -> None:
    """What the kubelet reports of a plan pod that ended: its termination message (the plan, or its log's tail)."""
    kube.core.patch_namespaced_pod_status(name, kube.namespace, {"status": {
        "phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [{
            "name": "plan", "ready": False, "restartCount": 0, "image": "x", "imageID": "", "state": {"terminated": {
                "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "message": message}}}]}})


def test_a_placement_auto_job_plans_in_a_pod_first_then_runs_the_planned_pools(cluster):
    """Issue 52: a `placement: auto` job first gets its plan pod and nothing of its gang; the plan it prints goes to
    status.plan, the pod goes, and the gang is the plan's pools, each container given the plan (PLAN_ENV); the spec
    ConfigMap keeps the accepted auto spec, and a gang restart keeps the plan and plans nothing again."""
    from hybridflow.api.plan import PLAN_ENV

    api, kube, op = cluster
    kube.create_job(_auto_doc("auto", restartPolicy="gang"))
    (pod,) = wait_for(lambda: kube.pods("auto"), 30, "the plan pod")
    assert pod.metadata.name == "auto-plan" and pod.metadata.labels["hybridflow.io/role"] == "plan"
    assert pod.spec.containers[0].command[:3] == ["hybridflow", "plan", "/etc/hybridflow/job.json"]
    assert pod.spec.automount_service_account_token is False
    _wait_ticks(op, kube, "auto")
    assert _pod_names(kube, "auto") == ["auto-plan"], "nothing of the gang before its plan"
    st = kube.status("auto")
    assert (st["phase"], st["reason"]) == ("Pending", "Planning") and "plan" not in st, st
    record = plan_record()
    _plan_pod_ended(kube, "auto-plan", 0, json.dumps(record))
    wait_for(lambda: kube.status("auto").get("plan") == record, 30, lambda: f"status.plan; {kube.status('auto')}")
    pods = wait_for(lambda: _pod_names(kube, "auto") == ["auto-gen-0-g0", "auto-head-g0", "auto-learner-0-g0"]
                    and kube.pods("auto"), 30, lambda: f"the planned gang, no plan pod; {_pod_names(kube, 'auto')}")
    for p in pods:
        env = {e.name: e.value for c in p.spec.containers for e in c.env or []}
        assert json.loads(env[PLAN_ENV]) == record, p.metadata.name
    assert {p.metadata.labels.get("hybridflow.io/pool") for p in pods} == {None, "learner", "gen"}
    wait_for(lambda: "Planned" in _reasons(kube, "auto"), 30, lambda: f"the Planned event; {_reasons(kube, 'auto')}")
    (cm,) = [c for c in api.objects("v1/configmaps", kube.namespace) if c["metadata"]["name"] == "auto-spec"]
    assert json.loads(cm["data"]["job.json"])["spec"]["placement"] == "auto"
    _run_all(kube, "auto")
    wait_for(lambda: _phase(kube, "auto") == "Running", 30, "Running")
    assert [p["name"] for p in kube.status("auto")["pools"]] == ["learner", "gen"]
    kube.set_pod_phase("auto-learner-0-g0", "Failed", exit_code=1)  # a gang restart: the plan stays, none is made
    wait_for(lambda: _pod_names(kube, "auto") == ["auto-gen-0-g1", "auto-head-g1", "auto-learner-0-g1"], 30,
             lambda: f"generation 1, the planned pools again; {_pod_names(kube, 'auto')}")
    assert kube.status("auto")["plan"] == record


def test_a_plan_pod_that_fails_fails_the_job_with_its_message(cluster):
    _, kube, _ = cluster
    kube.create_job(_auto_doc("noplan"))
    wait_for(lambda: _pod_names(kube, "noplan") == ["noplan-plan"], 30, "the plan pod")
    _plan_pod_ended(kube, "noplan-plan", 2, "loading\nerror: /etc/hybridflow/job.json: spec.placement: auto: no "
                    "placement of this job's models fits its 2 x cpu (spec.resourcePools; 18 candidates)")
    st = wait_for(lambda: (s := kube.status("noplan")).get("phase") == "Failed" and s, 30, "Failed")
    assert st["reason"] == "PlanFailed" and "plan" not in st
    assert st["restarts"] == 0 and "GangRestart" not in _reasons(kube, "noplan"), "the plan pod is not the gang's"
    assert ("the plan pod noplan-plan failed: container plan exited with code 2 (Error): /etc/hybridflow/job.json: "
            "spec.placement: auto: no placement of this job's models fits its 2 x cpu (spec.resourcePools") \
        in st["message"], st["message"]
    assert _pod_names(kube, "noplan") == ["noplan-plan"], "no gang; the failed plan pod stays for its logs"
