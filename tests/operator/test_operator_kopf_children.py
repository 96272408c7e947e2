"""The operator for real: a job's children, each made only from what the job was accepted with and only ever
the job's own: missing inputs, refused creates, the job policy, planted objects and names, sandbox pods and their
token, the code files, and followed children made again."""
import hashlib
import json
import time

import pytest
from kubernetes.client.rest import ApiException

from hybridflow_operator.policy import FOR_JOBS_LABEL
from kube.harness import wait_for
from kube.operator_cluster import (
    job_doc, _wait_ticks, _phase, _message, _reasons, _pod_names, _run_all, _start_running, REWARD,
    client_networking, _operator_requests, _child, _owned_by,
)


def test_missing_reward_configmap_and_pvc_hold_the_job_pending_until_created(cluster):
    """The operator checks what the pods would mount before creating them: the job waits with the reason (one
    event), and starts by itself once the PVC and the ConfigMap with the reward file's key exist."""
    from kubernetes import client

    _, kube, op = cluster
    doc = job_doc("inputs")
    doc["spec"]["models"] = {"actor": {"source": "smollm2"}, "reward": {
        "type": "function", "function": {"path": "my_reward.py"}}}
    doc["spec"]["data"] = {"source": "files", "train": ["train.jsonl"], "promptKey": "question"}
    doc["spec"]["kubernetes"] = {"dataPvc": "prompts", "rewardConfigMap": "my-reward"}
    kube.create_job(doc)
    st = wait_for(lambda: (s := kube.status("inputs")).get("reason") == "InputsMissing" and s, 30, "InputsMissing")
    assert st["phase"] == "Pending" and "PersistentVolumeClaim 'prompts' not found" in st["message"]
    assert "ConfigMap 'my-reward' not found" in st["message"]
    wait_for(lambda: "InputsMissing" in _reasons(kube, "inputs"), 30, "the InputsMissing event")
    _wait_ticks(op, kube, "inputs")  # several more ticks: still no pods, and no second event
    assert kube.pods("inputs") == []
    warned = [e for e in kube.events() if e.reason == "InputsMissing"]
    assert len(warned) == 1, [e.message for e in warned]
    ns = kube.namespace
    kube.core.create_namespaced_persistent_volume_claim(ns, {
        "metadata": {"name": "prompts"}, "spec": {"accessModes": ["ReadOnlyMany"],
                                                  "resources": {"requests": {"storage": "1Gi"}}}})
    kube.core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="my-reward"), data={"other.py": "x = 1\n"}))
    # They exist but their owners never marked them for jobs: naming them in a job must not be enough to mount them,
    # nor to learn what the ConfigMap holds (its keys are not listed before it is marked). (One wait for both: a
    # tick may read the claim just before it was created and the ConfigMap just after.)
    wait_for(lambda: "ConfigMap 'my-reward' is not marked for jobs" in (m := _message(kube, "inputs"))
             and "PersistentVolumeClaim 'prompts' is not marked for jobs" in m, 30,
             lambda: f"the unmarked ConfigMap and claim named; {_message(kube, 'inputs')}")
    assert "other.py" not in _message(kube, "inputs")
    assert kube.pods("inputs") == []
    kube.core.patch_namespaced_persistent_volume_claim("prompts", ns,
                                                       {"metadata": {"labels": {FOR_JOBS_LABEL: "true"}}})
    kube.core.patch_namespaced_config_map("my-reward", ns, {"metadata": {"labels": {FOR_JOBS_LABEL: "true"}}})
    wait_for(lambda: _message(kube, "inputs") == "spec.models.reward.function.path: ConfigMap 'my-reward' has no key "
             "'my_reward.py' (its keys: other.py)", 30,
             lambda: f"the missing key named, once marked; {_message(kube, 'inputs')}")
    assert kube.pods("inputs") == []
    kube.core.patch_namespaced_config_map("my-reward", ns,
                                          {"data": {"my_reward.py": "def compute_score(*a): return 1\n"}})
    wait_for(lambda: len(kube.pods("inputs")) == 3, 30, "pods once the inputs exist")  # + its sandbox pod
    ready = next(c for c in kube.status("inputs")["conditions"] if c["type"] == "InputsReady")
    assert ready["status"] == "True"


