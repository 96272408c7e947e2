"""The operator's manifests, validated with the official schemas: pods, their security, tokens, volumes,
credentials and NetworkPolicies."""
import base64
import json
import re

import kubernetes_validate
import pytest
import yaml

from hybridflow.api import parse_job, pool_resource
from hybridflow_operator import manifests as mf
from support.operator_views import NOW, ROOT, K8S_VERSIONS, _raw, _all_manifests, TOKEN, _files_job, _pods


@pytest.mark.parametrize("example", ["tiny-grpo.yaml", "gpu-grpo-7b.yaml", "tiny-ppo.yaml"])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_strictly(example, version):
    for obj in _all_manifests(_raw(example)):
        if obj["kind"] == "PodGroup":  # a Volcano CRD: not in the official schemas; checked below
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_unknown_fields():
    pod = next(o for o in _all_manifests(_raw("tiny-grpo.yaml")) if o["kind"] == "Pod")
    pod["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, K8S_VERSIONS[-1], strict=True)


def test_gang_and_pod_details():
    raw = _raw("gpu-grpo-7b.yaml")
    job = parse_job(raw)
    objs = _all_manifests(raw)
    pods = [o for o in objs if o["kind"] == "Pod"]
    assert len(pods) == 3  # head + 2 GPU nodes
    pg = next(o for o in objs if o["kind"] == "PodGroup")
    assert pg["spec"]["minMember"] == 3
    worker = next(p for p in pods if p["metadata"]["labels"][mf.LABEL_ROLE] == "worker")
    spec = worker["spec"]
    assert spec["schedulerName"] == "volcano" and spec["priorityClassName"] == "high-priority"
    assert worker["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "qwen2-7b-grpo-gang"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    main = spec["containers"][0]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pool_resource("gpus") in main["command"][-1] and "--num-gpus=8" in main["command"][-1]
    assert spec["initContainers"][0]["name"] == "wait-for-head"
    assert "qwen2-7b-grpo-head.ml.svc" in spec["initContainers"][0]["command"][-1]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == "rlhf-checkpoints"
    assert vols["models"]["persistentVolumeClaim"]["readOnly"] is True
    for o in objs:
        ref = o["metadata"]["ownerReferences"][0]
        assert ref["uid"] == "1234-abcd" and ref["controller"] is True
        assert o["metadata"]["labels"][mf.LABEL_JOB] == "qwen2-7b-grpo"
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    resolved = json.loads(cm["data"][mf.SPEC_KEY])
    assert resolved["spec"]["trainer"]["checkpointDir"] == f"{mf.CHECKPOINT_MOUNT}/ml/qwen2-7b-grpo"  # the job's own
    assert resolved["spec"]["metrics"]["address"] == "0.0.0.0"
    assert parse_job(resolved).spec == mf.resolved_job(job).spec
    head = next(p for p in pods if p["metadata"]["labels"][mf.LABEL_ROLE] == "head")
    script = head["spec"]["containers"][0]["command"][-1]
    assert "exec hybridflow driver /etc/hybridflow/job.json " in script  # JSON only: no YAML spec to fall back to
    assert "job.yaml" not in script
    assert not any("nvidia.com/gpu" in str(c.get("resources")) for c in head["spec"]["containers"])


def test_ray_auth_is_always_on_with_the_jobs_own_token_or_the_users_secret():
    raw = _raw("tiny-grpo.yaml")
    objs = _all_manifests(raw)
    secret = next(o for o in objs if o["kind"] == "Secret")
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN
    assert secret["metadata"]["name"] == "tiny-grpo-ray-token" and secret["metadata"]["ownerReferences"][0]["controller"]
    for pod in (o for o in objs if o["kind"] == "Pod"):
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            env = {e["name"]: e for e in c["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "tiny-grpo-ray-token", "key": "token"}
    raw["spec"]["kubernetes"] = {"rayAuthSecret": "team-ray-token"}
    objs = _all_manifests(raw)
    assert not [o for o in objs if o["kind"] == "Secret"], "a user's Secret is used, not a second one made"
    env = {e["name"]: e for e in objs[-1]["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "team-ray-token", "key": "token"}


def test_network_policy_admits_the_jobs_pods_and_the_scrapers_metrics_port_only():
    raw = _raw("tiny-grpo.yaml")
    np = next(o for o in _all_manifests(raw) if o["kind"] == "NetworkPolicy")
    spec = np["spec"]
    assert spec["podSelector"] == {"matchLabels": {mf.LABEL_JOB: "tiny-grpo"}}
    assert spec["policyTypes"] == ["Ingress", "Egress"]  # egress: test_job_egress_... below
    own, scrapers = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {mf.LABEL_JOB: "tiny-grpo"}}}]}  # every port, own pods
    assert scrapers["ports"] == [{"protocol": "TCP", "port": 8000}]
    sel = scrapers["from"][0]["namespaceSelector"]["matchExpressions"][0]
    assert sel["key"] == "kubernetes.io/metadata.name" and sel["values"] == ["hybridflow-system", "monitoring"]
    raw["spec"]["metrics"] = {"port": 9100}
    np = next(o for o in _all_manifests(raw) if o["kind"] == "NetworkPolicy")
    assert np["spec"]["ingress"][1]["ports"] == [{"protocol": "TCP", "port": 9100}]


@pytest.mark.parametrize("port, served", [(0, 8000), (9100, 9100)])
def test_the_driver_serves_metrics_on_kubernetes_where_the_operator_polls_them_even_for_port_0(port, served):
    """spec.metrics.port 0 turns metrics off for a local run (the examples set it); on a cluster the operator follows
    the job's steps there, and a job it could not poll would be Stalled at every deadline."""
    from hybridflow_operator.phases import PodView
    from hybridflow_operator.reconcile import _poll_progress

    raw = _raw("tiny-gspo.yaml", metrics={"port": port})
    objs = _all_manifests(raw)
    head = next(o for o in objs if o["kind"] == "Pod" and o["metadata"]["labels"][mf.LABEL_ROLE] == "head")
    controller = head["spec"]["containers"][0]
    assert f"--metrics-port={served}" in controller["command"][-1]
    assert {"name": "metrics", "containerPort": served} in controller["ports"]
    service = next(o for o in objs if o["kind"] == "Service")
    assert {"name": "metrics", "port": served, "protocol": "TCP"} in service["spec"]["ports"]
    np = next(o for o in objs if o["kind"] == "NetworkPolicy")
    assert np["spec"]["ingress"][1]["ports"] == [{"protocol": "TCP", "port": served}]

    class RecordingPoller:  # stands in for the HTTP poller (tested in test_progress_polling): what it is asked
        asked: list = []

        def poll(self, key, ip, port, target):
            self.asked.append((ip, port, target))

        def forget(self, key):
            self.asked.append("forgotten")

    view = PodView(name="tiny-gspo-head-g0", role="head", generation=0, phase="Running")
    poller = RecordingPoller()
    _poll_progress(poller, "ml", parse_job(raw), [{"view": view, "podIP": "10.0.0.7"}], {}, NOW)
    assert poller.asked == [("10.0.0.7", served, "tiny-gspo-head-g0")]


def _restricted_problems(pod: dict) -> list[str]:
    """The Pod Security Standard `restricted` (v1.30+ rules), checked field by field as the API server's Pod
    Security admission does, plus what this project asks beyond it (read-only root, bounded scratch)."""
    spec, out = pod["spec"], []
    psc = spec.get("securityContext") or {}
    for v in spec.get("volumes", []):
        allowed = {"configMap", "emptyDir", "persistentVolumeClaim", "secret", "projected", "downwardAPI",
                   "csi", "ephemeral"}
        if not set(v) - {"name"} <= allowed:
            out.append(f"volume {v['name']} kind not allowed")
        if "emptyDir" in v and not v["emptyDir"].get("sizeLimit"):
            out.append(f"emptyDir {v['name']} has no sizeLimit")
    if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
        out.append("host namespaces")
    if spec.get("automountServiceAccountToken") is not False:
        out.append("service account token mounted")
    if (psc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        out.append("pod seccompProfile")
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            out.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        if "ALL" not in (sc.get("capabilities") or {}).get("drop", []):
            out.append(f"{name}: capabilities not dropped")
        if set((sc.get("capabilities") or {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities added")
        if sc.get("seccompProfile", {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile")
        if not sc.get("readOnlyRootFilesystem"):
            out.append(f"{name}: writable root filesystem")
        if not (c.get("resources") or {}).get("limits", {}).get("ephemeral-storage"):
            out.append(f"{name}: no ephemeral-storage limit")
        if not (c.get("resources") or {}).get("requests", {}).get("ephemeral-storage"):
            out.append(f"{name}: no ephemeral-storage request (the limit would become the request)")
        if c.get("workingDir") != "/tmp":
            out.append(f"{name}: works in a read-only directory")
        for p in c.get("ports", []):
            if p.get("hostPort"):
                out.append(f"{name}: hostPort")
    return out


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_pod_of_every_example_meets_the_restricted_pod_security_standard(example):
    pods = [o for o in _all_manifests(_raw(example)) if o["kind"] == "Pod"]
    assert pods
    for pod in pods:
        assert _restricted_problems(pod) == [], pod["metadata"]["name"]
        mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert {"/tmp", "/dev/shm", mf.MODEL_CACHE} <= mounts  # where Ray, vLLM and torch write


def test_the_restricted_check_catches_a_pod_that_breaks_it():
    pod = next(o for o in _all_manifests(_raw("tiny-grpo.yaml")) if o["kind"] == "Pod")
    pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    pod["spec"]["volumes"].append({"name": "x", "emptyDir": {}})
    pod["spec"].pop("automountServiceAccountToken")
    assert len(_restricted_problems(pod)) == 3


def test_generations_never_collide():
    raw = _raw("tiny-grpo.yaml")
    job = parse_job(raw)
    g0 = {p["metadata"]["name"] for p in mf.gang_pods(job, raw["metadata"]["uid"], 0)}
    g1 = {p["metadata"]["name"] for p in mf.gang_pods(job, raw["metadata"]["uid"], 1)}
    assert not g0 & g1


def test_data_pvc_and_reward_configmap_reach_the_head_only_read_only():
    raw = _files_job(dataPvc="prompts", rewardConfigMap="my-reward")
    objs = _all_manifests(raw)
    head, *workers = [o for o in objs if o["kind"] == "Pod"]
    vols = {v["name"]: v for v in head["spec"]["volumes"]}
    assert vols["data"]["persistentVolumeClaim"] == {"claimName": "prompts", "readOnly": True}
    assert vols["reward"]["configMap"] == {"name": "word-problems-reward"}  # the job's copy, not my-reward itself
    mounts = {m["name"]: m for m in head["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["data"] == {"name": "data", "mountPath": "/data", "readOnly": True}
    assert mounts["reward"]["mountPath"] == "/var/lib/hybridflow/reward" and mounts["reward"]["readOnly"]
    for w in workers:  # rewards and prompts are the driver's: pool pods do not see them
        assert not {"data", "reward"} & {v["name"] for v in w["spec"]["volumes"]}
    for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
        for obj in objs:
            if obj["kind"] != "PodGroup":
                kubernetes_validate.validate(obj, version, strict=True)
    # the spec the driver reads points inside the mounts, and resolving it again changes nothing
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    ran = parse_job(json.loads(cm["data"][mf.SPEC_KEY]))
    assert ran.spec.data.train == ["/data/word_problems/train.jsonl", "/data/more/*.jsonl"]
    assert ran.spec.models.reward.function.path == "/var/lib/hybridflow/reward/word_problem_reward.py"
    assert mf.resolved_job(ran) == ran


@pytest.mark.parametrize("change,message", [
    ({"data": {"source": "files", "train": ["/etc/passwd"], "promptKey": "q"}},
     r"spec.data.train\[0\]: with kubernetes.dataPvc, give a path inside the volume"),
    ({"data": {"source": "files", "train": ["../x.jsonl"]}}, r"spec.data.train\[0\]: .*no '..'"),
])
def test_data_paths_must_stay_inside_the_volume(change, message):
    from hybridflow.api import SpecError

    raw = _files_job(dataPvc="prompts")
    raw["spec"]["data"].update(change["data"])
    with pytest.raises(SpecError, match=message):
        parse_job(raw)


def test_reward_configmap_needs_a_function_named_by_its_key():
    from hybridflow.api import SpecError

    raw = _files_job(rewardConfigMap="my-reward")
    raw["spec"]["models"]["reward"]["function"]["path"] = "rewards/word_problem_reward.py"
    with pytest.raises(SpecError, match=r"function.path: with kubernetes.rewardConfigMap it is the ConfigMap's key"):
        parse_job(raw)
    raw["spec"]["models"]["reward"] = {"type": "scorer", "scorers": [{"name": "math"}]}
    with pytest.raises(SpecError, match=r"rewardConfigMap: holds the job's code files, and this job names none"):
        parse_job(raw)


def test_checkpoint_secret_reaches_the_head_and_every_pool_pod_by_reference():
    raw = _raw("tiny-grpo.yaml", kubernetes={"checkpointSecret": "team-s3"},
               resourcePools=[{"name": "default", "devicesPerNode": 2, "nodes": 2}])
    objs = _all_manifests(raw)
    head, *workers = _pods(objs)
    assert head["metadata"]["labels"][mf.LABEL_ROLE] == "head" and len(workers) == 2
    for pod in (head, *workers):
        for c in pod["spec"]["containers"]:
            assert "envFrom" not in c  # only the credential variables: the Secret's other keys reach nothing
            env = {e["name"]: e for e in c["env"]}
            assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {"secretKeyRef": {
                "name": "team-s3", "key": "AWS_SECRET_ACCESS_KEY", "optional": True}}, pod["metadata"]["name"]
            assert {"AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_REGION"} <= set(env)
            assert "PYTHONPATH" not in env and "LD_PRELOAD" not in env
            assert len(c["env"]) == len(env), "no variable is set twice"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tiny-grpo-ray-token"
        for c in pod["spec"].get("initContainers", []):
            assert not _aws_credentials(c)  # waiting for the head needs none
        assert not [v for v in pod["spec"]["volumes"] if "secret" in v]  # by reference, never mounted or copied
        assert _restricted_problems(pod) == []
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "Secret"] == ["tiny-grpo-ray-token"]
    assert "team-s3" not in json.dumps([o for o in objs if o["kind"] not in ("Pod", "ConfigMap")])  # the spec, pods
    for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
        for pod in (head, *workers):
            kubernetes_validate.validate(pod, version, strict=True)


def _aws_credentials(container: dict) -> list[dict]:
    return [e for e in container["env"] if e["name"].startswith("AWS_") and e["name"] != "AWS_EC2_METADATA_DISABLED"]


def test_no_credentials_without_a_checkpoint_secret():
    for example in ("tiny-grpo.yaml", "gpu-grpo-7b.yaml"):
        for pod in _pods(_all_manifests(_raw(example))):
            for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
                assert "envFrom" not in c, (example, pod["metadata"]["name"], c["name"])
                assert not _aws_credentials(c), (example, c["name"])


@pytest.mark.parametrize("example, k8s", [("tiny-grpo.yaml", {}), ("gpu-grpo-7b.yaml", {}),
                                          ("tiny-grpo.yaml", {"checkpointSecret": "team-s3"})])
def test_no_job_container_asks_the_instance_metadata_service_for_credentials(example, k8s):
    """Issue 24 N3: only kubernetes.checkpointSecret's credentials reach a job; the AWS SDKs in its pods must not
    fall back to the node's instance role (its NetworkPolicy also denies egress to 169.254.0.0/16)."""
    raw = _raw(example, kubernetes={**_raw(example)["spec"].get("kubernetes", {}), **k8s})
    containers = [c for pod in _pods(_all_manifests(raw))
                  for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])]
    assert len(containers) >= 3
    for c in containers:
        assert {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"} in c["env"], c["name"]
        assert [e["name"] for e in c["env"]].count("AWS_EC2_METADATA_DISABLED") == 1, c["name"]


OWN_PODS = {"podSelector": {"matchLabels": {mf.LABEL_JOB: "tiny-grpo"}}}
OBJECT_STORE = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"protocol": "TCP", "port": 443}]}
TRACKER = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 5000}]}


def _egress(raw: dict, egress=None) -> list[dict]:
    job = parse_job(raw)
    (np,) = [o for o in mf.static_children(job, raw["metadata"]["uid"], TOKEN, ["monitoring"], egress)
             if o["kind"] == "NetworkPolicy"]
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(np, version, strict=True)
    return np["spec"]["egress"]


def test_job_egress_reaches_its_own_pods_dns_and_the_object_store_only_for_object_storage_jobs():
    """Issue 24 N4: a job's pods may connect to their own pods, the cluster's DNS, the object store when the job
    checkpoints to one, and the platform's extra rules; nothing else (not the API server, not other tenants, not
    the metadata service: an ipBlock around it gets it as `except`)."""
    from hybridflow_operator.policy import DEFAULT_DNS, Egress

    raw = _raw("tiny-grpo.yaml")
    assert _egress(raw) == [{"to": [OWN_PODS]}, DEFAULT_DNS]  # the operator's defaults, as the chart's values
    egress = Egress(object_store=OBJECT_STORE, extra=(TRACKER,))
    assert _egress(raw, egress) == [{"to": [OWN_PODS]}, DEFAULT_DNS, TRACKER]  # no object store: not its business
    trainer = {**raw["spec"]["trainer"], "checkpointDir": "s3://bucket/runs"}
    s3 = _raw("tiny-grpo.yaml", trainer=trainer, kubernetes={"checkpointSecret": "team-s3"})
    confined = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16", "100.100.100.200/32"]}}],
                "ports": [{"protocol": "TCP", "port": 443}]}
    assert _egress(s3, egress) == [{"to": [OWN_PODS]}, DEFAULT_DNS, confined, TRACKER]
    assert _egress(s3) == [{"to": [OWN_PODS]}, DEFAULT_DNS], "no object store configured: none reachable"


def test_an_ipblock_containing_link_local_gets_it_as_except_and_one_inside_is_refused():
    from hybridflow_operator.policy import Egress, PolicyError, confine_peer, confine_rule

    for cidr, excepts, expected in [
        ("0.0.0.0/0", None, ["169.254.0.0/16", "100.100.100.200/32"]),
        ("::/0", None, ["fe80::/10", "fd00:ec2::254/128", "fd00:ec2::23/128"]),
        ("169.0.0.0/8", ["10.0.0.0/8"], ["10.0.0.0/8", "169.254.0.0/16"]),
        ("169.0.0.0/8", ["169.254.0.0/15"], ["169.254.0.0/15"]),  # a wider except holds it already
        ("0.0.0.0/0", ["169.254.169.254/32"], ["169.254.169.254/32", "169.254.0.0/16", "100.100.100.200/32"]),
        # issue 51 L1: the metadata addresses outside link-local (Alibaba's; AWS's IPv6 service and Pod Identity)
        ("100.64.0.0/10", None, ["100.100.100.200/32"]),
        ("0.0.0.0/0", ["100.100.0.0/16"], ["100.100.0.0/16", "169.254.0.0/16"]),
        ("fd00::/8", None, ["fd00:ec2::254/128", "fd00:ec2::23/128"]),
        ("fd00:ec2::200/120", ["fd00:ec2::254/127"], ["fd00:ec2::254/127"]),
        ("fc00::/7", ["fd00:ec2::/64"], ["fd00:ec2::/64"]),
    ]:
        block = {"cidr": cidr, **({"except": excepts} if excepts else {})}
        assert confine_peer({"ipBlock": block}, "x") == {"ipBlock": {"cidr": cidr, "except": expected}}, cidr
    for peer in ({"ipBlock": {"cidr": "10.0.0.0/8"}}, {"namespaceSelector": {}}, {"podSelector": {"matchLabels": {}}}):
        assert confine_peer(peer, "x") == peer
    for cidr in ("169.254.169.254/32", "169.254.0.0/16", "169.254.20.10", "fe80::1/128"):
        with pytest.raises(PolicyError, match=r"networkPolicy\.egressExtra\[0\]\.to\[1\]\.ipBlock\.cidr .*\(link-local"):
            Egress(extra=({"to": [{"podSelector": {}}, {"ipBlock": {"cidr": cidr}}]},)).rules(object_storage=False)
    for cidr in ("100.100.100.200/32", "fd00:ec2::254", "fd00:ec2::23/128"):
        with pytest.raises(PolicyError, match=r"to\[0\]\.ipBlock\.cidr .* \(a cloud metadata service's address\)"):
            Egress(extra=({"to": [{"ipBlock": {"cidr": cidr}}]},)).rules(object_storage=False)
    with pytest.raises(PolicyError, match=r"networkPolicy\.objectStore\.to\[0\]"):
        Egress(object_store={"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]}).rules(object_storage=True)
    with pytest.raises(PolicyError, match="allows every destination"):
        confine_rule({"ports": [{"port": 443}]}, "networkPolicy.egressExtra[0]")  # no `to`: anywhere
    with pytest.raises(PolicyError, match="not a CIDR"):
        confine_peer({"ipBlock": {"cidr": "metadata.google.internal"}}, "x")


def test_egress_and_the_namespace_label_come_from_the_operators_environment():
    """The chart passes its networkPolicy values as JSON (deployment.yaml); a value the chart should have refused
    stops the operator at start, naming the variable or the rule."""
    from hybridflow_operator.policy import DEFAULT_DNS, NAMESPACE_LABEL, Egress, Policy, PolicyError

    assert Egress.from_env({}) == Egress() and Egress().dns == DEFAULT_DNS
    env = {"HYBRIDFLOW_EGRESS_DNS": json.dumps({"to": [{"podSelector": {}}], "ports": [{"port": 5353}]}),
           "HYBRIDFLOW_EGRESS_OBJECT_STORE": json.dumps(OBJECT_STORE),
           "HYBRIDFLOW_EGRESS_EXTRA": json.dumps([TRACKER]), "HYBRIDFLOW_NAMESPACE_LABEL": NAMESPACE_LABEL}
    policy = Policy.from_env(env)
    assert policy.egress.rules(object_storage=True) == [
        {"to": [{"podSelector": {}}], "ports": [{"port": 5353}]},
        {**OBJECT_STORE, "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16",
                                                                           "100.100.100.200/32"]}}]}, TRACKER]
    assert policy.namespace_label == "hybridflow.io/jobs=enabled"
    assert policy.acts_in({"hybridflow.io/jobs": "enabled", "team": "a"})
    assert not policy.acts_in({"hybridflow.io/jobs": "yes"}) and not policy.acts_in(None)
    assert Policy.from_env({}).acts_in(None), "a namespaced install: every namespace it watches"
    for key, value, message in [
        ("HYBRIDFLOW_EGRESS_EXTRA", "[{to: []}]", "HYBRIDFLOW_EGRESS_EXTRA: not JSON"),
        ("HYBRIDFLOW_EGRESS_EXTRA", json.dumps(TRACKER), "HYBRIDFLOW_EGRESS_EXTRA: a JSON list"),
        ("HYBRIDFLOW_EGRESS_EXTRA", json.dumps([{"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]}]),
         "networkPolicy.egressExtra[0].to[0].ipBlock.cidr 169.254.169.254/32 is inside 169.254.0.0/16"),
        ("HYBRIDFLOW_NAMESPACE_LABEL", "hybridflow.io/jobs", "HYBRIDFLOW_NAMESPACE_LABEL: key=value"),
    ]:
        with pytest.raises(PolicyError, match=re.escape(message)):
            Policy.from_env({key: value})


def _selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) over labels, as the API does."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if not {"In": lambda: labels.get(key) in values, "NotIn": lambda: labels.get(key) not in values,
                "Exists": lambda: key in labels, "DoesNotExist": lambda: key not in labels}[op]():
            return False
    return True


def _peer_matches(peer: dict, policy_ns: str, pod: dict) -> bool:
    """A NetworkPolicyPeer against a pod {"ns", "ns_labels", "labels"}: podSelector alone means the policy's own
    namespace; an ipBlock never names a pod of the cluster here (the job's policy has none towards pods)."""
    if "ipBlock" in peer:
        return False
    in_ns = (_selects(peer["namespaceSelector"], pod["ns_labels"]) if "namespaceSelector" in peer
             else pod["ns"] == policy_ns)
    return in_ns and _selects(peer.get("podSelector") or {}, pod["labels"])


def _rules_admit(rules: list[dict], side: str, policy_ns: str, peer_pod: dict, port: int) -> bool:
    """Whether one of the rules admits peer_pod at `port` (peers or ports empty or absent: every one)."""
    return any((not r.get(side) or any(_peer_matches(p, policy_ns, peer_pod) for p in r[side])) and
               (not r.get("ports") or any(p.get("protocol", "TCP") == "TCP" and p.get("port") == port
                                          for p in r["ports"]))
               for r in rules)


def _np_allows(np: dict, src: dict, dst: dict, port: int) -> bool:
    """Whether the job's NetworkPolicy lets a TCP connection from pod src to pod dst's port through: egress where it
    selects src, ingress where it selects dst (a pod it does not select is not fenced by it)."""
    ns, spec = np["metadata"]["namespace"], np["spec"]

    def fenced(pod: dict, kind: str) -> bool:
        return pod["ns"] == ns and _selects(spec["podSelector"], pod["labels"]) and kind in spec["policyTypes"]

    out_ok = not fenced(src, "Egress") or _rules_admit(spec.get("egress", []), "to", ns, dst, port)
    in_ok = not fenced(dst, "Ingress") or _rules_admit(spec.get("ingress", []), "from", ns, src, port)
    return out_ok and in_ok


def test_the_network_policy_admits_the_weight_stream_between_the_pools_on_any_port_and_no_outsider():
    """The weight stream's gloo group listens on a kernel-picked port at the trainer's rank 0 pod IP, and every
    rollout rank connects to it (and back): the job's NetworkPolicy must let the trainer pool's pods and the rollout
    pool's pods reach each other on any port, and nothing outside the job reach either on such a port."""
    raw = _raw("tiny-async-k8s.yaml")
    objs = _all_manifests(raw)
    (np,) = [o for o in objs if o["kind"] == "NetworkPolicy"]

    def pod(labels: dict, ns: str = "ml") -> dict:
        return {"ns": ns, "ns_labels": {"kubernetes.io/metadata.name": ns}, "labels": labels}

    job_pods = {o["metadata"]["labels"].get(mf.LABEL_POOL, "head"): pod(o["metadata"]["labels"])
                for o in objs if o["kind"] == "Pod"}
    assert set(job_pods) == {"head", "trainer", "rollout"}
    trainer, rollout = job_pods["trainer"], job_pods["rollout"]
    stream_ports = [1024, 29500, 45678, 65535]  # any: the kernel picks it
    for port in stream_ports:
        assert _np_allows(np, trainer, rollout, port) and _np_allows(np, rollout, trainer, port), port
        assert _np_allows(np, job_pods["head"], rollout, port) and _np_allows(np, rollout, job_pods["head"], port)
    outsiders = {
        "a pod of the namespace": pod({"app": "x"}),
        "another job's pod": pod({**trainer["labels"], mf.LABEL_JOB: "other"}),
        "the job's labels in another namespace": pod(trainer["labels"], ns="evil"),
        "a scraper's namespace": pod({"app": "prometheus"}, ns="monitoring"),
        "the operator's namespace": pod({"app": "hybridflow-operator"}, ns="hybridflow-system"),
        "kube-dns": {"ns": "kube-system", "ns_labels": {"kubernetes.io/metadata.name": "kube-system"},
                     "labels": {"k8s-app": "kube-dns"}},
    }
    for what, outsider in outsiders.items():
        for target in (trainer, rollout):
            for port in stream_ports:
                assert not _np_allows(np, outsider, target, port), (what, port)
                assert not _np_allows(np, target, outsider, port), (what, port)  # nor does the stream leak out
    # the one door from outside: the metrics port, from the scrapers' namespaces only
    assert _np_allows(np, outsiders["a scraper's namespace"], job_pods["head"], 8000)
    assert not _np_allows(np, outsiders["a pod of the namespace"], job_pods["head"], 8000)
