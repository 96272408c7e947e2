"""Every CEL rule the CRD ships, evaluated with a CEL library on cases it must accept and cases it must refuse (the
API server double enforces no CEL), and the CRD and `hybridflow validate` giving the same verdict on bounded input.

The CRD's verdict here is its openAPIV3Schema (jsonschema, with Go's RE2 for `pattern`, as the API server matches)
plus every x-kubernetes-validations rule evaluated with cel-python, where the API server would evaluate it.
"""
import copy

import celpy
import jsonschema
import pytest
import re2
import yaml

from hybridflow.api.crd import build_crd, immutable_field_rule
from hybridflow.api.names import ROLES
from hybridflow.api import MAX_JOB_NAME, RLHFJob, SpecError, dump_job, parse_job

from support.paths import ROOT

EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
_ABSENT = object()
_CEL = celpy.Environment()  # the CEL spec's standard library only: a Kubernetes-only function fails to evaluate


def _schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _rules(node: dict, path: str = "$"):
    """(path, {rule, message}) for every x-kubernetes-validations entry of the schema."""
    for v in node.get("x-kubernetes-validations", []):
        yield path, v
    for k, child in node.get("properties", {}).items():
        yield from _rules(child, f"{path}.{k}")
    for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(node.get(key), dict):
            yield from _rules(node[key], path + suffix)


def _holds(rule: str, value, old=_ABSENT) -> bool:
    """The rule's verdict on `self` (and `oldSelf`); an evaluation error refuses, as the API server does."""
    activation = {"self": celpy.json_to_cel(value)}
    if old is not _ABSENT:
        activation["oldSelf"] = celpy.json_to_cel(old)
    try:
        result = _CEL.program(_CEL.compile(rule)).evaluate(activation)
    except celpy.CELEvalError:
        return False
    return result is True or (not isinstance(result, celpy.CELEvalError) and bool(result))


def cel_problems(node: dict, value, old=_ABSENT, path: str = "") -> list[str]:
    """Every rule the API server would evaluate on this object: where the value is present; transition rules
    (oldSelf) only on an update, and not inside plain lists (whose items have no old counterpart)."""
    out = []
    for v in node.get("x-kubernetes-validations", []):
        transition = "oldSelf" in v["rule"]
        if transition and old is _ABSENT:
            continue
        if not _holds(v["rule"], value, old if transition else _ABSENT):
            out.append(f"{path or '(root)'}: {v['message']}")
    if isinstance(value, dict):
        for k, child in node.get("properties", {}).items():
            if k in value:
                child_old = old.get(k, _ABSENT) if isinstance(old, dict) else _ABSENT
                out += cel_problems(child, value[k], child_old, f"{path}.{k}".lstrip("."))
        if isinstance(node.get("additionalProperties"), dict):
            for k, v in value.items():
                out += cel_problems(node["additionalProperties"], v, _ABSENT, f"{path}.{k}")
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            out += cel_problems(node["items"], item, _ABSENT, f"{path}[{i}]")
    return out


def _re2_pattern(validator, pattern, instance, schema):
    # Kubernetes matches `pattern` with Go's regexp (RE2): `$` is the end of the text, not "before a final newline".
    if isinstance(instance, str) and not re2.search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_OpenAPI = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _re2_pattern})


def crd_problems(doc: dict, old=_ABSENT) -> list[str]:
    schema = _schema()
    out = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _OpenAPI(schema).iter_errors(doc)]
    return out + cel_problems(schema, doc, old)


def spec_problem(doc: dict) -> str | None:
    try:
        parse_job(doc)
    except SpecError as err:
        return str(err)
    return None


def _with(path: str, value) -> dict:
    """The tiny example with one value set; `path` is dotted, `[i]` indexes a list."""
    doc = copy.deepcopy(EXAMPLE)
    node = doc
    parts = path.replace("[", ".[").split(".")
    for part, nxt in zip(parts, parts[1:] + [None]):
        key = int(part[1:-1]) if part.startswith("[") else part
        if nxt is None:
            node[key] = value
        else:
            if isinstance(node, dict):
                node = node.setdefault(key, [] if nxt.startswith("[") else {})
            else:
                node = node[key]
    return doc


