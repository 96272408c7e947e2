"""A `placement: auto` job's plan as data: the spec fields the device-mapping planner decides (the pools, the
placement, the rollout mode and generation layout, the training layout and micro-batch size), recorded once
(status.plan on Kubernetes) and laid over the accepted spec wherever the job is built. Here, in the job's API,
because the operator and the driver both apply it and neither may import the planner (hybridflow.mapping): on
Kubernetes a plan pod runs the planner (`hybridflow plan --auto`), the operator records what it printed, makes the
pools it asks for, and hands it to the job's pods (PLAN_ENV)."""
from __future__ import annotations

import json
from typing import Any

from hybridflow.api.errors import SpecError
from hybridflow.api.manifest_io import dump_job, parse_job
from hybridflow.api.schema import RLHFJob

PLAN_ENV = "HYBRIDFLOW_PLAN"  # the plan's fields as JSON, set by the operator on a placement: auto job's pods
MAX_PLAN_BYTES = 3500  # a plan pod's termination message holds at most 4096 bytes
TRAINING_FIELDS = ("engine", "tensorParallel", "pipelineParallel", "microBatchSize")
ROLLOUT_FIELDS = ("mode", "tensorParallel")


def plan_fields(resolved: RLHFJob) -> dict[str, Any]:
    """The fields of a resolved job that its plan decided: all a pod needs to build the same job from the accepted
    `placement: auto` spec."""
    spec = dump_job(resolved)["spec"]
    return {"resourcePools": spec["resourcePools"], "placement": spec["placement"],
            "training": {k: spec["training"][k] for k in TRAINING_FIELDS if k in spec["training"]},
            "rollout": {k: spec["rollout"][k] for k in ROLLOUT_FIELDS if k in spec["rollout"]}}


def apply_plan(job: RLHFJob, fields: dict[str, Any], source: str = "status.plan") -> RLHFJob:
    """The `placement: auto` job with its plan's fields laid over it (overlay)."""
    if job.spec.placement != "auto":
        raise SpecError(f"{source}: a plan is applied only to a job with spec.placement: auto")
    return overlay(job, fields, source)


def overlay(job: RLHFJob, fields: dict[str, Any], source: str) -> RLHFJob:
    """The job with a plan's fields laid over it (an elastic rolloutPool goes: the plan fixes the pools; the
    async-only rollout fields go outside mode async); validated again as a whole, so a plan that does not fit the
    spec is a SpecError naming `source`."""
    if not isinstance(fields, dict) or not {"resourcePools", "placement"} <= set(fields):
        raise SpecError(f"{source}: a plan names spec.resourcePools and spec.placement; got {sorted(fields or {})}")
    doc = dump_job(job)
    spec = doc["spec"]
    spec["resourcePools"], spec["placement"] = fields["resourcePools"], fields["placement"]
    spec.pop("rolloutPool", None)
    for section, allowed in (("training", TRAINING_FIELDS), ("rollout", ROLLOUT_FIELDS)):
        given = fields.get(section) or {}
        if set(given) - set(allowed):
            raise SpecError(f"{source}.{section}: the plan decides only {', '.join(allowed)}")
        spec[section] = {**spec.get(section, {}), **given}
    if spec["rollout"].get("mode") != "async":
        for key in ("maxStaleness", "partialRolloutTokens", "queuePrompts"):  # the rules allow them in async only
            spec["rollout"].pop(key, None)
    return parse_job(doc, source)


def plan_from_text(text: str, source: str) -> dict[str, Any]:
    """A plan as a plan pod prints it (JSON: {"summary": {...}, "fields": {...}}), checked for its shape."""
    if len(text.encode()) > MAX_PLAN_BYTES:
        raise SpecError(f"{source}: the plan is {len(text.encode())} bytes, more than {MAX_PLAN_BYTES}")
    try:
        plan = json.loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: nested deeper than a plan ever is
        raise SpecError(f"{source}: not a plan (JSON expected): {str(err)[:200]}") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("fields"), dict) or \
            not isinstance(plan.get("summary"), dict):
        raise SpecError(f"{source}: a plan is {{\"summary\": {{...}}, \"fields\": {{...}}}}")
    return plan