def test_refused_pod_creates_are_reported_not_retried_silently(cluster):
    """An admission controller refusing the pods (403: Pod Security, a quota) shows in status and as one event,
    and the job starts once they are admitted; a 422 (invalid) fails the job with the API server's words."""
    api, kube, op = cluster
    api.refuse_creates("pods", 403, 'pods "x" is forbidden: violates PodSecurity "restricted:latest"')
    kube.create_job(job_doc("j403"))
    cond = wait_for(lambda: next((c for c in kube.status("j403").get("conditions", [])
                                  if c["type"] == "CreateRefused" and c["status"] == "True"), None), 30,
                    "a CreateRefused condition")
    assert "violates PodSecurity" in cond["message"] and "(403)" in cond["message"]
    assert kube.status("j403")["phase"] == "Pending"
    wait_for(lambda: "CreateRefused" in _reasons(kube, "j403"), 30, "the CreateRefused event")
    _wait_ticks(op, kube, "j403")  # several refused ticks: still one event
    assert len([e for e in kube.events() if e.reason == "CreateRefused" and e.involved_object.name == "j403"]) == 1
    api.refuse_creates("pods", None)
    wait_for(lambda: len(kube.pods("j403")) == 2, 30, "pods once admitted")
    wait_for(lambda: any(c["type"] == "CreateRefused" and c["status"] == "False"
                         for c in kube.status("j403").get("conditions", [])), 30, "CreateRefused cleared")

    api.refuse_creates("pods", 422, 'Pod "x" is invalid: spec.containers[0].image: Required value')
    kube.create_job(job_doc("j422"))
    st = wait_for(lambda: (s := kube.status("j422")).get("phase") == "Failed" and s, 30, "Failed")
    assert st["reason"] == "CreateRefused" and "spec.containers[0].image: Required value" in st["message"], st
    api.refuse_creates("pods", None)


def test_a_job_breaking_the_clusters_job_policy_fails_before_any_pod(cluster):
    _, kube, _ = cluster
    doc = job_doc("jpolicy")
    doc["spec"]["kubernetes"] = {"image": "docker.io/attacker/miner:latest", "serviceAccountName": "cluster-admin"}
    kube.create_job(doc)
    st = wait_for(lambda: (s := kube.status("jpolicy")).get("phase") == "Failed" and s, 30, "Failed")
    assert "spec.kubernetes.image 'docker.io/attacker/miner:latest' is not under an allowed prefix" in st["message"]
    assert "spec.kubernetes.serviceAccountName 'cluster-admin' is not allowed" in st["message"]
    assert kube.pods("jpolicy") == []


def test_a_run_policy_patched_past_the_job_policy_is_refused_at_the_next_gang_start(cluster):
    """runPolicy may change on a live job, so the policy is judged whenever pods are about to be made: a priority
    class patched in, then a suspend and resume, fails the job instead of granting it."""
    _, kube, _ = cluster
    kube.create_job(job_doc("jlater"))
    wait_for(lambda: len(kube.pods("jlater")) == 2, 30, "the gang")
    kube.patch_job("jlater", {"spec": {"runPolicy": {"priorityClassName": "system-cluster-critical", "suspend": True}}})
    wait_for(lambda: kube.status("jlater").get("phase") == "Suspended", 30, "Suspended")
    kube.patch_job("jlater", {"spec": {"runPolicy": {"suspend": False}}})
    st = wait_for(lambda: (s := kube.status("jlater")).get("phase") == "Failed" and s, 30, "Failed")
    assert "spec.runPolicy.priorityClassName 'system-cluster-critical' is not allowed" in st["message"], st
    assert kube.pods("jlater") == []