# metadata.name: the CRD's CEL rules and spec.job_name_problems
NAMES_OK = ["a", "tiny-grpo", "a" * MAX_JOB_NAME, "a1-b2", "x0"]
NAMES_BAD = ["a" * (MAX_JOB_NAME + 1), "1job", "Job", "job-", "-job", "my.job", "my_job", "job\n", "a" * 254]


@pytest.mark.parametrize("name", NAMES_OK + NAMES_BAD, ids=lambda n: repr(n[:20]) + f"({len(n)})")
def test_metadata_name_verdicts_agree(name):
    doc = _with("metadata.name", name)
    crd, spec = crd_problems(doc), spec_problem(doc)
    assert bool(crd) == (name in NAMES_BAD), crd
    assert (spec is not None) == (name in NAMES_BAD), spec
    if spec is not None:
        assert "metadata.name: " in spec


def test_metadata_name_messages_match():
    """`hybridflow validate` says what the API server says (the CEL rules' messages)."""
    doc = _with("metadata.name", "A" * (MAX_JOB_NAME + 1))
    crd = [p.split(": ", 1)[1] for p in cel_problems(_schema(), doc)]
    assert len(crd) == 2
    spec = spec_problem(doc)
    for message in crd:
        assert message.removeprefix("metadata.name: ") in spec


def _mutated(value):
    """`value` with its first leaf changed (what an edit of that section does)."""
    if isinstance(value, dict):
        for k in sorted(value):
            return {**value, k: _mutated(value[k])}
        return {"changed": 1}
    if isinstance(value, list):
        return [_mutated(value[0]), *value[1:]] if value else [1]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return f"{value}x"


def _rule_cases(path: str, rule: str) -> tuple[list[tuple], list[tuple]]:
    """(accepted, refused) activations (self, oldSelf) for a rule; a rule without cases fails the test below."""
    if path == "$.spec" and "rolloutPool" in rule:  # an elastic pool's size changes; the pool does not come or go
        spec = {**dump_job(RLHFJob())["spec"], "rolloutPool": {"replicas": 1, "maxReplicas": 2}}
        resized = {**spec, "rolloutPool": {"replicas": 2, "maxReplicas": 3}}
        without = {k: v for k, v in spec.items() if k != "rolloutPool"}
        return ([(spec, spec), (resized, spec), (without, without)], [(spec, without), (without, spec)])
    if path == "$.spec.rolloutPool":
        ok = [{"maxReplicas": 2}, {"replicas": 2, "maxReplicas": 2},
              {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}]
        bad = [{"replicas": 3, "maxReplicas": 2}, {"replicas": 1, "minReplicas": 2, "maxReplicas": 3},
               {"minReplicas": 3, "maxReplicas": 2}]
        return ([(x, _ABSENT) for x in ok], [(x, _ABSENT) for x in bad if not _holds(rule, x)])
    if path == "$.spec" and "oldSelf" in rule:  # one field's immutability, judged on spec
        spec = dump_job(RLHFJob())["spec"]
        field = rule.removeprefix("has(self.").split(")")[0]
        spec.setdefault(field, {"replicas": 1})  # an optional section the default job leaves out (environments)
        without = {k: v for k, v in spec.items() if k != field}
        changed = {**spec, field: _mutated(spec[field])}
        return ([(spec, spec), (copy.deepcopy(spec), spec), (without, without), (changed, changed)],
                [(changed, spec), (spec, without), (without, spec)])  # changed, added, removed
    if path == "$" and "metadata.name" in rule:
        docs = {n: _with("metadata.name", n) for n in NAMES_OK + NAMES_BAD}
        ok = [(docs[n], _ABSENT) for n in NAMES_OK]
        return ok, [(docs[n], _ABSENT) for n in NAMES_BAD if not _holds(rule, docs[n])]
    return [], []


