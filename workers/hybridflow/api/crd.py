"""The RLHFJob CustomResourceDefinition, generated from `hybridflow.api` so the two cannot disagree.

Kubernetes wants a *structural* schema: every node typed, no $ref, no anyOf for optionals, no additionalProperties:
false (pruning plays that role). The conversion below inlines pydantic's JSON Schema into that shape.
"""
from __future__ import annotations

from typing import Any

import yaml

from hybridflow.api.names import (
    API_GROUP, DNS1035_LABEL, JOB_NAME_NOT_DNS1035, JOB_NAME_TOO_LONG, KIND, MAX_JOB_NAME, PLURAL, VERSION,
)
from hybridflow.api.schema import JobSpec
from hybridflow.api.status import SHOWN

# Every bound the spec declares (maxima, lengths, patterns, item and property counts) reaches the CRD.
_KEEP = {"type", "description", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern",
         "minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties", "default"}  # fmt: skip


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node or "oneOf" in node:  # oneOf: a tagged union (spec.placement: a map or `auto`)
        given = node.get("anyOf") or node["oneOf"]
        options = [o for o in given if o.get("type") != "null"]
        nullable = len(options) != len(given)
        base = _structural(options[0], defs) if len(options) == 1 else _union([_structural(o, defs) for o in options])
        for key in ("description", "enum"):  # an optional registry name keeps its enum
            if key in node:
                base[key] = node[key]
        if nullable:
            base["nullable"] = True
        return base
    if "const" in node:
        node = {**node, "enum": [node["const"]]}
    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEEP}
    # OpenAPI v3.0 (which Kubernetes speaks) has boolean exclusive bounds, JSON Schema numeric ones.
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if key in out:
            out[bound] = out.pop(key)
            out[key] = True
    out.pop("default", None)  # defaults live in the spec; the operator resolves them
    t = node.get("type")
    if t == "object" or "properties" in node:
        out["type"] = "object"
        props = node.get("properties", {})
        if props:
            out["properties"] = {k: _structural(v, defs) for k, v in props.items()}
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = _structural(extra, defs)
        key_bound = (node.get("propertyNames") or {}).get("maxLength")
        if key_bound is not None:  # a structural schema has no propertyNames: its keys' bound becomes CEL
            out["x-kubernetes-validations"] = [{"rule": f"self.all(k, k.size() <= {key_bound})",
                                                "message": f"keys are at most {key_bound} characters"}]
        elif not props:
            out["x-kubernetes-preserve-unknown-fields"] = True
        req = node.get("required")
        if req:
            out["required"] = req
    elif t == "array":
        out["items"] = _structural(node.get("items", {}), defs)
    elif t is None and "enum" in out:
        out["type"] = "string"
    return out


def _union(options: list[dict[str, Any]]) -> dict[str, Any]:
    """A value of one of several types, e.g. `train: a.parquet` or `train: [a.parquet, b.parquet]`. A structural
    schema cannot type it (a typed anyOf is allowed only for int-or-string), so the node is untyped
    (x-kubernetes-preserve-unknown-fields) and keeps each option's own bounds: JSON Schema and the API server apply
    maxLength only to strings, maxItems and items only to lists. A value of none of the types (a number, a map) is
    then left to the spec's own validation (`hybridflow validate`, the operator). An object option (`placement: auto`
    or a map) keeps only its count bound (maxProperties applies to objects only; what its values are is the spec's
    to check). Options that share a type cannot be merged so; they keep no bounds."""
    untyped: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}
    kinds = [o.get("type") for o in options]
    if len(set(kinds)) != len(kinds) or None in kinds:
        return untyped
    options = [{k: v for k, v in o.items() if k in ("type", "minProperties", "maxProperties")}
               if o.get("type") == "object" else _enum_as_length(o) for o in options]
    merged = dict(untyped)
    for option in options:
        for key, value in option.items():
            if key != "type" and merged.setdefault(key, value) != value:
                return untyped  # two options bound the same keyword differently
    return merged