def test_a_ray_token_secret_planted_before_the_job_fails_it(cluster):
    """The operator never reads Secrets, so a `<job>-ray-token` someone made first would hand them the token."""
    from kubernetes import client

    _, kube, _ = cluster
    kube.core.create_namespaced_secret(kube.namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name="jplant-ray-token"), string_data={"token": "known-to-the-planter"}))
    kube.create_job(job_doc("jplant"))
    st = wait_for(lambda: (s := kube.status("jplant")).get("phase") == "Failed" and s, 30, "Failed")
    assert f"Secret {kube.namespace}/jplant-ray-token existed before this job started" in st["message"], st
    assert kube.pods("jplant") == []
    kube.delete_job("jplant")  # the operator deletes only the token Secret it made (by the uid its create returned)
    wait_for(lambda: kube.job("jplant") is None, 30, "the job gone")
    assert [s.metadata.name for s in kube.core.list_namespaced_secret(kube.namespace).items] == ["jplant-ray-token"]


def _used(pod) -> set[tuple[str, str]]:
    """(kind, name) of the Secrets, ConfigMaps and PVCs a pod (as the API holds it) uses: volumes and env."""
    spec = pod["spec"]
    out = set()
    for v in spec.get("volumes") or []:
        if "configMap" in v:
            out.add(("ConfigMap", v["configMap"]["name"]))
        if "secret" in v:
            out.add(("Secret", v["secret"]["secretName"]))
        if "persistentVolumeClaim" in v:
            out.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
    for c in spec.get("initContainers", []) + spec["containers"]:
        for e in c.get("env") or []:
            if "secretKeyRef" in (e.get("valueFrom") or {}):
                out.add(("Secret", e["valueFrom"]["secretKeyRef"]["name"]))
        for src in c.get("envFrom") or []:
            out |= {("Secret", src["secretRef"]["name"])} if "secretRef" in src else set()
    return out


def _reward_function_job(kube, name: str, configmap: str, **run_policy) -> None:
    """A job scoring with a reward function from its own marked code ConfigMap: it gets a sandbox pod."""
    from kubernetes import client

    kube.core.create_namespaced_config_map(kube.namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=configmap, labels={FOR_JOBS_LABEL: "true"}),
        data={"my_reward.py": "def compute_score(*a):\n    return 1.0\n"}))
    doc = job_doc(name, **run_policy)
    doc["spec"]["models"] = REWARD
    doc["spec"]["kubernetes"] = {"rewardConfigMap": configmap}
    kube.create_job(doc)


def test_a_sandbox_pod_that_refuses_the_partial_sandbox_fails_the_job_at_once(cluster):
    """A reward function's job on nodes whose pods cannot make namespaces (HYBRIDFLOW_SANDBOX=require, the
    default): its sandbox pod exits EXIT_SANDBOX_UNAVAILABLE, and the job fails saying so instead of remaking the
    pod forever; the gang goes with it."""
    from hybridflow.api import EXIT_SANDBOX_UNAVAILABLE

    _, kube, _ = cluster
    _reward_function_job(kube, "jsb", "rw-sb")
    wait_for(lambda: "jsb-env-0" in _pod_names(kube, "jsb"), 30, "the sandbox pod")
    kube.set_pod_phase("jsb-env-0", "Failed", exit_code=EXIT_SANDBOX_UNAVAILABLE)
    st = wait_for(lambda: (s := kube.status("jsb")).get("phase") == "Failed" and s, 30, "Failed")
    assert st["reason"] == "SandboxUnavailable" and "jsb-env-0 refused" in st["message"], st
    wait_for(lambda: _pod_names(kube, "jsb") == ["jsb-head-g0"], 30, "only the head left, for its logs")
    kube.delete_job("jsb")
    wait_for(lambda: kube.job("jsb") is None, 30, "the job gone")