def test_every_cel_rule_is_standard_cel_and_decides_its_cases():
    rules = list(_rules(_schema()))
    assert len(rules) >= 12
    for path, v in rules:
        assert v.get("message"), f"{path}: {v['rule']} has no message"
        _CEL.compile(v["rule"])  # a syntax error or non-standard macro fails here
        accepted, refused = _rule_cases(path, v["rule"])
        assert accepted and refused, f"{path}: no accept/refuse cases for {v['rule']!r}; add them to _rule_cases"
        for self_, old in accepted:
            assert _holds(v["rule"], self_, old), (path, v["rule"])
        for self_, old in refused:
            assert not _holds(v["rule"], self_, old), (path, v["rule"])


def test_each_metadata_name_rule_refuses_something_of_its_own():
    """Both root rules matter: each refuses a name the other accepts."""
    root = [v["rule"] for path, v in _rules(_schema()) if path == "$"]
    assert len(root) == 2
    too_long, not_label = _with("metadata.name", "a" * (MAX_JOB_NAME + 1)), _with("metadata.name", "Ab")
    assert [_holds(r, too_long) for r in root] == [False, True]
    assert [_holds(r, not_label) for r in root] == [True, False]


def test_only_run_policy_may_change_on_update():
    old = dump_job(parse_job(EXAMPLE))
    moved = copy.deepcopy(old)
    moved["spec"]["runPolicy"]["suspend"] = True
    assert cel_problems(_schema(), moved, old) == []
    moved["spec"]["trainer"]["steps"] += 1
    assert cel_problems(_schema(), moved, old) == [
        "spec: spec.trainer cannot be added, changed or removed once the job exists; only spec.runPolicy and spec.rolloutPool can (delete "
        "and re-create the job to change it)"]


def test_adding_a_field_the_job_did_not_have_is_a_change_too():
    """A job created without spec.kubernetes (suspended, say), then patched to name Secrets and a reward ConfigMap.
    A rule on spec.kubernetes itself would be a transition rule, which the API server evaluates only where the old
    value exists, so it never saw the field added; the rules sit on spec, which every job has."""
    old = copy.deepcopy(EXAMPLE)
    old["spec"]["runPolicy"] = {"suspend": True}
    assert "kubernetes" not in old["spec"]
    added = copy.deepcopy(old)
    added["spec"]["kubernetes"] = {"rayAuthSecret": "default-token-abcde", "checkpointSecret": "team-s3"}
    added["spec"]["runPolicy"]["suspend"] = False
    message = "spec: " + immutable_field_rule("kubernetes")["message"]
    assert cel_problems(_schema(), added, old) == [message]
    assert cel_problems(_schema(), old, added) == [message]  # nor removed
    unsuspended = copy.deepcopy(old)
    unsuspended["spec"]["runPolicy"]["suspend"] = False
    assert cel_problems(_schema(), unsuspended, old) == []


