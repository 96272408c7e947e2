"""The cluster's job policy (chart values `jobPolicy`): the operator's check and the ValidatingAdmissionPolicy the
chart ships must give every job the same verdict. The API double runs no CEL, so the policy's expressions are
evaluated here with cel-python, on the chart as rendered, for the operator as the rendered Deployment configures
it."""
import copy

import celpy
import pytest
import yaml

from hybridflow.api import Kubernetes, parse_job
from hybridflow_operator.manifests import CONTAINER_SECURITY
from hybridflow_operator.policy import FOR_JOBS_LABEL, Policy, unmarked, violations

from support.helm import CHART, helm, run_helm
from support.paths import ROOT

GPU = yaml.safe_load((ROOT / "examples" / "gpu-grpo-7b.yaml").read_text())
TINY = yaml.safe_load((ROOT / "examples" / "tiny-grpo-k8s.yaml").read_text())

OPEN = ["--set", "jobPolicy.allowedImages={registry.example.com/ml,hybridflow/}",  # one without its slash
        "--set", "jobPolicy.requireImageDigest=true", "--set", "jobPolicy.allowedServiceAccounts={trainer}",
        "--set", "jobPolicy.allowedPriorityClasses={high-priority}", "--set", "jobPolicy.allowTolerations=true",
        "--set", "jobPolicy.allowAffinity=true", "--set", "jobPolicy.allowedSchedulers={volcano,default-scheduler}",
        "--set", "jobPolicy.allowedRuntimeClasses={kata}"]


def _rendered(values: list[str]) -> tuple[list[dict], Policy]:
    """The policies that judge an RLHFJob (the job policy and the job-secrets policy), and the operator's Policy as
    the rendered Deployment configures it."""
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--namespace", "hf", *values)) if d]
    vaps = [next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith(suffix))
            for suffix in ("-job-secrets", "-job-policy")]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value", "") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    return vaps, Policy.from_env(env)


class AuthorizerDouble:
    """Stands in for the API server's CEL `authorizer` (what the requesting user may do), which only a real API
    server has: `readable` holds the (resource, namespace, name) the job's author may `get`."""

    def __init__(self, readable: set[tuple[str, str, str]] = frozenset()) -> None:
        self.readable = readable

    def functions(self) -> dict:
        def step(key):
            return lambda target, value: _cel_map({**_py(target), key: str(value)})

        def check(target, verb):
            t = _py(target)
            return celpy.celtypes.BoolType(str(verb) == "get" and (t.get("resource"), t.get("namespace"), t.get("name"))
                                           in self.readable)

        return {"group": step("group"), "resource": step("resource"), "namespace": step("namespace"),
                "name": step("name"), "check": check, "allowed": lambda decision: decision}


def _cel_map(d: dict) -> "celpy.celtypes.MapType":
    return celpy.celtypes.MapType({celpy.celtypes.StringType(k): celpy.celtypes.StringType(v) for k, v in d.items()})


def _py(m) -> dict:
    return {str(k): str(v) for k, v in m.items()}


def admitted(vap: dict | list[dict], doc: dict, authorizer: AuthorizerDouble | None = None, namespace: str = "ml",
             old: dict | None = None, user: str = "alice", namespace_labels: dict | None = None,
             resource: str = "") -> bool:
    """The API server's verdict: the policy's variables, then every validation, evaluated as CEL."""
    return not refusals(vap, doc, authorizer, namespace, old, user, namespace_labels, resource)


def refusals(vap: dict | list[dict], doc: dict, authorizer: AuthorizerDouble | None = None, namespace: str = "ml",
             old: dict | None = None, user: str = "alice", namespace_labels: dict | None = None,
             resource: str = "") -> list[str]:
    """The message (or messageExpression) of every validation that refuses the request: CREATE, or an UPDATE of
    `old` when given. A request of an operation the policy does not match, or one that a matchCondition leaves
    out, is not judged at all. `namespaceObject` is the request's namespace with `namespace_labels` (plus the
    kubernetes.io/metadata.name label every namespace carries); `resource`, request.resource.resource. A list of
    policies: the refusals of each, in turn."""
    if isinstance(vap, list):
        return [r for one in vap for r in refusals(one, doc, authorizer, namespace, old, user, namespace_labels,
                                                   resource)]
    operation = "CREATE" if old is None else "UPDATE"
    if not any(operation in rule["operations"] for rule in vap["spec"]["matchConstraints"]["resourceRules"]):
        return []
    cel = celpy.Environment()
    functions = (authorizer or AuthorizerDouble()).functions()
    activation = {"object": celpy.json_to_cel(doc), "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel({"namespace": namespace, "userInfo": {"username": user},
                                                "operation": operation, "resource": {"resource": resource}}),
                  "namespaceObject": celpy.json_to_cel({"metadata": {"name": namespace, "labels": {
                      "kubernetes.io/metadata.name": namespace, **(namespace_labels or {})}}}),
                  "authorizer": _cel_map({})}
    for condition in vap["spec"].get("matchConditions", []):
        if not bool(cel.program(cel.compile(condition["expression"]), functions=functions).evaluate(activation)):
            return []
    variables = celpy.celtypes.MapType()  # in order: a variable may use those before it
    for v in vap["spec"].get("variables", []):
        activation["variables"] = variables
        variables[celpy.celtypes.StringType(v["name"])] = cel.program(cel.compile(v["expression"]),
                                                                      functions=functions).evaluate(activation)
    activation["variables"] = variables

    def run(expression: str):
        return cel.program(cel.compile(expression), functions=functions).evaluate(activation)

    return [r.get("message") or str(run(r["messageExpression"])) for r in vap["spec"]["validations"]
            if not bool(run(r["expression"]))]


def _job(base: dict, **paths) -> dict:
    doc = copy.deepcopy(base)
    for path, value in paths.items():
        node = doc["spec"]
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return doc


def _pools(base: dict, **fields) -> dict:
    doc = copy.deepcopy(base)
    for pool in doc["spec"]["resourcePools"]:
        pool.update(fields)
    return doc


PINNED = _job(TINY, **{"kubernetes.image": "hybridflow/worker-cpu@sha256:" + "c" * 64})
AGENT = _job(yaml.safe_load((ROOT / "examples" / "tiny-agent-k8s.yaml").read_text()),
             **{"kubernetes.image": "hybridflow/worker-cpu@sha256:" + "c" * 64})  # with an environment pool