def test_a_sandbox_pod_remade_mid_run_never_mounts_a_planted_code_configmap(cluster):
    """The job's copy of its code deleted and planted again under its name by someone else (who may write
    ConfigMaps), then a sandbox pod lost: the replacement is not made, and the job fails naming the ConfigMap,
    instead of a new sandbox pod running the planted code on the job's data."""
    from kubernetes import client

    api, kube, _ = cluster
    ns = kube.namespace
    _reward_function_job(kube, "jpl", "rw-pl")
    wait_for(lambda: _pod_names(kube, "jpl") == ["jpl-default-0-g0", "jpl-env-0", "jpl-head-g0"], 30, "the pods")
    for pod in _pod_names(kube, "jpl"):
        kube.set_pod_phase(pod, "Running")
    wait_for(lambda: _phase(kube, "jpl") == "Running", 30, "Running")
    kube.core.delete_namespaced_config_map("jpl-reward", ns)
    kube.core.create_namespaced_config_map(ns, client.V1ConfigMap(  # no owner: the children policy's reach ends
        metadata=client.V1ObjectMeta(name="jpl-reward"),
        data={"my_reward.py": "def compute_score(*a):\n    return 9.0  # planted\n"}))
    kube.set_pod_phase("jpl-env-0", "Failed", exit_code=137)
    st = wait_for(lambda: (s := kube.status("jpl")).get("phase") == "Failed" and s, 30, "Failed")
    assert "jpl-reward" in st["message"], st
    made = [p for p in api.objects("v1/pods", ns) if p["metadata"]["name"] == "jpl-env-0"
            and p["metadata"]["uid"] != ""]
    assert all((p.get("status") or {}).get("phase") == "Failed" for p in made), "a sandbox pod was made again"
    kube.delete_job("jpl")
    wait_for(lambda: kube.job("jpl") is None, 30, "the job gone")
    kube.core.delete_namespaced_config_map("jpl-reward", ns)


def test_a_sandbox_token_made_anew_at_a_gang_start_replaces_the_sandbox_pods_that_hold_the_old_one(cluster):
    """Issue 51 N3: the sandbox pods outlive a gang restart, and read the job's sandbox token from its Secret when
    they start. Deleted, the Secret is made again at the next gang start with a new random token, which the new gang
    reads: the sandbox pods still running would answer it 401 (the job stops on PoolError). They are made again
    with the gang instead; while the Secret stays, a gang restart leaves them alone."""
    api, kube, _ = cluster
    ns = kube.namespace
    name, pool_pod = "jtk", "jtk-env-0"

    def secret():
        return next((s for s in api.objects("v1/secrets", ns) if s["metadata"]["name"] == "jtk-sandbox-token"), None)

    def uid_of(pod):
        return next((p.metadata.uid for p in kube.pods(name) if p.metadata.name == pod), None)

    def restart(generation):
        kube.set_pod_phase(f"jtk-default-0-g{generation - 1}", "Failed", exit_code=1)
        wait_for(lambda: _pod_names(kube, name) == sorted([f"jtk-default-0-g{generation}", pool_pod,
                                                           f"jtk-head-g{generation}"]) and uid_of(pool_pod), 30,
                 lambda: f"generation {generation} and the sandbox pod; {_pod_names(kube, name)}")
        _run_all(kube, name)
        wait_for(lambda: _phase(kube, name) == "Running", 30, "Running")

    _reward_function_job(kube, name, "rw-tk", restartPolicy="gang", backoffLimit=3)
    wait_for(lambda: _pod_names(kube, name) == ["jtk-default-0-g0", pool_pod, "jtk-head-g0"], 30, "the pods")
    _run_all(kube, name)
    wait_for(lambda: _phase(kube, name) == "Running", 30, "Running")
    first, pod_uid = secret(), uid_of(pool_pod)
    assert kube.status(name)["sandboxTokenSecretUid"] == first["metadata"]["uid"]

    restart(1)  # the Secret kept: the sandbox pod keeps running through the gang restart, with the same token
    assert uid_of(pool_pod) == pod_uid and secret()["metadata"]["uid"] == first["metadata"]["uid"]

    kube.core.delete_namespaced_secret("jtk-sandbox-token", ns)
    restart(2)
    again = wait_for(secret, 30, "the Secret made again")
    assert again["data"]["token"] != first["data"]["token"]
    assert kube.status(name)["sandboxTokenSecretUid"] == again["metadata"]["uid"] != first["metadata"]["uid"]
    # the sandbox pod started with the old token is gone, and made again under its name (reading the new one)
    wait_for(lambda: (u := uid_of(pool_pod)) and u != pod_uid, 30, "the sandbox pod made again")
    wait_for(lambda: "SandboxPodsReplaced" in _reasons(kube, name), 30, lambda: f"events: {_reasons(kube, name)}")
    kube.delete_job(name)
    wait_for(lambda: kube.job(name) is None, 30, "the job gone")


