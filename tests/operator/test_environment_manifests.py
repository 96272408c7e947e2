"""The sandbox pool on Kubernetes (spec.environments), the operator's pure side: its pods, their Service,
NetworkPolicy and token Secret (validated with the official schemas), the URLs and token handed to the gang, what a
sandbox pod holds (no credential of the job's), and the plan that keeps the pool at its size apart from the
gang."""
from __future__ import annotations


import base64

import kubernetes_validate
import yaml

from hybridflow.sandbox_pool import (
    ENDPOINT_PORTS_ENV, POD_IP_ENV, REWARD_URLS_ENV, TOKEN_ENV, URLS_ENV, parse_urls,
)
from hybridflow.api.agents import sandbox_pool
from hybridflow.api import parse_job
from hybridflow_operator import environments as envs
from hybridflow_operator import manifests as mf
from hybridflow_operator.phases import PodView

from support.paths import ROOT

UID = "1234-abcd"
TOKEN = "ab" * 32
SANDBOX_TOKEN = "cd" * 32


def _job(**kubernetes):
    doc = yaml.safe_load((ROOT / "examples" / "smollm2-arithmetic.yaml").read_text())
    doc["metadata"] = {"name": "agent", "namespace": "ml"}
    s = doc["spec"]
    s["rollout"]["agent"] = {"environmentFile": "game.py", "tools": ["calculator"]}  # a key of the code ConfigMap
    s["environments"] = {"replicas": 3, "cpu": "500m", "memory": "1Gi"}
    s["resourcePools"] = [{"name": "default", "nodes": 2, "devicesPerNode": 1}]
    s["kubernetes"] = {"image": "hybridflow/worker-cpu:0.1.0", "checkpointPvc": "ckpt", "dataPvc": "data",
                       "checkpointSecret": "s3", "rewardConfigMap": "agent-code", **kubernetes}
    s["trainer"]["checkpointDir"] = "s3://bucket/runs"
    return parse_job(doc)


def _children(job):
    return (mf.static_children(job, UID, TOKEN, ["monitoring"]) + envs.environment_children(job, UID, SANDBOX_TOKEN)
            + mf.gang_pods(job, UID, 0) + [envs.environment_pod(job, UID, i) for i in range(3)])


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_manifests_validate_strictly():
    for obj in _children(_job()):
        if obj["kind"] != "PodGroup":
            kubernetes_validate.validate(obj, "1.33", strict=True)


def test_environment_pods_deny_all_egress_and_admit_only_the_jobs_pods():
    job = _job()
    objs = _children(job)
    policies = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
    pool = policies["agent-env"]
    assert pool["podSelector"] == {"matchLabels": {mf.LABEL_JOB: "agent", mf.LABEL_ROLE: "environment"}}
    assert pool["policyTypes"] == ["Ingress", "Egress"] and pool["egress"] == []
    assert pool["ingress"] == [{"from": [{"podSelector": {"matchLabels": {mf.LABEL_JOB: "agent"}}}],
                                "ports": [{"protocol": "TCP", "port": mf.ENVIRONMENT_PORT}]}]
    # Policies add up: the job's own policy (egress to DNS, its pods, object storage) must not select them
    job_policy = policies["agent-ingress"]["podSelector"]
    env_labels = next(o for o in objs if o["metadata"]["name"] == "agent-env-0")["metadata"]["labels"]
    assert not _selects(job_policy, env_labels)
    head_labels = next(o for o in objs if o["metadata"]["name"] == "agent-head-g0")["metadata"]["labels"]
    assert _selects(job_policy, head_labels) and _selects(pool["ingress"][0]["from"][0]["podSelector"], head_labels)