# case -> (job, admitted under the default values, admitted under OPEN)
CASES = {
    "tiny example": (TINY, True, False),  # OPEN wants digests
    "tiny example, pinned": (PINNED, True, True),
    "no kubernetes section (default image)": ({k: v for k, v in TINY.items()} | {"spec": {}}, True, False),
    "image elsewhere": (_job(TINY, **{"kubernetes.image": "docker.io/someone/miner@sha256:" + "a" * 64}),
                        False, False),
    "allowed registry, no digest": (_job(TINY, **{"kubernetes.image": "registry.example.com/ml/w:1"}), False, False),
    "allowed registry, digest": (_job(TINY, **{"kubernetes.image": "registry.example.com/ml/w@sha256:" + "a" * 64}),
                                 False, True),
    "service account": (_job(PINNED, **{"kubernetes.serviceAccountName": "trainer"}), False, True),
    "other service account": (_job(PINNED, **{"kubernetes.serviceAccountName": "admin"}), False, False),
    "priority class": (_job(PINNED, **{"runPolicy.priorityClassName": "high-priority"}), False, True),
    "other priority class": (_job(PINNED, **{"runPolicy.priorityClassName": "system-node-critical"}), False, False),
    "gang scheduling (volcano)": (_job(PINNED, **{"runPolicy.gangScheduling": True}), True, True),
    "default-scheduler": (_job(PINNED, **{"runPolicy.schedulerName": "default-scheduler"}), False, True),
    "another scheduler": (_job(PINNED, **{"runPolicy.schedulerName": "my-scheduler"}), False, False),
    "tolerations": (_pools(PINNED, tolerations=[{"key": "dedicated", "operator": "Exists"}]), False, True),
    "affinity": (_pools(PINNED, affinity={"nodeAffinity": {}}), False, True),
    "nodeSelector": (_pools(PINNED, nodeSelector={"pool": "dedicated"}), False, True),
    "prefix without its boundary": (_job(TINY, **{"kubernetes.image": "hybridflow-evil/x@sha256:" + "d" * 64}),
                                    False, False),
    "registry lookalike": (_job(TINY, **{"kubernetes.image": "registry.example.com.evil.io/ml/w@sha256:" + "e" * 64}),
                           False, False),
    "gpu example": (GPU, False, False),
    # issue 51 M1: the environment pool's own image is judged as kubernetes.image is
    "environment pool on the job's image": (AGENT, True, True),
    "environment image elsewhere": (_job(AGENT, **{"environments.image": "docker.io/someone/miner@sha256:" + "a" * 64}),
                                    False, False),
    "environment image allowed, not pinned": (_job(AGENT, **{"environments.image": "hybridflow/env:1"}), True, False),
    "environment image pinned": (_job(AGENT, **{"environments.image": "hybridflow/env@sha256:" + "f" * 64}), True, True),
    "environment image, prefix without its boundary": (
        _job(AGENT, **{"environments.image": "hybridflow-evil/x@sha256:" + "d" * 64}), False, False),
    # issue 51 N5: the sandbox pods' RuntimeClass, from jobPolicy.allowedRuntimeClasses (OPEN: kata only)
    "sandbox under gVisor": (_job(AGENT, **{"sandbox.runtimeClassName": "gvisor"}), True, False),
    "sandbox under Kata": (_job(AGENT, **{"sandbox.runtimeClassName": "kata"}), True, True),
    "sandbox under Kata on QEMU": (_job(AGENT, **{"sandbox.runtimeClassName": "kata-qemu"}), True, False),
    "sandbox under runc": (_job(AGENT, **{"sandbox.runtimeClassName": "runc"}), False, False),
    "sandbox under a class of the cluster's not allowed": (
        _job(AGENT, **{"sandbox.runtimeClassName": "nvidia-privileged"}), False, False),
}


@pytest.fixture(scope="module")
def charts():
    return {"default": _rendered([]), "open": _rendered(OPEN)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_admission_policy_and_the_operator_agree(charts, case):
    doc, default_ok, open_ok = CASES[case]
    for combo, expected in (("default", default_ok), ("open", open_ok)):
        vap, policy = charts[combo]
        problems = violations(parse_job(copy.deepcopy(doc)), policy)
        assert (not problems) is expected, (combo, problems)
        assert admitted(vap, doc) is expected, combo


def test_the_open_combo_admits_the_gpu_example_once_its_image_is_pinned(charts):
    vap, policy = charts["open"]
    doc = _job(GPU, **{"kubernetes.image": "hybridflow/worker-gpu@sha256:" + "b" * 64})
    assert violations(parse_job(copy.deepcopy(doc)), policy) == [] and admitted(vap, doc)


def test_violations_name_the_field_and_the_chart_value():
    problems = violations(parse_job(_job(TINY, **{"kubernetes.image": "evil/x:1", "runPolicy.priorityClassName": "p"})),
                          Policy())
    assert problems == [
        "spec.kubernetes.image 'evil/x:1' is not under an allowed prefix (hybridflow/; chart value "
        "jobPolicy.allowedImages)",
        "spec.runPolicy.priorityClassName 'p' is not allowed (none; chart value jobPolicy.allowedPriorityClasses)",
    ]


def test_the_policys_default_image_is_the_specs():
    (policy,) = [v for v in _rendered([])[0] if v["metadata"]["name"].endswith("-job-policy")]
    assert f"'{Kubernetes().image}'" in str(policy["spec"]["variables"])


def test_objects_a_job_mounts_must_be_marked_for_jobs():
    p = Policy()
    assert unmarked("ConfigMap", "spec.kubernetes.rewardConfigMap", "r", {FOR_JOBS_LABEL: "true"}, p) is None
    why = unmarked("ConfigMap", "spec.kubernetes.rewardConfigMap", "r", {"team": "a"}, p)
    assert why and f"kubectl label configmap r {FOR_JOBS_LABEL}=true" in why
    assert unmarked("PersistentVolumeClaim", "spec.kubernetes.dataPvc", "d", None,
                    Policy(require_for_jobs_label=False)) is None


def test_a_ray_secret_is_usable_only_by_an_author_who_may_read_it(charts):
    """The confused deputy for Secrets: the pods would get the Secret's token in their environment, so a job may
    name only a Secret its author could read anyway. The operator never reads Secrets; the API server's authorizer
    decides, at `kubectl apply`."""
    vap, _ = charts["default"]
    doc = _job(TINY, **{"kubernetes.rayAuthSecret": "team-token"})
    assert admitted(vap, doc, AuthorizerDouble({("secrets", "ml", "team-token")}))
    assert not admitted(vap, doc, AuthorizerDouble())  # may not read it
    assert not admitted(vap, doc, AuthorizerDouble({("secrets", "other-ns", "team-token")}))
    assert admitted(vap, TINY, AuthorizerDouble())  # no Secret named: the operator makes the job's own


OPERATOR = "system:serviceaccount:hf:rel-hybridflow"  # the chart's operator ServiceAccount for release `rel` in hf
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}  # what a namespace the operator serves must carry