def test_objects_added_to_a_suspended_job_never_reach_its_pods(cluster):
    """Issue 24 N1: a job created suspended with no spec.kubernetes, then patched (no API server CEL here, as with a
    CRD rule that cannot see a field added) to name a ServiceAccount-token Secret, object-storage credentials and a
    reward ConfigMap its author may not read, then resumed. The operator accepted the spec when it first saw the job,
    suspended or not: the edit is SpecChangeIgnored, and the pods get none of those objects."""
    from kubernetes import client

    api, kube, _ = cluster
    ns = kube.namespace
    kube.create_job(job_doc("jsneak", suspend=True))
    wait_for(lambda: _phase(kube, "jsneak") == "Suspended", 30, "Suspended")
    cm = next(c for c in api.objects("v1/configmaps", ns) if c["metadata"]["name"] == "jsneak-spec")
    assert kube.status("jsneak")["acceptedSpecDigest"] == \
        "sha256:" + hashlib.sha256(cm["data"]["job.json"].encode()).hexdigest()  # accepted while suspended
    kube.core.create_namespaced_secret(ns, client.V1Secret(
        metadata=client.V1ObjectMeta(name="builder-token", annotations={"kubernetes.io/service-account.name": "b"}),
        type="kubernetes.io/service-account-token", string_data={"token": "eyJhbGciOi.builder"}))
    kube.core.create_namespaced_secret(ns, client.V1Secret(metadata=client.V1ObjectMeta(name="s3-admin"),
                                                           string_data={"AWS_SECRET_ACCESS_KEY": "k"}))
    kube.core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="exfil", labels={FOR_JOBS_LABEL: "true"}),
        data={"my_reward.py": "import os\ndef compute_score(*a): return len(os.environ)\n"}))
    kube.patch_job("jsneak", {"spec": {"models": REWARD, "kubernetes": {
        "rayAuthSecret": "builder-token", "checkpointSecret": "s3-admin", "rewardConfigMap": "exfil"}}})
    wait_for(lambda: any(c["type"] == "SpecChangeIgnored" and c["status"] == "True"
                         for c in kube.status("jsneak").get("conditions", [])), 30, "SpecChangeIgnored")
    kube.patch_job("jsneak", {"spec": {"runPolicy": {"suspend": False}}})
    wait_for(lambda: len(kube.pods("jsneak")) == 2, 30, "the gang")
    for pod in (p for p in api.objects("v1/pods", ns) if p["metadata"]["name"].startswith("jsneak-")):
        assert _used(pod) == {("Secret", "jsneak-ray-token"), ("ConfigMap", "jsneak-spec")}, pod["metadata"]["name"]
    spec = json.loads(next(c for c in api.objects("v1/configmaps", ns)
                           if c["metadata"]["name"] == "jsneak-spec")["data"]["job.json"])["spec"]
    assert "rayAuthSecret" not in json.dumps(spec) and spec["models"]["actor"]["source"] == "tiny"