# (path in the tiny example, value, field the message must name); every one refused by both
BAD = [
    ("spec.resourcePools[0].nodes", 1025, "spec.resourcePools[0].nodes"),
    ("spec.resourcePools[0].devicesPerNode", 65, "spec.resourcePools[0].devicesPerNode"),
    ("spec.resourcePools[0].name", "gpu-a", "spec.resourcePools[0].name"),
    ("spec.resourcePools[0].name", "Default", "spec.resourcePools[0].name"),
    ("spec.resourcePools[0].name", "d" * 64, "spec.resourcePools[0].name"),
    ("spec.resourcePools[0].memoryPerNode", "4GB", "spec.resourcePools[0].memoryPerNode"),
    ("spec.resourcePools[0].memoryPerNode", "-1Gi", "spec.resourcePools[0].memoryPerNode"),
    ("spec.resourcePools[0].memoryPerNode", "1.5.2Gi", "spec.resourcePools[0].memoryPerNode"),
    ("spec.resourcePools[0].memoryPerNode", "4Gi\n", "spec.resourcePools[0].memoryPerNode"),
    ("spec.resourcePools[0].memoryPerNode", "", "spec.resourcePools[0].memoryPerNode"),
    ("spec.resourcePools[0].nodeSelector", {"zone": "a b"}, "spec.resourcePools[0].nodeSelector.zone"),
    ("spec.resourcePools[0].nodeSelector", {f"k{i}": "v" for i in range(65)}, "spec.resourcePools[0].nodeSelector"),
    ("spec.resourcePools[0].tolerations", [{"operator": "Exists"}] * 65, "spec.resourcePools[0].tolerations"),
    ("spec.resourcePools", [{"name": f"p{i}"} for i in range(17)], "spec.resourcePools"),
    ("spec.kubernetes.headCpu", "1 core", "spec.kubernetes.headCpu"),
    ("spec.kubernetes.headMemory", "lots", "spec.kubernetes.headMemory"),
    ("spec.kubernetes.checkpointPvc", "My_Claim", "spec.kubernetes.checkpointPvc"),
    ("spec.kubernetes.checkpointPvc", "claim-", "spec.kubernetes.checkpointPvc"),
    ("spec.kubernetes.modelPvc", "m" * 254, "spec.kubernetes.modelPvc"),
    ("spec.kubernetes.dataPvc", "data..x", "spec.kubernetes.dataPvc"),
    ("spec.kubernetes.rayAuthSecret", "Token", "spec.kubernetes.rayAuthSecret"),
    ("spec.kubernetes.serviceAccountName", "sa name", "spec.kubernetes.serviceAccountName"),
    ("spec.kubernetes.rewardConfigMap", ".reward", "spec.kubernetes.rewardConfigMap"),
    ("spec.kubernetes.image", "", "spec.kubernetes.image"),
    ("spec.runPolicy.priorityClassName", "High", "spec.runPolicy.priorityClassName"),
    ("spec.runPolicy.schedulerName", "volcano scheduler", "spec.runPolicy.schedulerName"),
    ("spec.runPolicy.backoffLimit", 1001, "spec.runPolicy.backoffLimit"),
    ("spec.runPolicy.activeDeadlineSeconds", 2**31, "spec.runPolicy.activeDeadlineSeconds"),
    ("spec.trainer.steps", 10_000_001, "spec.trainer.steps"),
    ("spec.trainer.seed", -1, "spec.trainer.seed"),
    ("spec.trainer.seed", 2**32, "spec.trainer.seed"),
    ("spec.trainer.keepCheckpoints", 1025, "spec.trainer.keepCheckpoints"),
    ("spec.trainer.checkpointDir", "/" + "c" * 4096, "spec.trainer.checkpointDir"),
    ("spec.rollout.maxPromptLength", 2**20 + 1, "spec.rollout.maxPromptLength"),
    ("spec.rollout.responsesPerPrompt", 1025, "spec.rollout.responsesPerPrompt"),
    ("spec.training.microBatchSize", 2**20 + 1, "spec.training.microBatchSize"),
    ("spec.data.trainPrompts", 2**24 + 1, "spec.data.trainPrompts"),
    ("spec.data.chatTemplate", "t" * 65537, "spec.data.chatTemplate"),
    ("spec.data.train", ["t.jsonl"] * 1025, "spec.data.train"),
    ("spec.data.train", ["t" * 4097], "spec.data.train[0]"),
    ("spec.data.train", "t" * 4097, "spec.data.train[0]"),  # one path, as a list of one
    ("spec.data.eval", "", "spec.data.eval[0]"),
    ("spec.models.actor.tiny.numLayers", 1025, "spec.models.actor.tiny.numLayers"),
    ("spec.models.actor.path", "p" * 4097, "spec.models.actor.path"),
    ("spec.models.reward.function", {"path": "r.py", "name": "not-a-name"}, "spec.models.reward.function.name"),
    ("spec.metrics.address", "", "spec.metrics.address"),
    ("spec.placement", {f"r{i}": "default" for i in range(len(ROLES) + 1)}, "spec.placement"),
    # (a 64-character placement key: the CRD no longer refuses it, since `placement` is a map or `auto`, a node a
    # structural schema leaves untyped, and CEL over an untyped map exceeds the API server's cost budget; the spec
    # refuses it, naming only its length and start: test_spec's test_a_placement_key_is_bounded_and_never_quoted_whole)
    ("metadata.name", "n" * (MAX_JOB_NAME + 1), "metadata.name"),
]