def test_only_the_operator_may_make_objects_that_pass_for_a_jobs_own():
    """A pod labelled as a job's is counted in its gang and let through its NetworkPolicy; a ConfigMap or Secret
    owned by an RLHFJob is taken for the job's own. Only the operator may create such objects, or turn an object
    into one; objects that already were one may be updated by anyone allowed to (kubelet, scheduler, GC)."""
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--namespace", "hf")) if d]
    guard = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                 and d["metadata"]["name"].endswith("-job-children"))
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
    assert OPERATOR.endswith(f":{sa}")
    labelled = {"metadata": {"name": "x", "labels": {"hybridflow.io/job": "victim", "hybridflow.io/role": "head"}}}
    owned = {"metadata": {"name": "victim-spec", "ownerReferences": [
        {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "name": "victim", "uid": "u", "controller": True}]}}
    plain = {"metadata": {"name": "mine", "labels": {"app": "mine"}}}
    assert admitted(guard, labelled, user=OPERATOR) and admitted(guard, owned, user=OPERATOR)
    assert not admitted(guard, labelled) and not admitted(guard, owned)  # someone else creating them
    assert admitted(guard, plain)
    assert not admitted(guard, labelled, old=plain)  # turning one's own pod into the job's
    assert admitted(guard, labelled, old=labelled, user="system:node:n1")  # the kubelet updating a job pod


def test_a_checkpoint_secret_is_usable_only_by_an_author_who_may_read_it(charts):
    """kubernetes.checkpointSecret becomes the pods' environment (envFrom), like the Ray token: a job may name only
    a Secret its author could read anyway (the operator never reads it)."""
    vap, _ = charts["default"]
    doc = _job(TINY, **{"kubernetes.checkpointSecret": "team-s3"})
    assert admitted(vap, doc, AuthorizerDouble({("secrets", "ml", "team-s3")}))
    assert not admitted(vap, doc, AuthorizerDouble())  # may not read it
    assert not admitted(vap, doc, AuthorizerDouble({("secrets", "other-ns", "team-s3")}))
    assert not admitted(vap, _job(doc, **{"kubernetes.rayAuthSecret": "team-token"}),
                        AuthorizerDouble({("secrets", "ml", "team-token")}))  # each Secret is checked
    tracked = _job(TINY, **{"kubernetes.trackingSecret": "team-wandb"})  # the trackers' credentials likewise
    assert admitted(vap, tracked, AuthorizerDouble({("secrets", "ml", "team-wandb")}))
    assert refusals(vap, tracked, AuthorizerDouble()) == [
        "spec.kubernetes.trackingSecret: you may not read Secret team-wandb, so a job of yours may not use it either"]


def test_a_tracking_secret_reaches_the_driver_alone_and_only_its_credential_keys():
    from hybridflow.api import parse_job
    from hybridflow_operator import manifests as mf

    job = parse_job(_job(TINY, **{"kubernetes.trackingSecret": "team-wandb", "resourcePools": [
        {"name": "default", "nodes": 1}]}))
    head, worker = mf.gang_pods(job, "uid", 0)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in head["spec"]["containers"][0]["env"]
            if "secretKeyRef" in e.get("valueFrom", {}) and e["valueFrom"]["secretKeyRef"]["name"] == "team-wandb"}
    assert sorted(refs) == ["MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",
                            "WANDB_API_KEY"] and all(r["optional"] for r in refs.values())
    assert "team-wandb" not in str(worker)  # the pools run no tracker: they get none of it
    assert mf.foreign_references([head, worker], job) == []  # the accepted spec names it


FIXED = ("spec.kubernetes (the Secrets, PVCs, reward ConfigMap and ServiceAccount a job's pods use) is fixed when the "
         "job is created: an update may not add, change or remove any of it; delete and re-create the job")


def _bare_suspended() -> dict:
    """A job with no spec.kubernetes, created suspended: what the Secret attack starts from."""
    doc = _job(TINY, **{"runPolicy.suspend": True})
    del doc["spec"]["kubernetes"]
    return doc


def test_an_update_may_not_add_a_secret_its_author_may_not_read(charts):
    """The check that guards CREATE guards UPDATE too: a job admitted with no spec.kubernetes, later patched to name
    a legacy ServiceAccount-token Secret (and an S3 one) its author may not read, is refused for each Secret, and
    for adding spec.kubernetes at all; even Secrets she may read cannot be added by an update."""
    vap, _ = charts["default"]
    created = _bare_suspended()
    assert admitted(vap, created)
    patched = _job(created, **{"kubernetes.rayAuthSecret": "default-token-x7k2p", "kubernetes.checkpointSecret": "s3",
                               "kubernetes.rewardConfigMap": "my-reward", "runPolicy.suspend": False})
    assert refusals(vap, patched, AuthorizerDouble(), old=created) == [
        "spec.kubernetes.rayAuthSecret: you may not read Secret default-token-x7k2p, so a job of yours may not use it "
        "either",
        "spec.kubernetes.checkpointSecret: you may not read Secret s3, so a job of yours may not use it either", FIXED]
    readable = AuthorizerDouble({("secrets", "ml", "default-token-x7k2p"), ("secrets", "ml", "s3")})
    assert refusals(vap, patched, readable, old=created) == [FIXED]
    for later in ({"kubernetes": {"dataPvc": "someone-elses"}}, {"kubernetes": {"rewardConfigMap": "theirs"}}):
        assert refusals(vap, _job(created, **{f"kubernetes.{k}": v for k, v in later["kubernetes"].items()}),
                        old=created) == [FIXED], later
    assert refusals(vap, created, old=patched) == [FIXED]  # nor removed


def test_the_operators_own_updates_and_a_suspend_are_never_refused(charts):
    """The operator (whose ServiceAccount may not read Secrets) adds its finalizer and annotations to jobs, some
    admitted before the policy changed: an update that leaves the judged fields as they were is admitted, whoever
    makes it. A priority class patched in later is judged like one given at creation."""
    vap, _ = charts["default"]
    admitted_before = _job(PINNED, **{"kubernetes.rayAuthSecret": "team-token",
                                      "runPolicy.priorityClassName": "system-node-critical",
                                      "kubernetes.serviceAccountName": "since-disallowed"})
    admitted_before = _pools(admitted_before, tolerations=[{"operator": "Exists"}])
    assert not admitted(vap, admitted_before)  # as a new job, today
    finalized = copy.deepcopy(admitted_before)
    finalized["metadata"].update(finalizers=["hybridflow.io/cleanup"],
                                 annotations={"hybridflow.io/last-handled-configuration": "{}"})
    assert refusals(vap, finalized, old=admitted_before, user=OPERATOR) == []
    suspended = _job(admitted_before, **{"runPolicy.suspend": True})
    assert refusals(vap, suspended, old=admitted_before) == []
    higher = _job(PINNED, **{"runPolicy.priorityClassName": "system-node-critical"})
    assert refusals(vap, higher, old=PINNED) == [
        "spec.runPolicy.priorityClassName is not allowed (chart value jobPolicy.allowedPriorityClasses)"]


def _operator_pods_policy(values: list[str]) -> dict:
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--namespace", "hf", *values)) if d]
    assert not [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                and d["metadata"]["name"].endswith("-operator-pods") and "matchResources" in d["spec"]], \
        "bound in every namespace: a binding's selector could only leave namespaces unjudged"
    return next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                and d["metadata"]["name"].endswith("-operator-pods"))