def _enum_as_length(option: dict[str, Any]) -> dict[str, Any]:
    """A string option's enum (`auto`) as its longest length: an enum on an untyped node would hold every other
    option's values to it too."""
    if "enum" not in option:
        return option
    out = {k: v for k, v in option.items() if k != "enum"}
    out["maxLength"] = max(len(str(v)) for v in option["enum"])
    return out


# Only runPolicy (suspend, deadlines, backoff) and an elastic rollout pool's bounds and size may change once a job
# exists: the running gang, its checkpoints and its ConfigMap all assume the rest. The API server enforces this with
# CEL transition rules; the operator also ignores such changes (with a Warning) where no API server enforces them.
MUTABLE_SPEC_FIELDS = {"runPolicy", "rolloutPool"}

# spec.rolloutPool may change, but not come or go: a job is made elastic (or not) when it is created. Its size is
# held within its bounds here too, so that `kubectl scale` past them is refused by the API server, not failed later.
ELASTIC_RULES: list[dict[str, str]] = [
    {"rule": "has(self.rolloutPool) == has(oldSelf.rolloutPool)",
     "message": "spec.rolloutPool cannot be added or removed once the job exists; only its replicas, minReplicas "
                "and maxReplicas can change (delete and re-create the job to make it elastic)"},
]
ROLLOUT_POOL_RULES: list[dict[str, str]] = [
    {"rule": "!has(self.replicas) || (self.replicas <= self.maxReplicas && "
             "self.replicas >= (has(self.minReplicas) ? self.minReplicas : 1))",
     "message": "replicas must lie within minReplicas..maxReplicas"},
    {"rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
     "message": "minReplicas must not be above maxReplicas"},
]


def immutable_field_rule(field: str) -> dict[str, str]:
    """A transition rule on `spec` for one of its fields. On `spec` itself, not on the field: the API server
    evaluates a transition rule only where the old value exists, so `self == oldSelf` on the field never saw a
    field added to a job that had none (a Secret patched into a job created without spec.kubernetes)."""
    return {
        "rule": f"has(self.{field}) == has(oldSelf.{field}) && (!has(self.{field}) || self.{field} == oldSelf.{field})",
        "message": f"spec.{field} cannot be added, changed or removed once the job exists; only spec.runPolicy and "
                   "spec.rolloutPool can (delete and re-create the job to change it)",
    }


def spec_schema() -> dict[str, Any]:
    raw = JobSpec.model_json_schema(by_alias=True)
    schema = _structural(raw, raw.get("$defs", {}))
    # An untyped field (spec.placement: a map or `auto`) is not in CEL's view of spec: a rule naming it would not
    # compile, and the API server would refuse the CRD. Its edits are the operator's to ignore (the accepted spec
    # runs, with a SpecChangeIgnored warning), as for any field once a job exists.
    schema["x-kubernetes-validations"] = [immutable_field_rule(f) for f, node in schema["properties"].items()
                                          if f not in MUTABLE_SPEC_FIELDS and "type" in node] + ELASTIC_RULES
    schema["properties"]["rolloutPool"]["required"] = ["maxReplicas"]
    schema["properties"]["rolloutPool"]["x-kubernetes-validations"] = ROLLOUT_POOL_RULES
    schema["description"] = "What to train and how: algorithm, models, data, rollout, training, pools, trainer."
    return schema


# The job's name becomes part of its children's names, so it is held to what the strictest child needs (see
# MAX_JOB_NAME in api/names.py); `hybridflow validate` checks the same (names.job_name_problems). Only CEL at the
# root can see metadata.name. Declaring name and generateName with Kubernetes' own 253-character limit is what the
# API server allows under a CRD's metadata, and gives the CEL cost estimator a bound for `matches` (else it assumes
# the whole request).
METADATA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 253}, "generateName": {"type": "string", "maxLength": 253}},
}
ROOT_VALIDATIONS: list[dict[str, str]] = [
    {"rule": f"self.metadata.name.size() <= {MAX_JOB_NAME}", "message": JOB_NAME_TOO_LONG},
    {"rule": f"self.metadata.name.matches('{DNS1035_LABEL}')", "message": JOB_NAME_NOT_DNS1035},
]


STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Observed state, written by the operator and the job's driver.",
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "phase": {"type": "string", "description": ", ".join(SHOWN[:-1]) + f" or {SHOWN[-1]}."},
        "step": {"type": "integer", "description": "Last completed RLHF iteration."},
        "totalSteps": {"type": "integer", "description": "Iterations requested."},
        "tokensPerSecond": {"type": "number", "description": "Throughput of the last iteration."},
        "restarts": {"type": "integer", "description": "Gang restarts so far."},
        "lastCheckpoint": {"type": "string", "description": "Path of the newest checkpoint."},
        "lastCheckpointTime": {"type": "string", "format": "date-time", "description": "When it was written."},
        "message": {"type": "string", "description": "Human-readable summary of the phase."},
        "conditions": {
            "type": "array",
            "description": "metav1.Condition list.",
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
        "rolloutReplicas": {"type": "integer", "description": "An elastic rollout pool: the pods it has been given "
                            "(the scale subresource's status.replicas)."},
        "rolloutSelector": {"type": "string", "description": "An elastic rollout pool: the label selector of its "
                            "pods (the scale subresource's selector, for an HorizontalPodAutoscaler)."},
        "lastRolloutScale": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                             "description": "The last change of the elastic rollout pool's size: from, to, time."},
        "plan": {
            "type": "object",
            "description": "spec.placement auto: the plan its plan pod made before the first gang (hybridflow plan "
            "--auto), kept for the job's life: the summary (placement, pools, layout, predicted step time) and the "
            "spec fields it decides, which the operator lays over the accepted spec.",
            "properties": {
                "summary": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                            "description": "What the planner chose and predicted."},
                "fields": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                           "description": "The spec fields it decides (resourcePools, placement, layouts)."},
            },
        },
        "pools": {
            "type": "array",
            "description": "One entry per resource pool, in spec.resourcePools' order: the roles spec.placement puts "
            "on it (the first pool takes the rest), and its pods of the current gang generation and how many are "
            "Ready.",
            "items": {
                "type": "object",
                "required": ["name", "roles", "pods", "ready"],
                "properties": {
                    "name": {"type": "string", "description": "The pool's name (spec.resourcePools[].name)."},
                    "roles": {"type": "array", "items": {"type": "string"}, "description": "Roles placed on it."},
                    "pods": {"type": "integer", "description": "Its pods of the current generation."},
                    "ready": {"type": "integer", "description": "Those of them that are Ready."},
                },
            },
        },
    },
}


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": "rlhfjob", "shortNames": ["rlhf"],
                      "listKind": f"{KIND}List", "categories": ["all", "ml"]},
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": {
                        "specReplicasPath": ".spec.rolloutPool.replicas",
                        "statusReplicasPath": ".status.rolloutReplicas",
                        "labelSelectorPath": ".status.rolloutSelector"}},
                    "additionalPrinterColumns": [
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
                        {"name": "Tokens/s", "type": "number", "jsonPath": ".status.tokensPerSecond"},
                        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
                        {"name": "Placement", "type": "string", "priority": 1,
                         "jsonPath": ".status.plan.summary.placement"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An RLHF training job run HybridFlow-style on Ray inside pods.",
                            "required": ["spec"],
                            "x-kubernetes-validations": ROOT_VALIDATIONS,
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": METADATA_SCHEMA,
                                "spec": spec_schema(),
                                "status": STATUS_SCHEMA,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    header = "# Generated by `hybridflow crd` from workers/hybridflow/api/schema.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)