# values at the bounds, accepted by both
GOOD = [
    ("spec.resourcePools[0].memoryPerNode", "1.5Gi"), ("spec.resourcePools[0].memoryPerNode", "512Mi"),
    ("spec.resourcePools[0].memoryPerNode", "2e9"), ("spec.resourcePools[0].memoryPerNode", ".5Gi"),
    ("spec.resourcePools[0].memoryPerNode", "1000000k"), ("spec.kubernetes.headCpu", "500m"),
    ("spec.kubernetes.headCpu", "0.5"), ("spec.resourcePools[0].name", "gpus0"),
    ("spec.resourcePools[0].name", "d" * 63), ("spec.placement", "auto"), ("spec.placement", {"actor": "default"}),
    ("spec.resourcePools[0].nodeSelector", {"topology.kubernetes.io/zone": "us-east-1a", "pool": ""}),
    ("spec.kubernetes.checkpointPvc", "claims.v1-a"), ("spec.kubernetes.modelPvc", "m" * 253),
    ("spec.runPolicy.backoffLimit", 1000), ("spec.runPolicy.priorityClassName", "high-priority"),
    ("spec.trainer.seed", 2**32 - 1), ("spec.trainer.steps", 10_000_000),
    ("spec.rollout.maxResponseLength", 2**20), ("spec.rollout.responsesPerPrompt", 1024),
    ("spec.data.trainPrompts", 2**24), ("spec.data.chatTemplate", "t" * 65536),
    ("metadata.name", "n" * MAX_JOB_NAME),
]


@pytest.mark.parametrize("path,value,field", BAD, ids=[f"{b[0]}={str(b[1])[:12]}" for b in BAD])
def test_crd_and_validate_both_refuse(path, value, field):
    doc = _with(path, value)
    crd, spec = crd_problems(doc), spec_problem(doc)
    assert crd, f"the CRD accepts {path}={value!r}"
    assert spec is not None, f"hybridflow validate accepts {path}={value!r}"
    assert f"{field}: " in spec or f"{field} " in spec, spec


@pytest.mark.parametrize("path,value", GOOD, ids=[f"{g[0]}={str(g[1])[:12]}" for g in GOOD])
def test_crd_and_validate_both_accept(path, value):
    doc = _with(path, value)
    assert crd_problems(doc) == []
    assert spec_problem(doc) is None


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_pass_the_cel_rules(path):
    doc = yaml.safe_load(path.read_text())
    assert cel_problems(_schema(), doc) == []
    assert cel_problems(_schema(), doc, copy.deepcopy(doc)) == []


def _files_job(train, eval_=None) -> dict:
    doc = _with("spec.models.actor", {"source": "smollm2"})
    doc["spec"]["models"]["reward"] = {"function": {"path": "r.py"}}
    doc["spec"]["data"] = {"source": "files", "train": train, **({"eval": eval_} if eval_ is not None else {})}
    return doc


@pytest.mark.parametrize("train,eval_", [("a.parquet", None), (["a.parquet"], ["b.parquet"]),
                                         ("a.parquet", "b.parquet")], ids=["one-path", "lists", "both-one-path"])
def test_one_path_or_a_list_both_accept(train, eval_):
    doc = _files_job(train, eval_)
    assert crd_problems(doc) == []
    assert spec_problem(doc) is None


def test_spec_data_stays_immutable_with_one_path():
    """`self == oldSelf` on spec.data sees train in either form (the API server compares an untyped value as
    it is stored)."""
    old = _files_job("a.parquet")
    assert cel_problems(_schema(), copy.deepcopy(old), old) == []
    for train in ("b.parquet", ["a.parquet", "b.parquet"]):
        assert cel_problems(_schema(), _files_job(train), old) == [
            "spec: " + immutable_field_rule("data")["message"]], train