def _job_pods(doc: dict, namespace: str = "default") -> list[dict]:
    """The pods the operator creates for this job (manifests.gang_pods, as in its reconcile)."""
    from hybridflow_operator import manifests as mf

    raw = copy.deepcopy(doc)
    raw["metadata"] = {"name": raw["metadata"]["name"], "namespace": namespace, "uid": "1234-abcd"}
    return mf.gang_pods(parse_job(copy.deepcopy(raw)), raw["metadata"]["uid"], 0)


TINY_EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())


def _changed(pod: dict, change) -> dict:
    out = copy.deepcopy(pod)
    change(out)
    return out


POD_REFUSALS = {  # what a compromised operator might create -> the refusal that names it
    "image elsewhere": (lambda p: p["spec"]["containers"][0].update(image="docker.io/someone/miner:1"),
                        "image docker.io/someone/miner:1 is not under an allowed prefix"),
    "init container elsewhere": (lambda p: p["spec"].setdefault("initContainers", []).append(
        {"name": "fetch", "image": "busybox:1", "securityContext": copy.deepcopy(CONTAINER_SECURITY)}),
        "container fetch: image busybox:1"),
    "token automounted": (lambda p: p["spec"].update(automountServiceAccountToken=True),
                          "spec.automountServiceAccountToken must be false"),
    "token by default": (lambda p: p["spec"].pop("automountServiceAccountToken"),
                         "spec.automountServiceAccountToken must be false"),
    "hostPath": (lambda p: p["spec"]["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
                 "spec.volumes[root]: job pods mount ConfigMaps, PersistentVolumeClaims and emptyDirs only"),
    "a Secret volume": (lambda p: p["spec"]["volumes"].append({"name": "s", "secret": {"secretName": "x"}}),
                        "spec.volumes[s]"),
    "other ServiceAccount": (lambda p: p["spec"].update(serviceAccountName="cluster-admin-sa"),
                             "spec.serviceAccountName cluster-admin-sa is not allowed"),
    "hostNetwork": (lambda p: p["spec"].update(hostNetwork=True), "the node's network, PID or IPC namespace"),
    "hostPID": (lambda p: p["spec"].update(hostPID=True), "the node's network, PID or IPC namespace"),
    "hostPort": (lambda p: p["spec"]["containers"][0]["ports"].append({"containerPort": 22, "hostPort": 22}),
                 "or its ports"),
    "privileged": (lambda p: p["spec"]["containers"][0]["securityContext"].update(privileged=True),
                   "may not be privileged"),
    # issue 51 M4: the securityContext the operator writes is pinned, envFrom refused, Secrets only by its keys
    "privilege escalation": (lambda p: p["spec"]["containers"][0]["securityContext"].update(
        allowPrivilegeEscalation=True), "container controller: securityContext must be the one the operator writes"),
    "a capability added": (lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].update(
        add=["NET_RAW"]), "container controller: securityContext must be the one the operator writes"),
    "capabilities kept": (lambda p: p["spec"]["containers"][0]["securityContext"].pop("capabilities"),
                          "capabilities drop ALL and add none"),
    "a writable root filesystem": (lambda p: p["spec"]["containers"][0]["securityContext"].update(
        readOnlyRootFilesystem=False), "readOnlyRootFilesystem true"),
    "a container as root": (lambda p: p["spec"]["containers"][0]["securityContext"].update(runAsUser=0),
                            "never root"),
    "a container unconfined": (lambda p: p["spec"]["containers"][0]["securityContext"].update(
        seccompProfile={"type": "Unconfined"}), "seccompProfile RuntimeDefault"),
    "no container securityContext": (lambda p: p["spec"]["containers"][0].pop("securityContext"),
                                     "container controller: securityContext must be"),
    "pod seccomp unconfined": (lambda p: p["spec"]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
                               "spec.securityContext must be the one the operator writes"),
    "pod may run as root": (lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"),
                            "spec.securityContext must be the one the operator writes"),
    "pod as uid 0": (lambda p: p["spec"]["securityContext"].update(runAsUser=0), "never uid 0"),
    "envFrom a Secret": (lambda p: p["spec"]["containers"][0].update(envFrom=[{"secretRef": {"name": "team-s3"}}]),
                         "container controller: envFrom is refused"),
    "envFrom a ConfigMap": (lambda p: p["spec"]["containers"][0].update(envFrom=[{"configMapRef": {"name": "x"}}]),
                            "envFrom is refused"),
    "a Secret's key as LD_PRELOAD": (lambda p: p["spec"]["containers"][0]["env"].append(
        {"name": "LD_PRELOAD", "valueFrom": {"secretKeyRef": {"name": "team-s3", "key": "AWS_ACCESS_KEY_ID"}}}),
        "container controller: a secretKeyRef may only give RAY_AUTH_TOKEN"),
    "a credential from another key": (lambda p: p["spec"]["containers"][0]["env"].append(
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "team-s3", "key": "token"}}}),
        "a secretKeyRef may only give"),
    "the Ray token from another key": (lambda p: next(
        e for e in p["spec"]["containers"][0]["env"] if e["name"] == "RAY_AUTH_TOKEN")["valueFrom"]["secretKeyRef"]
        .update(key="password"), "a secretKeyRef may only give"),
    "not a job's": (lambda p: p["metadata"]["labels"].pop("hybridflow.io/job"), "the operator creates job pods only"),
    "owned by no job": (lambda p: p["metadata"].pop("ownerReferences"), "the operator creates job pods only"),
    # issue 51 N5: a RuntimeClass on sandbox pods only (this is the head), and an allowed one
    "a RuntimeClass on a pod that runs no user code": (lambda p: p["spec"].update(runtimeClassName="gvisor"),
                                                        "spec.runtimeClassName gvisor is not allowed"),
}


@pytest.fixture(scope="module")
def operator_pods():
    return {"default": _operator_pods_policy([]),
            "cluster-wide": _operator_pods_policy(["--set", "clusterWide=true"]),
            "open": _operator_pods_policy(OPEN)}


def test_the_operators_own_pods_pass_its_pod_policy(operator_pods):
    """Issue 24, objection 2: the pods the operator really creates (every pod of the examples) are admitted, in the
    namespaces it serves; under open values a job's allowed ServiceAccount and pinned image too."""
    vap = operator_pods["default"]
    for example in (TINY_EXAMPLE, TINY):
        pods = _job_pods(example)
        assert len(pods) >= 2
        for pod in pods:
            assert refusals(vap, pod, namespace="default", user=OPERATOR, namespace_labels=RESTRICTED) == [], \
                pod["metadata"]["name"]
    pinned = _job(PINNED, **{"kubernetes.serviceAccountName": "trainer"})
    for pod in _job_pods(pinned):
        assert pod["spec"]["serviceAccountName"] == "trainer"
        assert refusals(operator_pods["open"], pod, namespace="default", user=OPERATOR,
                        namespace_labels=RESTRICTED) == []
        assert not admitted(vap, pod, namespace="default", user=OPERATOR,
                            namespace_labels=RESTRICTED)  # the default values allow neither
    for pod in _job_pods(TINY_EXAMPLE, "team-a"):
        assert refusals(operator_pods["cluster-wide"], pod, namespace="team-a", user=OPERATOR,
                        namespace_labels={"hybridflow.io/jobs": "enabled", **RESTRICTED}) == []


