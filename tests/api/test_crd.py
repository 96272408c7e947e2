"""The CRD is generated from the spec: the committed file must match, and every example must fit its schema."""
from unittest.mock import ANY

import jsonschema
import pytest
import yaml

from hybridflow.api.crd import ELASTIC_RULES, build_crd, immutable_field_rule, render_crd

from support.paths import ROOT

CRD_FILE = ROOT / "crds" / "rlhfjob.yaml"


def test_committed_crd_matches_the_spec():
    assert CRD_FILE.read_text() == render_crd(), "crds/rlhfjob.yaml drifted from the spec: run `make crd`"


def _schema():
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node, path="$"):
    yield path, node
    for k, v in node.get("properties", {}).items():
        yield from _walk(v, f"{path}.{k}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    for path, node in _walk(_schema()):
        assert "$ref" not in node and "anyOf" not in node and "allOf" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"


def test_spec_fields_carry_descriptions_for_kubectl_explain():
    spec = _schema()["properties"]["spec"]
    missing = [p for p, n in _walk(spec) if not p.endswith(("[]", "{}")) and "description" not in n]
    assert not missing, missing


def test_printer_columns():
    cols = {c["name"]: c["jsonPath"] for c in build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert cols == {"Phase": ".status.phase", "Step": ".status.step", "Tokens/s": ".status.tokensPerSecond",
                    "Restarts": ".status.restarts", "Placement": ".status.plan.summary.placement",
                    "Age": ".metadata.creationTimestamp"}
    wide = [c["name"] for c in build_crd()["spec"]["versions"][0]["additionalPrinterColumns"] if c.get("priority")]
    assert wide == ["Placement"]  # `kubectl get -o wide` only: a placement: auto job's plan


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path):
    jsonschema.Draft4Validator(_schema()).validate(yaml.safe_load(path.read_text()))


def test_crd_schema_rejects_what_the_spec_rejects():
    doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    doc["spec"]["rollout"]["responsesPerPrompt"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(_schema()).validate(doc)


def test_only_run_policy_and_the_rollout_pool_size_may_change_after_creation():
    """One transition rule per field but runPolicy and rolloutPool, on spec itself: a rule on the field would be
    evaluated only where the old value exists, and so never see the field added; rolloutPool's rule holds only its
    presence (an elastic pool's size and bounds change, a job does not become elastic). No transition rule below
    spec."""
    spec = _schema()["properties"]["spec"]
    mutable = ("runPolicy", "rolloutPool")
    untyped = [f for f, node in spec["properties"].items() if "type" not in node]
    assert untyped == ["placement"]  # a map or `auto`: not in CEL's view of spec (a rule naming it cannot compile)
    assert spec["x-kubernetes-validations"] == [immutable_field_rule(f) for f in spec["properties"]
                                                if f not in (*mutable, *untyped)] + ELASTIC_RULES
    assert ELASTIC_RULES == [{"rule": "has(self.rolloutPool) == has(oldSelf.rolloutPool)", "message": ANY}]
    assert [f for f in spec["properties"] if f"has(self.{f})" in str(spec["x-kubernetes-validations"])] == \
        [f for f in spec["properties"] if f not in ("runPolicy", *untyped)]


def test_no_cel_rule_names_an_untyped_field():
    """The API server compiles each rule against the schema's typed view: a field without a type (a union the
    structural schema leaves untyped) is not in it, so a rule naming one would make the whole CRD refused."""
    spec = _schema()["properties"]["spec"]
    untyped = {f for f, node in spec["properties"].items() if "type" not in node}
    rules = [v["rule"] for _, n in _walk(spec, "spec") for v in n.get("x-kubernetes-validations") or []]
    assert rules and not [r for r in rules for f in untyped if f"self.{f}" in r]
    below = [p for p, n in _walk(spec, "spec") if p != "spec" and "oldSelf" in str(n.get("x-kubernetes-validations"))]
    assert below == []


def test_every_count_size_and_string_is_bounded():
    """Bounded input: every integer has a maximum, every string a maxLength (or an enum), every list maxItems and
    every map maxProperties, so the API server refuses what `hybridflow validate` refuses, and CEL cost estimates
    (`self == oldSelf` on each section) have bounds to work with."""
    unbounded = []
    for path, node in _walk(_schema()["properties"]["spec"], "spec"):
        kind = node.get("type")
        if ((kind == "integer" and "maximum" not in node)
                or (kind == "string" and not {"maxLength", "enum"} & node.keys())
                or (kind == "array" and "maxItems" not in node)
                or (kind == "object" and "additionalProperties" in node and "maxProperties" not in node)
                or (kind is None and "items" in node and "maxItems" not in node)  # a union holding a list
                or (kind is None and not {"maxLength", "maxItems"} & node.keys())):
            unbounded.append(path)
    assert not unbounded, f"give these a bound in spec.py: {unbounded}"


def test_job_name_rules_sit_at_the_root_where_cel_sees_metadata_name():
    root = _schema()
    assert [v["rule"] for v in root["x-kubernetes-validations"]] == [
        "self.metadata.name.size() <= 58", "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"]
    # what a CRD may say about metadata: name and generateName only (253: bounds the cost of `matches`)
    assert root["properties"]["metadata"] == {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 253}, "generateName": {"type": "string", "maxLength": 253}}}


def _files_job(data: dict) -> dict:
    return {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "files"},
            "spec": {"models": {"actor": {"source": "smollm2"}, "reward": {"function": {"path": "r.py"}}},
                     "data": {"source": "files", **data}}}


@pytest.mark.parametrize("data", [{"train": "a.parquet"}, {"train": ["a.parquet", "b/*.parquet"]},
                                  {"train": "a.parquet", "eval": "b.parquet"}, {"train": ["a"], "eval": ["b"]}],
                         ids=["one-path", "a-list", "both-one-path", "both-lists"])
def test_the_crd_takes_one_path_or_a_list_for_train_and_eval(data):
    """As `hybridflow validate` does: a structural schema cannot type a union, so these nodes are untyped
    (x-kubernetes-preserve-unknown-fields) and keep the bounds of both forms."""
    jsonschema.Draft4Validator(_schema()).validate(_files_job(data))


@pytest.mark.parametrize("data", [{"train": ""}, {"train": "t" * 4097}, {"train": ["t" * 4097]}, {"eval": [""]},
                                  {"train": ["t"] * 1025}, {"eval": [3]}],
                         ids=["empty", "too-long", "too-long-item", "empty-item", "too-many", "not-a-string-item"])
def test_the_crd_keeps_the_bounds_of_both_forms(data):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(_schema()).validate(_files_job({"train": "a.parquet", **data}))


def test_train_and_eval_are_the_only_untyped_spec_fields():
    """An untyped node is a union the API server cannot type-check (a number there is left to the operator's
    validation); only train and eval (a file or a list) and placement (a map or `auto`) are one, each keeping the
    bounds of its options' types."""
    untyped = [p for p, n in _walk(_schema()["properties"]["spec"], "spec") if "type" not in n]
    assert untyped == ["spec.data.train", "spec.data.eval", "spec.placement"]
    placement = _schema()["properties"]["spec"]["properties"]["placement"]
    assert (placement["maxProperties"], placement["maxLength"]) == (8, 4) and "enum" not in placement
    node = _schema()["properties"]["spec"]["properties"]["data"]["properties"]["train"]
    assert node["x-kubernetes-preserve-unknown-fields"] is True
    assert (node["minLength"], node["maxLength"], node["maxItems"]) == (1, 4096, 1024)
    assert node["items"] == {"type": "string", "minLength": 1, "maxLength": 4096}