PLANTED = {
    "Service": ("v1/services", "jsvc", "jsvc-head",
                lambda kube, name: kube.core.create_namespaced_service(kube.namespace, {
                    "metadata": {"name": name}, "spec": {"selector": {"app": "mine"}, "ports": [{"port": 6379}]}})),
    # a job named default-deny would take the namespace's own policy for its `<job>-ingress`
    "NetworkPolicy": ("networking.k8s.io/v1/networkpolicies", "default-deny", "default-deny-ingress",
                      lambda kube, name: client_networking(kube).create_namespaced_network_policy(kube.namespace, {
                          "metadata": {"name": name}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}})),
}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_a_child_name_held_by_someone_elses_object_fails_the_job_which_leaves_it_alone(cluster, kind):
    """Issue 24 N2: an object under a child's name that the job does not control (a `<job>-head` Service planted to
    be the Ray head's address, the namespace's `default-deny-ingress` under a job called `default-deny`) is neither
    adopted (the job fails, naming it) nor deleted with the job."""
    api, kube, _ = cluster
    resource, job, name, plant = PLANTED[kind]
    plant(kube, name)
    before = next(o for o in api.objects(resource, kube.namespace) if o["metadata"]["name"] == name)
    kube.create_job(job_doc(job))
    st = wait_for(lambda: (s := kube.status(job)).get("phase") == "Failed" and s, 30, "Failed")
    assert f"{kind} {kube.namespace}/{name} exists but was not made for this job" in st["message"], st
    assert kube.pods(job) == []
    kube.delete_job(job)
    wait_for(lambda: kube.job(job) is None, 30, "the job gone")
    after = [o for o in api.objects(resource, kube.namespace) if o["metadata"]["name"] == name]
    assert [o["metadata"]["uid"] for o in after] == [before["metadata"]["uid"]], "the job's deletion took it"
    assert not api.objects("v1/configmaps", kube.namespace), "the job's own children went with it"


def test_a_pod_name_held_by_someone_elses_pod_is_a_condition_naming_it_not_a_silent_wait(cluster):
    """Issue 51 L4: a pod under the name of one of the job's pods (another owner, no job label) is never counted as
    the job's; its create's 409 is condition CreateRefused (PodNameTaken) naming it, and an event, while the job
    waits in Pending; once that pod is gone the job's own is made."""
    api, kube, _ = cluster
    kube.core.create_namespaced_pod(kube.namespace, {
        "metadata": {"name": "jsquat-head-g0", "labels": {"app": "mine"}},
        "spec": {"containers": [{"name": "c", "image": "busybox:1"}]}})
    kube.create_job(job_doc("jsquat"))
    cond = wait_for(lambda: next((c for c in kube.status("jsquat").get("conditions", [])
                                  if c["type"] == "CreateRefused" and c["status"] == "True"), None), 30,
                    "a CreateRefused condition")
    assert cond["reason"] == "PodNameTaken", cond
    assert cond["message"].startswith(f"pod {kube.namespace}/jsquat-head-g0 exists but was not made for this job"), cond
    assert kube.status("jsquat")["phase"] == "Pending"
    wait_for(lambda: "PodNameTaken" in _reasons(kube, "jsquat"), 30, "the PodNameTaken event")
    assert [p.metadata.name for p in kube.pods("jsquat")] == ["jsquat-default-0-g0"], "the others are made"
    squatter = next(o for o in api.objects("v1/pods", kube.namespace) if o["metadata"]["name"] == "jsquat-head-g0")
    assert "ownerReferences" not in squatter["metadata"], "never adopted"
    kube.core.delete_namespaced_pod("jsquat-head-g0", kube.namespace)
    wait_for(lambda: len(kube.pods("jsquat")) == 2, 30, "the job's own head pod once the name is free")
    wait_for(lambda: any(c["type"] == "CreateRefused" and c["status"] == "False"
                         for c in kube.status("jsquat").get("conditions", [])), 30, "CreateRefused cleared")