def _selects(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "NotIn"
        ok = ok and labels.get(e["key"]) not in e["values"]
    return ok


def test_without_environments_the_job_policy_is_as_before():
    doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo-k8s.yaml").read_text())
    job = parse_job(doc)
    policy = mf.network_policy(job, UID, [])
    assert policy["spec"]["podSelector"] == {"matchLabels": {mf.LABEL_JOB: "tiny-grpo-k8s"}}
    assert envs.environment_children(job, UID, SANDBOX_TOKEN) == [] and mf.environment_urls(job) == []
    assert all(mf.ENVIRONMENT_URLS_ENV not in _env(c) for p in mf.gang_pods(job, UID, 0)
               for c in p["spec"]["containers"])


def test_the_gang_gets_the_replicas_urls_and_the_pods_are_reachable_there():
    job = _job()
    objs = _children(job)
    urls = [f"http://env-{i}.agent-env.ml.svc:{mf.ENVIRONMENT_PORT}" for i in range(3)]
    assert mf.ENVIRONMENT_URLS_ENV == URLS_ENV  # the variable hybridflow.agents.places reads
    assert mf.SANDBOX_TOKEN_ENV == TOKEN_ENV  # the variable hybridflow.sandbox_pool reads
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == "agent-sandbox-token")
    assert base64.b64decode(secret["data"]["token"]).decode() == SANDBOX_TOKEN
    for pod in (o for o in objs if o["kind"] == "Pod" and o["metadata"]["labels"][mf.LABEL_ROLE] != "environment"):
        for c in pod["spec"]["containers"]:
            assert parse_urls(_env(c)[URLS_ENV]) == urls, pod["metadata"]["name"]
            assert _env(c)[TOKEN_ENV] == {"secretKeyRef": {"name": "agent-sandbox-token", "key": "token"}}
    service = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "agent-env")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {mf.LABEL_JOB: "agent", mf.LABEL_ROLE: "environment"}
    for i in range(3):
        pod = next(o for o in objs if o["metadata"]["name"] == f"agent-env-{i}")
        assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (f"env-{i}", "agent-env")  # = urls[i]


def test_a_sandbox_pod_runs_the_server_with_its_own_token_and_no_credential():
    job = _job(headMemory="4Gi", serviceAccountName="trainer", trackingSecret="mlflow")
    pod = envs.environment_pod(job, UID, 1)
    (c,) = pod["spec"]["containers"]
    assert c["command"][:3] == ["hybridflow", "environments", "serve"]
    assert c["command"][c["command"].index("--spec") + 1] == f"{mf.SPEC_MOUNT}/{mf.SPEC_KEY}"
    assert c["resources"]["limits"]["cpu"] == "500m" and c["resources"]["limits"]["memory"] == "1Gi"
    env = _env(c)
    assert env[TOKEN_ENV] == {"secretKeyRef": {"name": "agent-sandbox-token", "key": "token"}}
    # no credential of the job's: its Ray token, object storage and tracking keys, its ServiceAccount
    assert [k for k, v in env.items() if isinstance(v, dict)] == [TOKEN_ENV], env
    assert not any(k.startswith(("AWS_", "RAY_", "MLFLOW")) and k != "AWS_EC2_METADATA_DISABLED" for k in env), env
    assert "serviceAccountName" not in pod["spec"] and "envFrom" not in c
    refs = mf.pod_references([pod])
    assert {r for r in refs if r[0] == "Secret"} == {("Secret", "agent-sandbox-token")}, refs
    assert URLS_ENV not in env
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == set()  # no claim at all: not the checkpoints, not the data (no code is read from it)
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in c["volumeMounts"]}
    assert mounts[mf.REWARD_MOUNT] is True and mounts[mf.SPEC_MOUNT] is True
    assert ("ConfigMap", "agent-reward") in refs and ("ConfigMap", "agent-code") not in refs  # the job's copy
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert "schedulerName" not in pod["spec"]  # not in the gang
    assert pod["metadata"]["labels"] == {**mf.job_labels("agent"), mf.LABEL_ROLE: "environment", mf.LABEL_INDEX: "1"}
    assert mf.GROUP + "/generation" not in pod["metadata"]["labels"]
    # the resolved spec the pod reads names the file inside the job's copy of its code ConfigMap
    assert mf.resolved_job(job).spec.rollout.agent.environment_file == f"{mf.REWARD_MOUNT}/game.py"
    image = envs.environment_pod(_job(), UID, 0)["spec"]["containers"][0]["image"]
    assert image == "hybridflow/worker-cpu:0.1.0"
    job.spec.environments.image = "my/sandbox:1"
    assert envs.environment_pod(job, UID, 0)["spec"]["containers"][0]["image"] == "my/sandbox:1"