@pytest.mark.parametrize("case", list(POD_REFUSALS))
def test_a_pod_the_operator_should_never_create_is_refused(operator_pods, case):
    change, message = POD_REFUSALS[case]
    head = _job_pods(TINY_EXAMPLE)[0]
    bad = _changed(head, change)
    for combo, labels in (("default", RESTRICTED), ("cluster-wide", {"hybridflow.io/jobs": "enabled", **RESTRICTED})):
        found = refusals(operator_pods[combo], bad, namespace="default", user=OPERATOR, namespace_labels=labels)
        assert len(found) == 1 and message in found[0], (combo, found)
        assert refusals(operator_pods[combo], bad, namespace="default", user="alice", namespace_labels=labels) == [], \
            "other users' pods are not this policy's business (Pod Security admission judges them)"


def test_the_operator_creates_pods_only_in_the_namespaces_it_serves(operator_pods):
    """A namespaced install: its watchNamespaces; a cluster-wide one: the labelled namespaces only, even though its
    ClusterRole would let it create pods anywhere."""
    pod = _job_pods(TINY_EXAMPLE, "kube-system")[0]
    assert refusals(operator_pods["default"], pod, namespace="kube-system", user=OPERATOR) == [
        "the operator may not create pods in namespace kube-system: it serves default only (chart value "
        "watchNamespaces)"]
    assert refusals(operator_pods["cluster-wide"], pod, namespace="kube-system", user=OPERATOR) == [
        "the operator may not create pods in namespace kube-system: it serves only namespaces labelled "
        "hybridflow.io/jobs=enabled (kubectl label namespace kube-system hybridflow.io/jobs=enabled)"]
    assert not admitted(operator_pods["cluster-wide"], pod, namespace="kube-system", user=OPERATOR,
                        namespace_labels={"hybridflow.io/jobs": "disabled"})
    assert admitted(operator_pods["cluster-wide"], pod, namespace="kube-system", user="system:serviceaccount:x:y")


def test_the_environment_pools_image_is_named_in_the_verdicts_and_an_update_leaving_it_passes(charts):
    """Issue 51 M1: spec.environments.image runs the pool's pods (the operator-pods policy judges those pods too);
    the operator and the job policy both name it, and an update that leaves it as it was is never refused."""
    vaps, policy = charts["open"]
    doc = _job(AGENT, **{"environments.image": "hybridflow/env:1"})
    assert violations(parse_job(copy.deepcopy(doc)), policy) == [
        "spec.environments.image 'hybridflow/env:1' must be pinned by digest (image@sha256:...; chart value "
        "jobPolicy.requireImageDigest)"]
    assert refusals(vaps, doc) == [
        "spec.environments.image must be pinned by digest (chart value jobPolicy.requireImageDigest)"]
    suspended = _job(doc, **{"runPolicy.suspend": True})
    assert refusals(vaps, suspended, old=doc) == []  # admitted before the policy changed: left alone
    elsewhere = _job(AGENT, **{"environments.image": "evil/x:1"})
    assert refusals(charts["default"][0], elsewhere) == [
        "spec.environments.image evil/x:1 is not under an allowed prefix (chart value jobPolicy.allowedImages)"]
    assert violations(parse_job(copy.deepcopy(elsewhere)), Policy()) == [
        "spec.environments.image 'evil/x:1' is not under an allowed prefix (hybridflow/; chart value "
        "jobPolicy.allowedImages)"]