def test_the_code_files_are_copied_at_acceptance_and_later_edits_change_nothing(cluster):
    """Issue 24 N5, issue 51 M5: every code file of the job (the reward function, the agent's tools and environment
    files: keys of kubernetes.rewardConfigMap) is copied, when the operator first finds them all, into the job's own
    immutable ConfigMap, their digests in status; the head and the sandbox pod mount that copy. A key missing from
    the user's ConfigMap holds the job Pending, naming it. An edit of the user's ConfigMap afterwards reaches
    neither the running pods, nor the next gang, nor a sandbox pod made again."""
    from kubernetes import client

    api, kube, _ = cluster
    ns = kube.namespace
    files = {"my_reward.py": "def compute_score(*a):\n    return 1.0\n",
             "tools.py": "def add(a: int, b: int) -> int:\n    \"\"\"Adds.\"\"\"\n    return a + b\n",
             "game.py": "class Environment:\n    def reset(self, sample):\n        return ''\n"}
    kube.core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="rw", labels={FOR_JOBS_LABEL: "true"}),
        data={k: v for k, v in files.items() if k != "game.py"}))
    doc = job_doc("jrw")
    doc["spec"]["models"] = REWARD
    doc["spec"]["data"] = {"task": "arithmetic"}
    doc["spec"]["rollout"]["agent"] = {"toolsFile": "tools.py", "environmentFile": "game.py"}
    doc["spec"]["kubernetes"] = {"rewardConfigMap": "rw"}
    kube.create_job(doc)
    wait_for(lambda: _message(kube, "jrw") == "spec.rollout.agent.environmentFile: ConfigMap 'rw' has no key "
             "'game.py' (its keys: my_reward.py, tools.py)", 30, lambda: f"the missing key; {_message(kube, 'jrw')}")
    assert kube.pods("jrw") == [] and "codeDigests" not in kube.status("jrw")
    kube.core.patch_namespaced_config_map("rw", ns, {"data": {"game.py": files["game.py"]}})
    wait_for(lambda: len(kube.pods("jrw")) == 3, 30, "the gang and its sandbox pod")
    digests = {k: "sha256:" + hashlib.sha256(v.encode()).hexdigest() for k, v in files.items()}

    def mounted(*pods):
        copy_ = next(c for c in api.objects("v1/configmaps", ns) if c["metadata"]["name"] == "jrw-reward")
        assert copy_["data"] == files and copy_["immutable"] is True
        assert copy_["metadata"]["ownerReferences"][0]["uid"] == kube.job("jrw")["metadata"]["uid"]
        st = kube.status("jrw")
        assert st["codeDigests"] == digests and st["rewardDigest"] == digests["my_reward.py"]
        for name in pods:
            pod = next(p for p in api.objects("v1/pods", ns) if p["metadata"]["name"] == name)
            assert ("ConfigMap", "jrw-reward") in _used(pod) and ("ConfigMap", "rw") not in _used(pod), name
        return next(p for p in api.objects("v1/pods", ns) if p["metadata"]["name"] == "jrw-env-0")

    sandbox = mounted("jrw-head-g0", "jrw-env-0")
    # the user's code runs in the sandbox pod: the copy, its own token, none of the job's credentials, no claim
    assert _used(sandbox) == {("ConfigMap", "jrw-reward"), ("ConfigMap", "jrw-spec"),
                              ("Secret", "jrw-sandbox-token")}, _used(sandbox)
    spec = json.loads(next(c for c in api.objects("v1/configmaps", ns)
                           if c["metadata"]["name"] == "jrw-spec")["data"]["job.json"])["spec"]
    assert spec["rollout"]["agent"]["toolsFile"] == "/var/lib/hybridflow/reward/tools.py"
    assert spec["rollout"]["agent"]["environmentFile"] == "/var/lib/hybridflow/reward/game.py"
    kube.core.patch_namespaced_config_map("rw", ns, {"data": {k: "import os  # the edit\n" for k in files}})
    kube.set_pod_phase("jrw-default-0-g0", "Failed", exit_code=1)
    kube.set_pod_phase("jrw-env-0", "Failed", exit_code=1)
    wait_for(lambda: _pod_names(kube, "jrw") == ["jrw-default-0-g1", "jrw-env-0", "jrw-head-g1"] and
             next(p for p in kube.pods("jrw") if p.metadata.name == "jrw-env-0").metadata.uid
             != sandbox["metadata"]["uid"], 30, "generation 1 and a new sandbox pod")
    mounted("jrw-head-g1", "jrw-env-0")
    kube.delete_job("jrw")
    wait_for(lambda: kube.job("jrw") is None, 30, "the job gone")
    assert [c["metadata"]["name"] for c in api.objects("v1/configmaps", ns)] == ["rw"]
    assert not [x["metadata"]["name"] for x in api.objects("v1/secrets", ns) if x["metadata"]["name"].startswith("jrw-")]