def _view(name: str, phase: str = "Running", deleting: bool = False, ready: bool = True) -> PodView:
    return PodView(name=name, role="environment", generation=0, phase=phase, deleting=deleting, ready=ready)


def test_the_pool_is_kept_at_its_size_apart_from_the_gang():
    job = _job()
    # Pending: made along with the gang, not while the job waits for its inputs
    assert envs.plan_pool(job, "Pending", [], creating_gang=True).create == [0, 1, 2]
    assert envs.plan_pool(job, "Pending", [], creating_gang=False).create == []
    # Running: a failed replica is deleted, then made again under its name once gone; the rest are left alone
    pods = [_view("agent-env-0"), _view("agent-env-1", "Failed"), _view("agent-env-2", "Pending", ready=False)]
    plan = envs.plan_pool(job, "Running", pods, creating_gang=False)
    assert (plan.create, plan.delete) == ([], ["agent-env-1"])
    assert plan.status == {"replicas": 3, "pods": 2, "ready": 1}
    plan = envs.plan_pool(job, "Running", [pods[0], _view("agent-env-1", "Failed", deleting=True), pods[2]], False)
    assert (plan.create, plan.delete) == ([], [])  # still terminating: its name is not free yet
    plan = envs.plan_pool(job, "Running", [pods[0], pods[2]], False)
    assert plan.create == [1]
    # a gang restart leaves the pool running
    assert envs.plan_pool(job, "Restarting", pods[:1] + pods[2:], False).delete == []
    # suspended or finished: every replica goes
    for phase in ("Suspending", "Suspended", "Succeeded", "Failed"):
        plan = envs.plan_pool(job, phase, pods, False)
        assert (sorted(plan.delete), plan.create) == (["agent-env-0", "agent-env-1", "agent-env-2"], []), phase
        assert plan.status == {"replicas": 3, "pods": 0, "ready": 0}, phase  # not the count of the last tick
    # a replica beyond spec.environments.replicas is not the pool's
    assert envs.plan_pool(job, "Running", pods + [_view("agent-env-7")], False).delete == ["agent-env-1",
                                                                                          "agent-env-7"]


def test_sandbox_pods_refuse_to_run_user_code_without_the_whole_sandbox_unless_allowed():
    from hybridflow.sandbox import REQUIRE_ENV

    assert (mf.SANDBOX_ENV, mf.SANDBOX_REQUIRED) == (REQUIRE_ENV, "require")  # what hybridflow.sandbox reads
    for i in range(3):
        env = {e["name"]: e.get("value") for e in envs.environment_pod(_job(), UID, i)["spec"]["containers"][0]["env"]}
        assert env[REQUIRE_ENV] == "require", env
    job = _job()
    job.spec.sandbox.allow_partial = True
    job.spec.sandbox.runtime_class_name = "gvisor"
    pod = envs.environment_pod(job, UID, 0)
    assert {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}[REQUIRE_ENV] == "partial"
    assert pod["spec"]["runtimeClassName"] == "gvisor"
    assert "runtimeClassName" not in mf.gang_pods(job, UID, 0)[0]["spec"]  # only the sandbox pods
    for pod in mf.gang_pods(job, UID, 0):  # which run no user code at all: were they to, they would refuse
        for c in pod["spec"]["containers"]:
            assert {e["name"]: e.get("value") for e in c["env"]}[REQUIRE_ENV] == "require", pod["metadata"]["name"]