def _docs(*values: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--namespace", "hf", *values)) if d]


def _selects(selector: dict | None, namespace: str, labels: dict) -> bool:
    """A binding's namespaceSelector (matchLabels, matchExpressions In) on a namespace; None: every namespace."""
    if selector is None:
        return True
    have = {"kubernetes.io/metadata.name": namespace, **labels}
    return all(have.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()) and all(
        e["operator"] == "In" and have.get(e["key"]) in e["values"] for e in selector.get("matchExpressions") or [])


def _bound_in(docs: list[dict], namespace: str, labels: dict | None = None) -> list[dict]:
    """The policies the API server runs on a request in this namespace: those whose binding selects it."""
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    return [policies[b["spec"]["policyName"]] for b in docs if b["kind"] == "ValidatingAdmissionPolicyBinding"
            and _selects((b["spec"].get("matchResources") or {}).get("namespaceSelector"), namespace, labels or {})]


@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={team-a}"], ["--set", "clusterWide=true"]])
def test_the_secrets_a_job_names_are_judged_in_every_namespace_served_or_not(values):
    """Issue 51 H2: a job created before its namespace was served (not yet labelled, not yet in watchNamespaces) is
    picked up by the operator later, which never reads Secrets nor knows who made the job: its Secrets were judged
    when it was made, wherever that was. The chart's other rules (images, ...) stay where the operator serves."""
    docs = _docs(*values)
    doc = _job(TINY, **{"kubernetes.checkpointSecret": "payroll-s3", "kubernetes.trackingSecret": "their-wandb",
                        "kubernetes.rayAuthSecret": "admin-token"})
    for namespace in ("not-served-yet", "team-a", "default"):
        bound = _bound_in(docs, namespace)
        assert refusals(bound, doc, AuthorizerDouble(), namespace=namespace, resource="rlhfjobs") == [
            "spec.kubernetes.rayAuthSecret: you may not read Secret admin-token, so a job of yours may not use it "
            "either",
            "spec.kubernetes.checkpointSecret: you may not read Secret payroll-s3, so a job of yours may not use it "
            "either",
            "spec.kubernetes.trackingSecret: you may not read Secret their-wandb, so a job of yours may not use it "
            "either"], namespace
        readable = AuthorizerDouble({("secrets", namespace, s) for s in ("payroll-s3", "their-wandb", "admin-token")})
        assert refusals(bound, doc, readable, namespace=namespace) == [], namespace
    unserved = [p["metadata"]["name"] for p in _bound_in(docs, "not-served-yet") if "rlhfjobs" in str(p["spec"])]
    assert unserved == ["rel-hybridflow-job-secrets"], "only the Secrets are judged where the operator does not serve"


def test_kueue_required_refuses_a_job_without_its_queue_label():
    """Issue 51 M2: kueue.required (with kueue.enabled): a job not labelled for a LocalQueue would run past every
    queue's quota; the job policy refuses it (and an update removing the label), the operator refuses it at
    acceptance. Off (the default), an unlabelled job is the usual one."""
    from hybridflow.api import SpecError
    from hybridflow_operator.accept import check_queueable
    from hybridflow_operator.policy import queue_problem

    vaps, policy = _rendered(["--set", "kueue.enabled=true", "--set", "kueue.required=true"])
    assert policy.require_queue
    labelled = copy.deepcopy(TINY)
    labelled["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    message = ("metadata.labels[kueue.x-k8s.io/queue-name]: this cluster admits jobs only through Kueue (chart value "
               "kueue.required); label the job with its LocalQueue")
    assert refusals(vaps, TINY) == [message]
    assert refusals(vaps, labelled) == []
    assert refusals(vaps, TINY, old=labelled) == [message]  # the label removed by an update
    assert refusals(vaps, _job(TINY, **{"runPolicy.suspend": True}), old=TINY) == []  # made before: left alone
    why = queue_problem(None, policy)
    assert why and why.startswith("metadata.labels[kueue.x-k8s.io/queue-name]: this cluster admits jobs only "
                                  "through Kueue (chart value kueue.required)")
    assert queue_problem("team-a", policy) is None and queue_problem(None, Policy()) is None
    with pytest.raises(SpecError, match=r"kueue\.required"):
        check_queueable(parse_job(copy.deepcopy(TINY)), None, policy)
    check_queueable(parse_job(copy.deepcopy(TINY)), None, Policy())  # not required: accepted
    default_vaps, default_policy = _rendered([])
    assert refusals(default_vaps, TINY) == [] and not default_policy.require_queue
    out = run_helm("template", "rel", str(CHART), "--set", "kueue.required=true")
    assert out.returncode != 0 and "set kueue.enabled=true as well" in out.stderr


def test_every_pod_the_operator_makes_passes_its_pod_policy_secrets_and_environment_pool_included(operator_pods):
    """Issue 51 M4: the pins hold what the operator writes: every container's securityContext (init containers and
    the environment pool's too), the Ray token, the sandbox pool's token, the storage credentials of
    checkpointSecret and the trackers' of trackingSecret (each variable from the key of its own name)."""
    from hybridflow.api.storage import STORAGE_CREDENTIAL_KEYS, TRACKING_CREDENTIAL_KEYS
    from hybridflow_operator import manifests as mf
    from hybridflow_operator.environments import environment_pod

    raw = _job(AGENT, **{"kubernetes.checkpointSecret": "team-s3", "kubernetes.trackingSecret": "team-wandb",
                         "resourcePools": [{"name": "default", "nodes": 1}]})
    raw["metadata"] = {"name": "agent", "namespace": "default", "uid": "1234-abcd"}
    job = parse_job(copy.deepcopy(raw))
    pods = mf.gang_pods(job, "1234-abcd", 0) + [environment_pod(job, "1234-abcd", 0)]
    refs = {(e["name"], e["valueFrom"]["secretKeyRef"]["key"]) for p in pods
            for c in p["spec"]["containers"] + p["spec"].get("initContainers", []) for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}
    fixed = {"RAY_AUTH_TOKEN": "token", mf.SANDBOX_TOKEN_ENV: mf.SANDBOX_TOKEN_KEY,
             **{k: k for k in STORAGE_CREDENTIAL_KEYS + TRACKING_CREDENTIAL_KEYS}}
    assert refs == set(fixed.items())
    for pod in pods:
        assert refusals(operator_pods["open"], pod, namespace="default", user=OPERATOR,
                        namespace_labels=RESTRICTED) == [], pod["metadata"]["name"]
    secret_env = next(v["expression"] for v in operator_pods["default"]["spec"]["variables"]
                      if v["name"] == "secretEnv")
    env = celpy.Environment()
    assert dict(env.program(env.compile(secret_env)).evaluate({})) == fixed


def test_a_placement_auto_jobs_plan_pod_passes_the_operators_pod_policy(operator_pods):
    """Issue 52: the plan pod (plan_pod.py) is a job pod like the others: the pinned securityContext, no token, no
    Secret, the spec ConfigMap and the model claim only."""
    from hybridflow_operator.plan_pod import plan_pod

    for doc in (_job(TINY, placement="auto"), _job(TINY, placement="auto", **{"kubernetes.modelPvc": "models"})):
        raw = copy.deepcopy(doc)
        raw["metadata"] = {"name": raw["metadata"]["name"], "namespace": "default", "uid": "1234-abcd"}
        pod = plan_pod(parse_job(raw), "1234-abcd")
        for combo, labels in (("default", RESTRICTED), ("cluster-wide", {"hybridflow.io/jobs": "enabled",
                                                                         **RESTRICTED})):
            assert refusals(operator_pods[combo], pod, namespace="default", user=OPERATOR,
                            namespace_labels=labels) == [], combo
        bad = _changed(pod, lambda p: p["spec"].update(automountServiceAccountToken=True))
        assert refusals(operator_pods["default"], bad, namespace="default", user=OPERATOR,
                        namespace_labels=RESTRICTED) == ["spec.automountServiceAccountToken must be false (job pods "
                                                         "get no ServiceAccount token)"]


def test_the_operator_creates_pods_only_where_the_restricted_pod_security_standard_is_enforced(operator_pods):
    """Issue 51 M4: a namespace the operator serves must enforce Pod Security `restricted` (its label): the API server
    then judges every pod there, and the operator's pod creates are refused until it does (the job shows
    CreateRefused with this message, and starts once the namespace is labelled)."""
    pod = _job_pods(TINY_EXAMPLE)[0]
    message = ("namespace default does not enforce the restricted Pod Security Standard, which the operator requires "
               "where it creates pods: kubectl label namespace default pod-security.kubernetes.io/enforce=restricted")
    for combo, labels in (("default", {}), ("cluster-wide", {"hybridflow.io/jobs": "enabled"})):
        for psa in ({}, {"pod-security.kubernetes.io/enforce": "baseline"},
                    {"pod-security.kubernetes.io/warn": "restricted"}):
            assert refusals(operator_pods[combo], pod, namespace="default", user=OPERATOR,
                            namespace_labels={**labels, **psa}) == [message], (combo, psa)
        assert refusals(operator_pods[combo], pod, namespace="default", user=OPERATOR,
                        namespace_labels={**labels, **RESTRICTED}) == [], combo


def test_workloads_podgroups_and_endpoint_slices_that_pass_for_a_jobs_are_the_operators_or_their_controllers():
    """Issue 51 L5: a Workload owned by a job is its Kueue admission, a PodGroup its Volcano gang, an EndpointSlice
    labelled as a job's the addresses of its head: only the operator may make one, or (per resource) the controller
    that makes it from the job's own Service or pods."""
    docs = _docs()
    guard = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                 and d["metadata"]["name"].endswith("-job-children"))
    matched = {(g, r) for rule in guard["spec"]["matchConstraints"]["resourceRules"] for g in rule["apiGroups"]
               for r in rule["resources"] if {"CREATE", "UPDATE"} <= set(rule["operations"])}
    assert {("discovery.k8s.io", "endpointslices"), ("kueue.x-k8s.io", "workloads"),
            ("scheduling.volcano.sh", "podgroups")} <= matched
    owned = {"metadata": {"name": "victim-wl", "ownerReferences": [
        {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "name": "victim", "uid": "u", "controller": True}]}}
    labelled = {"metadata": {"name": "victim-head-abcde", "labels": {"hybridflow.io/job": "victim",
                                                                     "kubernetes.io/service-name": "victim-head"}}}
    plain = {"metadata": {"name": "mine", "labels": {"kubernetes.io/service-name": "mine"}}}
    slicer = "system:serviceaccount:kube-system:endpointslice-controller"
    volcano = "system:serviceaccount:volcano-system:volcano-controllers"
    for resource, doc in (("workloads", owned), ("podgroups", owned), ("endpointslices", labelled)):
        assert not admitted(guard, doc, resource=resource), resource
        assert not admitted(guard, doc, old=plain, resource=resource), resource  # turned into the job's
        assert admitted(guard, doc, user=OPERATOR, resource=resource), resource
        assert admitted(guard, plain, resource=resource), resource
    assert admitted(guard, labelled, user=slicer, resource="endpointslices")  # the slices of the job's Service
    assert admitted(guard, labelled, user="system:kube-controller-manager", resource="endpointslices")
    assert admitted(guard, owned, user=volcano, resource="podgroups")  # a PodGroup for a job pod, the pod's owner
    assert not admitted(guard, owned, user=slicer, resource="workloads"), "trusted for its own resource only"
    assert not admitted(guard, owned, user=volcano, resource="workloads")
    assert admitted(guard, owned, old=owned, user="system:serviceaccount:kueue-system:kueue-controller-manager",
                    resource="workloads")  # Kueue updating the job's Workload


RUNTIME_CLASSES = ("gvisor", "runsc", "kata", "kata-qemu", "kata-clh", "kata-fc")
RC_REFUSED = ("spec.sandbox.runtimeClassName {} is not allowed (chart value jobPolicy.allowedRuntimeClasses)")


def test_the_sandbox_runtime_class_is_judged_by_the_charts_allow_list():
    """Issue 51 N5: a RuntimeClass picks the runtime handler the sandbox pods run under (one may be configured
    unconfined, privileged, with the node's devices) and may carry tolerations and a nodeSelector: a job may name
    only one of jobPolicy.allowedRuntimeClasses (by default gVisor's and Kata's usual names), in the operator at
    acceptance and in the job policy at `kubectl apply`, each message naming the field and the chart value; []
    allows none. An update leaving the class as it was passes (a job admitted before the policy changed)."""
    vaps, policy = _rendered([])
    assert policy.allowed_runtime_classes == RUNTIME_CLASSES == Policy().allowed_runtime_classes
    assert policy.sandbox_runtime_class == ""
    runc = _job(AGENT, **{"sandbox.runtimeClassName": "runc"})
    assert violations(parse_job(copy.deepcopy(runc)), policy) == [
        "spec.sandbox.runtimeClassName 'runc' is not allowed (gvisor, runsc, kata, kata-qemu, kata-clh, kata-fc; "
        "chart value jobPolicy.allowedRuntimeClasses)"]
    assert refusals(vaps, runc) == [RC_REFUSED.format("runc")]
    for name in RUNTIME_CLASSES:
        doc = _job(AGENT, **{"sandbox.runtimeClassName": name})
        assert violations(parse_job(copy.deepcopy(doc)), policy) == [] and refusals(vaps, doc) == [], name
    assert refusals(vaps, _job(runc, **{"runPolicy.suspend": True}), old=runc) == []  # admitted before: left alone
    gvisor = _job(AGENT, **{"sandbox.runtimeClassName": "gvisor"})
    assert refusals(vaps, runc, old=gvisor) == [RC_REFUSED.format("runc")]  # changed by an update: judged

    none_vaps, none_policy = _rendered(["--set-json", "jobPolicy.allowedRuntimeClasses=[]",
                                        "--set", "jobPolicy.sandboxRuntimeClassName=gvisor"])
    assert (none_policy.allowed_runtime_classes, none_policy.sandbox_runtime_class) == ((), "gvisor")
    assert violations(parse_job(copy.deepcopy(gvisor)), none_policy) == [
        "spec.sandbox.runtimeClassName 'gvisor' is not allowed (none; chart value jobPolicy.allowedRuntimeClasses)"]
    assert refusals(none_vaps, gvisor) == [RC_REFUSED.format("gvisor")]
    assert violations(parse_job(copy.deepcopy(AGENT)), none_policy) == [] and refusals(none_vaps, AGENT) == []


def test_the_policy_refuses_a_runtime_class_value_that_is_no_name():
    from hybridflow_operator.policy import PolicyError

    with pytest.raises(PolicyError, match="HYBRIDFLOW_SANDBOX_RUNTIME_CLASS: a RuntimeClass name"):
        Policy.from_env({"HYBRIDFLOW_SANDBOX_RUNTIME_CLASS": "gVisor'] || true || ['"})
    with pytest.raises(PolicyError, match="HYBRIDFLOW_ALLOWED_RUNTIME_CLASSES: a RuntimeClass name"):
        Policy.from_env({"HYBRIDFLOW_ALLOWED_RUNTIME_CLASSES": "kata,Kata QEMU"})
    assert Policy.from_env({"HYBRIDFLOW_ALLOWED_RUNTIME_CLASSES": " kata , gvisor ",
                            "HYBRIDFLOW_SANDBOX_RUNTIME_CLASS": " kata "}) == Policy(
        allowed_runtime_classes=("kata", "gvisor"), sandbox_runtime_class="kata")


def _agent_job(doc: dict):
    raw = copy.deepcopy(doc)
    raw["metadata"] = {"name": "agent", "namespace": "default", "uid": "1234-abcd"}
    return parse_job(raw)


def test_the_charts_default_runtime_class_reaches_the_sandbox_pods_only():
    """Issue 51 N5: a job that names no RuntimeClass gets the chart's jobPolicy.sandboxRuntimeClassName on its
    sandbox pods (the builder is given it: it reads no policy), one that names one keeps its own, and the pods that
    run no user code get none. The Kueue Workload's podSets are the pods made later."""
    from hybridflow_operator import manifests as mf
    from hybridflow_operator.environments import environment_pod
    from hybridflow_operator.workloads import make_workload

    _, policy = _rendered(["--set", "jobPolicy.sandboxRuntimeClassName=gvisor-strict"])
    assert policy.sandbox_runtime_class == "gvisor-strict"
    job = _agent_job(AGENT)
    assert environment_pod(job, "1234-abcd", 0, policy.sandbox_runtime_class)["spec"]["runtimeClassName"] \
        == "gvisor-strict"
    assert "runtimeClassName" not in environment_pod(job, "1234-abcd", 0)["spec"]  # "": the cluster's default
    assert environment_pod(_agent_job(_job(AGENT, **{"sandbox.runtimeClassName": "kata"})), "1234-abcd", 0,
                           policy.sandbox_runtime_class)["spec"]["runtimeClassName"] == "kata"
    assert all("runtimeClassName" not in p["spec"] for p in mf.gang_pods(job, "1234-abcd", 0))

    class Created:
        objects: list = []

        def create(self, obj):
            self.objects.append(obj)
            return obj

    kube = Created()
    make_workload(kube, job, "1234-abcd", "team-a", {}, policy.sandbox_runtime_class)
    (workload,) = kube.objects
    classes = {ps["name"]: ps["template"]["spec"].get("runtimeClassName") for ps in workload["spec"]["podSets"]}
    assert set(classes.values()) == {None, "gvisor-strict"} and classes["head"] is None, classes


@pytest.fixture(scope="module")
def runtime_pods():
    """The operator-pods policy and the operator's Policy of an install with a default class outside the list."""
    values = ["--set", "jobPolicy.sandboxRuntimeClassName=gvisor-strict",
              "--set", "jobPolicy.allowedRuntimeClasses={kata}"]
    return _operator_pods_policy(values), _rendered(values)


def test_the_operator_pods_policy_admits_a_runtime_class_on_sandbox_pods_only_and_an_allowed_one_only(
        operator_pods, runtime_pods):
    """Issue 51 N5: the operator-pods policy pins what the operator writes: a RuntimeClass only on the sandbox pods
    (hybridflow.io/role=environment), and only one the job may name (jobPolicy.allowedRuntimeClasses) or the chart's
    default (jobPolicy.sandboxRuntimeClassName). So a compromised operator cannot run a pod under a handler the
    platform team did not choose, nor a gang pod (which holds the credentials) under any."""
    from hybridflow.api.names import LABEL_ROLE
    from hybridflow_operator import manifests as mf
    from hybridflow_operator.environments import environment_pod

    pods_vap, ((job_vaps, policy)) = runtime_pods
    sandbox_pod = next(v["expression"] for v in pods_vap["spec"]["variables"] if v["name"] == "sandboxPod")
    assert f"'{LABEL_ROLE}'" in sandbox_pod and f"'{mf.ENVIRONMENT_ROLE}'" in sandbox_pod

    def verdict(vap, pod):
        return refusals(vap, pod, namespace="default", user=OPERATOR, namespace_labels=RESTRICTED)

    for doc in (AGENT, _job(AGENT, **{"sandbox.runtimeClassName": "kata"})):  # the default; one the job names
        assert violations(parse_job(copy.deepcopy(doc)), policy) == [] and refusals(job_vaps, doc) == []
        job = _agent_job(doc)
        pods = mf.gang_pods(job, "1234-abcd", 0) + [environment_pod(job, "1234-abcd", 0, policy.sandbox_runtime_class)]
        assert pods[-1]["spec"]["runtimeClassName"] in ("gvisor-strict", "kata")
        for pod in pods:
            assert verdict(pods_vap, pod) == [], pod["metadata"]["name"]
    sandbox = environment_pod(_agent_job(AGENT), "1234-abcd", 0, "gvisor")  # allowed by default, not in this install
    message = ("spec.runtimeClassName gvisor is not allowed: the operator sets a RuntimeClass on sandbox pods "
               "(hybridflow.io/role=environment) only, one of chart values jobPolicy.allowedRuntimeClasses and "
               "jobPolicy.sandboxRuntimeClassName")
    assert verdict(pods_vap, sandbox) == [message]
    assert verdict(operator_pods["default"], sandbox) == []
    for name in ("runc", "nvidia-privileged"):
        assert verdict(operator_pods["default"], _changed(sandbox, lambda p: p["spec"].update(runtimeClassName=name))) \
            == [message.replace("gvisor", name, 1)], name
    head = _changed(_job_pods(AGENT)[0], lambda p: p["spec"].update(runtimeClassName="gvisor-strict"))
    assert verdict(pods_vap, head) == [message.replace("gvisor", "gvisor-strict", 1)]


def test_the_operator_runs_sandbox_pods_under_the_charts_runtime_class_and_fails_a_job_naming_another(tmp_path):
    """Issue 51 N5, the real operator (kopf over HTTP, as tests/operator/test_operator_kopf_*.py run it) configured as the chart
    configures it: a job that names no RuntimeClass gets jobPolicy.sandboxRuntimeClassName on its sandbox pod and
    none on its gang (a job queued through Kueue, on its Workload's sandbox podSet too); one naming an allowed class
    gets it; one naming another fails at acceptance, before any pod, naming the field and the chart value."""
    from kube.harness import Kube, wait_for
    from kube.kueue_double import KueueDouble
    from kube.operator_cluster import REWARD, _phase, _started_cluster, job_doc
    from kubernetes import client

    def reward_job(name: str, **sandbox) -> dict:
        doc = job_doc(name)
        doc["spec"].update(models=REWARD, kubernetes={"rewardConfigMap": "rw"}, sandbox=sandbox)
        return doc

    with pytest.MonkeyPatch.context() as env:
        env.setenv("HYBRIDFLOW_SANDBOX_RUNTIME_CLASS", "gvisor-strict")
        env.setenv("HYBRIDFLOW_ALLOWED_RUNTIME_CLASSES", "kata")
        env.setenv("HYBRIDFLOW_KUEUE", "true")
        with _started_cluster(tmp_path) as (api, kubeconfig, _):
            env.undo()
            kube = Kube(kubeconfig)
            kube.core.create_namespaced_config_map(kube.namespace, client.V1ConfigMap(
                metadata=client.V1ObjectMeta(name="rw", labels={FOR_JOBS_LABEL: "true"}),
                data={"my_reward.py": "def compute_score(*a):\n    return 1.0\n"}))
            kube.create_job(reward_job("jrc-refused", runtimeClassName="runc"))
            kube.create_job(reward_job("jrc"))
            kube.create_job(reward_job("jrc-kata", runtimeClassName="kata"))
            queued = reward_job("jrc-queued")
            queued["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
            kube.create_job(queued)
            workload = wait_for(lambda: KueueDouble(kube.api, "default").workload("jrc-queued-workload"), 30,
                                "the queued job's Workload")
            classes = {ps["name"]: ps["template"]["spec"].get("runtimeClassName") for ps in workload["spec"]["podSets"]}
            assert sorted(classes.values(), key=str) == [None, None, "gvisor-strict"], classes
            for name, expected in (("jrc", "gvisor-strict"), ("jrc-kata", "kata")):
                pods = wait_for(lambda: len(kube.pods(name)) == 3 and kube.pods(name), 30, f"{name}'s pods")
                classes = {p.metadata.name: p.spec.runtime_class_name for p in pods}
                assert classes == {f"{name}-env-0": expected, f"{name}-head-g0": None,
                                   f"{name}-default-0-g0": None}, classes
            st = wait_for(lambda: _phase(kube, "jrc-refused") == "Failed" and kube.status("jrc-refused"), 30,
                          "Failed")
            assert "spec.sandbox.runtimeClassName 'runc' is not allowed (kata; chart value " \
                   "jobPolicy.allowedRuntimeClasses)" in st["message"], st
            assert kube.pods("jrc-refused") == []