def test_the_api_double_deletes_with_a_uid_precondition_as_the_api_server_does(cluster):
    """What cleanup relies on: a delete whose precondition names another uid is refused, 409 Conflict."""
    from kubernetes import client

    _, kube, _ = cluster
    made = kube.core.create_namespaced_config_map(kube.namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="x"), data={"a": "b"}))
    with pytest.raises(ApiException) as refused:
        kube.core.delete_namespaced_config_map("x", kube.namespace, body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid="another-uid")))
    assert refused.value.status == 409 and json.loads(refused.value.body)["reason"] == "Conflict"
    assert "Precondition failed: UID in precondition: another-uid" in json.loads(refused.value.body)["message"]
    assert kube.core.read_namespaced_config_map("x", kube.namespace).metadata.uid == made.metadata.uid
    kube.core.delete_namespaced_config_map("x", kube.namespace, body=client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=made.metadata.uid)))
    assert [c.metadata.name for c in kube.core.list_namespaced_config_map(kube.namespace).items] == []


def test_a_running_jobs_deleted_network_policy_and_head_service_come_back_at_its_next_tick(cluster):
    """Issue 24 N8 follow-up: children are created once per gang start, so a NetworkPolicy or head Service deleted
    while the job runs stayed gone (its pods unfenced, the head's name unresolvable) until the next one. Both are
    followed by a watch: they come back at the next tick, owned by the job and as they were, with a ChildRecreated
    warning, at one POST each; following them costs a Running job no request while nothing changes."""
    api, kube, op = cluster
    _start_running(kube, "jkeep")
    uid = kube.job("jkeep")["metadata"]["uid"]
    before = {kind: _child(api, kube, kind, name) for kind, name in
              (("Service", "jkeep-head"), ("NetworkPolicy", "jkeep-ingress"))}
    _wait_ticks(op, kube, "jkeep", n=2)  # the write that made it Running has come back by the watch
    since = len(api.handler.log)
    _wait_ticks(op, kube, "jkeep", n=8)  # 2 s of ticks
    steady = _operator_requests(api, kube.namespace, since)
    assert steady == [], [(r.method, r.plural, r.status) for r in steady]

    since, t0 = len(api.handler.log), time.monotonic()
    kube.core.delete_namespaced_service("jkeep-head", kube.namespace)
    client_networking(kube).delete_namespaced_network_policy("jkeep-ingress", kube.namespace)
    back = wait_for(lambda: (now := {k: _child(api, kube, k, o["metadata"]["name"]) for k, o in before.items()})
                    and all(now.values()) and now, 30, "the Service and the NetworkPolicy made again")
    took = time.monotonic() - t0
    for kind, obj in back.items():
        assert obj["metadata"]["uid"] != before[kind]["metadata"]["uid"], kind
        assert _owned_by(obj, uid), obj["metadata"]
        assert obj["spec"] == before[kind]["spec"], kind  # the same fence, the same head selector
    assert took < 3, f"made again {took:.1f} s after the deletion; ticks are 0.25 s apart"
    wait_for(lambda: _reasons(kube, "jkeep").count("ChildRecreated") == 2, 30, "a ChildRecreated event for each")
    _wait_ticks(op, kube, "jkeep", n=8)  # and nothing more once they are back
    made = [(r.method, r.plural) for r in _operator_requests(api, kube.namespace, since) if r.plural != "events"]
    assert sorted(made) == [("POST", "networkpolicies"), ("POST", "services")], made
    assert _phase(kube, "jkeep") == "Running"