def test_a_sandbox_pod_that_refused_fails_the_job_naming_it_and_the_way_out():
    from hybridflow.api import EXIT_SANDBOX_UNAVAILABLE

    job = _job()
    refusing = PodView(name="agent-env-1", role="environment", generation=0, phase="Failed",
                       exit_code=EXIT_SANDBOX_UNAVAILABLE, message="error: ... lacks network (bwrap: ...). Set "
                       "spec.sandbox.runtimeClassName ...")
    plan = envs.plan_pool(job, "Running", [_view("agent-env-0"), refusing], creating_gang=False)
    assert "agent-env-1 refused to run the job's user code" in plan.refused and "runtimeClassName" in plan.refused
    crashed = PodView(name="agent-env-1", role="environment", generation=0, phase="Failed", exit_code=1)
    plan = envs.plan_pool(job, "Running", [_view("agent-env-0"), crashed], creating_gang=False)
    assert plan.refused == "" and plan.delete == ["agent-env-1"]  # any other failure: replaced, as before


def test_a_job_with_a_reward_function_gets_a_sandbox_pool_that_holds_the_reward_file():
    doc = yaml.safe_load((ROOT / "examples" / "smollm2-arithmetic.yaml").read_text())
    doc["metadata"] = {"name": "tiny-grpo-k8s"}
    doc["spec"]["models"]["reward"] = {"function": {"path": "reward.py"}}
    doc["spec"]["kubernetes"] = {"image": "hybridflow/worker-cpu:0.1.0", "rewardConfigMap": "my-reward"}
    job = parse_job(doc)
    assert job.spec.environments is None and sandbox_pool(job.spec) is not None  # one default replica
    kinds = {(o["kind"], o["metadata"]["name"]) for o in envs.environment_children(job, UID, SANDBOX_TOKEN)}
    assert ("Secret", "tiny-grpo-k8s-sandbox-token") in kinds and ("NetworkPolicy", "tiny-grpo-k8s-env") in kinds
    pod = envs.environment_pod(job, UID, 0)
    (c,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["reward"]["configMap"]["name"] == "tiny-grpo-k8s-reward"  # the job's copy, never the user's
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {mf.REWARD_MOUNT}
    assert mf.resolved_job(job).spec.models.reward.function.path.startswith(mf.REWARD_MOUNT + "/")
    assert mf.environment_urls(job) == [f"http://env-0.tiny-grpo-k8s-env.default.svc:{mf.ENVIRONMENT_PORT}"]


def _reward_and_agent_job(allow_partial: bool):
    job = _job()
    doc = job.model_dump(by_alias=True, exclude_none=True)
    doc["spec"]["models"]["reward"] = {"type": "function", "function": {"path": "reward.py", "name": "score"}}
    doc["spec"]["sandbox"] = {"allowPartial": allow_partial}
    return parse_job(doc)


def test_a_partial_sandbox_scores_reward_functions_in_a_pod_apart_from_the_models_code():
    """N2: without user and process namespaces (allowPartial), the model's code (the python tool, a tool or an
    environment fed its actions) would run as the reward workers' user in their pod; the pool gets one more pod
    that scores reward functions and mounts nothing else, and the others never mount the reward file."""
    job = _reward_and_agent_job(allow_partial=True)
    pods = [envs.environment_pod(job, UID, i) for i in range(4)]  # 3 replicas for the agent, one for rewards
    serves = [p["spec"]["containers"][0]["command"][-1] for p in pods]
    assert serves == ["agents", "agents", "agents", "rewards"]
    files = [{i["key"] for i in next(v for v in p["spec"]["volumes"] if v["name"] == "reward")["configMap"]["items"]}
             for p in pods]
    assert files == [{"game.py"}] * 3 + [{"reward.py"}]
    gang = _env(mf.gang_pods(job, UID, 0)[0]["spec"]["containers"][0])
    assert parse_urls(gang[URLS_ENV]) == [f"http://env-{i}.agent-env.ml.svc:{mf.ENVIRONMENT_PORT}" for i in range(3)]
    assert parse_urls(gang[REWARD_URLS_ENV]) == [f"http://env-3.agent-env.ml.svc:{mf.ENVIRONMENT_PORT}"]
    plan = envs.plan_pool(job, "Running", [], creating_gang=True)
    assert plan.create == [0, 1, 2, 3] and plan.status == {"replicas": 4, "pods": 0, "ready": 0}
    for pod in pods:
        kubernetes_validate.validate(pod, "1.33", strict=True)


def test_with_every_sandbox_layer_one_pod_serves_rewards_and_the_agent():
    job = _reward_and_agent_job(allow_partial=False)
    pods = [envs.environment_pod(job, UID, i) for i in range(3)]
    assert not any("--serves" in p["spec"]["containers"][0]["command"] for p in pods)  # as an older image runs it
    assert all("items" not in next(v for v in p["spec"]["volumes"] if v["name"] == "reward")["configMap"]
               for p in pods)
    gang = _env(mf.gang_pods(job, UID, 0)[0]["spec"]["containers"][0])
    assert REWARD_URLS_ENV not in gang and len(parse_urls(gang[URLS_ENV])) == 3
    assert envs.plan_pool(job, "Running", [], creating_gang=True).create == [0, 1, 2]


def test_an_agent_of_built_ins_mounts_no_code_when_rewards_are_apart():
    """An empty `items` list would project every key of the ConfigMap, the reward file among them, into the pods
    that run the model's code: an agent with no file of its own mounts none."""
    job = _job()
    doc = job.model_dump(by_alias=True, exclude_none=True)
    doc["spec"]["rollout"]["agent"] = {"environment": "guess_number", "tools": ["calculator"]}
    doc["spec"]["models"]["reward"] = {"type": "function", "function": {"path": "reward.py", "name": "score"}}
    doc["spec"]["sandbox"] = {"allowPartial": True}
    job = parse_job(doc)
    agents, rewards = envs.environment_pod(job, UID, 0), envs.environment_pod(job, UID, 3)
    assert "reward" not in {v["name"] for v in agents["spec"]["volumes"]}
    assert [v["configMap"]["items"] for v in rewards["spec"]["volumes"] if v["name"] == "reward"] == \
        [[{"key": "reward.py", "path": "reward.py"}]]


def test_sandbox_pods_started_with_a_token_made_anew_since_are_replaced():
    """N3, level-triggered: a pod annotated with another sandbox token Secret uid than the job's now is deleted
    (and made again under its name once gone), at every tick until none is left; a pod an older operator made,
    without the annotation, is left alone."""
    job = _job()
    pod = envs.environment_pod(job, UID, 0, token_uid="old-uid")
    assert pod["metadata"]["annotations"][envs.TOKEN_UID_ANNOTATION] == "old-uid"
    views = [PodView(name=f"agent-env-{i}", role="environment", generation=0, phase="Running", token_uid=t)
             for i, t in enumerate(("old-uid", "new-uid", ""))]
    plan = envs.plan_pool(job, "Running", views, creating_gang=False, token_uid="new-uid")
    assert plan.delete == ["agent-env-0"] and plan.create == []
    assert envs.plan_pool(job, "Running", views, creating_gang=False, token_uid="").delete == []


def _program_job(**changes):
    """_job with an agent program (a key of the code ConfigMap) instead of its tools and environment."""
    doc = _job().model_dump(by_alias=True, exclude_none=True)
    doc["spec"]["rollout"]["agent"] = {"program": "agent.py"}
    for key, value in changes.items():
        doc["spec"][key] = value
    return parse_job(doc)


def test_an_agent_program_runs_in_the_pool_which_holds_its_file():
    job = _program_job()
    assert mf.code_keys(job) == {"agent.py": "spec.rollout.agent.program"}  # copied at acceptance, pinned
    assert mf.resolved_job(job).spec.rollout.agent.program == f"{mf.REWARD_MOUNT}/agent.py"  # accepted, not refused
    pod = envs.environment_pod(job, UID, 0)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["reward"]["configMap"]["name"] == "agent-reward"  # the job's copy, never the user's ConfigMap
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["reward"] == {"name": "reward", "mountPath": mf.REWARD_MOUNT, "readOnly": True}
    # a pool split in two (allowPartial): the program reaches the agents' replicas only, the reward file the others
    split = _program_job(models={**job.model_dump(by_alias=True)["spec"]["models"],
                                 "reward": {"type": "function", "function": {"path": "reward.py", "name": "score"}}},
                         sandbox={"allowPartial": True})
    items = [[i["key"] for i in next(v for v in envs.environment_pod(split, UID, i)["spec"]["volumes"]
                                      if v["name"] == "reward")["configMap"]["items"]] for i in (0, 3)]
    assert items == [["agent.py"], ["reward.py"]]


def test_sandbox_pods_may_call_the_rollout_endpoint_back_on_its_ports_only():
    job = _program_job()
    objs = _children(job)
    for obj in objs:
        if obj["kind"] != "PodGroup":
            kubernetes_validate.validate(obj, "1.33", strict=True)  # endPort included
    ports = [{"protocol": "TCP", "port": mf.AGENT_ENDPOINT_PORTS[0], "endPort": mf.AGENT_ENDPOINT_PORTS[1]}]
    policies = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
    labels = {o["metadata"]["name"]: o["metadata"]["labels"] for o in objs if o["kind"] == "Pod"}
    head, worker, sandbox = labels["agent-head-g0"], labels["agent-default-0-g0"], labels["agent-env-0"]
    # the sandbox pods: out to the gang's pods on the endpoint's ports, nowhere else (not even DNS)
    (out,) = policies["agent-env"]["egress"]
    assert out["ports"] == ports and len(out["to"]) == 1
    to = out["to"][0]["podSelector"]
    assert _selects(to, head) and _selects(to, worker) and not _selects(to, sandbox)
    # the gang's pods: in from the job's other pods on any port, from the sandbox pods on those ports only
    own, back = policies["agent-ingress"]["ingress"][:2]
    assert "ports" not in own and not _selects(own["from"][0]["podSelector"], sandbox)
    assert _selects(own["from"][0]["podSelector"], worker)
    assert back["ports"] == ports and _selects(back["from"][0]["podSelector"], sandbox)
    assert not _selects(back["from"][0]["podSelector"], head)
    # the rollout's endpoint takes a port of that range at the pod's address (the names the runtime reads)
    assert (mf.ENDPOINT_PORTS_ENV, mf.POD_IP_ENV) == (ENDPOINT_PORTS_ENV, POD_IP_ENV)
    for name in ("agent-head-g0", "agent-default-0-g0"):
        pod = next(o for o in objs if o["metadata"]["name"] == name)
        env = _env(pod["spec"]["containers"][0])
        assert env[ENDPOINT_PORTS_ENV] == "8400-8463" and POD_IP_ENV in env
    # the sandbox pods' relays connect to those ports alone (the request names the address: a token holder may not
    # point them at another port of the gang's pods, nor at the sandbox pod's own loopback, which no policy sees)
    assert _env(next(o for o in objs if o["metadata"]["name"] == "agent-env-0")["spec"]["containers"][0])[
        ENDPOINT_PORTS_ENV] == "8400-8463"
    # a job without a program: the sandbox pods reach nothing, and nothing of theirs reaches the gang
    plain = _children(_job())
    policies = {o["metadata"]["name"]: o["spec"] for o in plain if o["kind"] == "NetworkPolicy"}
    assert policies["agent-env"]["egress"] == []
    assert not any(_selects(p["podSelector"], sandbox) for rule in policies["agent-ingress"]["ingress"]
                   for p in rule["from"] if "podSelector" in p)
    assert all(ENDPOINT_PORTS_ENV not in _env(c) for o in plain if o["kind"] == "Pod" for c in o["spec"]["containers"])
