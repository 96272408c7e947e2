"""The cluster's job policy (chart values `jobPolicy`): the operator's check and the ValidatingAdmissionPolicy the
chart ships must give every job the same verdict. The API double runs no CEL, so the policy's expressions are
evaluated here with cel-python, on the chart as rendered, for the operator as the rendered Deployment configures
it."""
import copy
from pathlib import Path

import celpy
import pytest
import yaml
from test_helm import helm

from hybridflow.spec import Kubernetes, parse_job
from hybridflow_operator.policy import FOR_JOBS_LABEL, Policy, unmarked, violations

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "hybridflow"
GPU = yaml.safe_load((ROOT / "examples" / "gpu-grpo-7b.yaml").read_text())
TINY = yaml.safe_load((ROOT / "examples" / "tiny-grpo-k8s.yaml").read_text())

OPEN = ["--set", "jobPolicy.allowedImages={registry.example.com/ml/,hybridflow/}",
        "--set", "jobPolicy.requireImageDigest=true", "--set", "jobPolicy.allowedServiceAccounts={trainer}",
        "--set", "jobPolicy.allowedPriorityClasses={high-priority}", "--set", "jobPolicy.allowTolerations=true",
        "--set", "jobPolicy.allowAffinity=true", "--set", "jobPolicy.allowedSchedulers={volcano,default-scheduler}"]


def _rendered(values: list[str]) -> tuple[dict, Policy]:
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "--namespace", "hf", *values)) if d]
    vap = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value", "") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    return vap, Policy.from_env(env)


def admitted(vap: dict, doc: dict) -> bool:
    """The API server's verdict: the policy's variables, then every validation, evaluated as CEL."""
    cel = celpy.Environment()
    activation = {"object": celpy.json_to_cel(doc)}
    variables = {}
    for v in vap["spec"].get("variables", []):
        activation["variables"] = celpy.json_to_cel(variables)
        variables[v["name"]] = cel.program(cel.compile(v["expression"])).evaluate(activation)
    activation["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()})
    return all(bool(cel.program(cel.compile(r["expression"])).evaluate(activation)) for r in vap["spec"]["validations"])


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
    "gpu example": (GPU, False, False),
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
    assert f"'{Kubernetes().image}'" in str(_rendered([])[0]["spec"]["variables"])


def test_objects_a_job_mounts_must_be_marked_for_jobs():
    p = Policy()
    assert unmarked("ConfigMap", "spec.kubernetes.rewardConfigMap", "r", {FOR_JOBS_LABEL: "true"}, p) is None
    why = unmarked("ConfigMap", "spec.kubernetes.rewardConfigMap", "r", {"team": "a"}, p)
    assert why and f"kubectl label configmap r {FOR_JOBS_LABEL}=true" in why
    assert unmarked("Secret", "spec.kubernetes.rayAuthSecret", "s", None, Policy(require_for_jobs_label=False)) is None
