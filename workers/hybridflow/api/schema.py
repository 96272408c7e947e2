"""The RLHFJob manifest: one source of truth for the CRD, the operator's validation and the controller's config.
Its sections and all of its fields are in api.sections; `JobSpec` here is those fields checked together (api.rules),
and `RLHFJob` the whole manifest.

Torch-free on purpose: the operator and `hybridflow crd` import this package and must stay light. Field names are
camelCase in YAML (Kubernetes style) and snake_case in Python.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from hybridflow.api.fields import SpecModel, matching
from hybridflow.api.names import API_VERSION, DNS1123_LABEL, KIND, job_name_problems
from hybridflow.api.rules import cross_field_problems
from hybridflow.api.sections import (
    Algorithm, Data, JobFields, Kubernetes, Metrics, ResourcePool, Rollout, RolloutPool, RunPolicy, Trainer, Tracking,
    Training,
)

__all__ = ["Algorithm", "Data", "JobSpec", "Kubernetes", "Metadata", "Metrics", "RLHFJob", "ResourcePool", "Rollout",
           "RolloutPool", "RunPolicy", "Trainer", "Tracking", "Training"]


# A job's spec: its fields (api.sections.JobFields), each valid alone, and valid together (api.rules). No docstring:
# the CRD would take it as the spec's description.
class JobSpec(JobFields):
    @model_validator(mode="after")
    def _consistent(self) -> "JobSpec":
        problems = cross_field_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class Metadata(SpecModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field("rlhfjob", description="Job name.")
    namespace: Annotated[str, Field(max_length=63), matching(DNS1123_LABEL, "a namespace name (a DNS-1123 label)")
                         ] | None = None

    @field_validator("name")
    @classmethod
    def _child_names_fit(cls, name: str) -> str:
        problems = job_name_problems(name)
        if problems:
            raise ValueError("; ".join(p.removeprefix("metadata.name: ") for p in problems))
        return name


class RLHFJob(SpecModel):
    api_version: Literal["hybridflow.io/v1alpha1"] = Field(API_VERSION, description="API version.")
    kind: Literal["RLHFJob"] = Field(KIND, description="Kind.")
    metadata: Metadata = Field(default_factory=Metadata)
    spec: JobSpec = Field(default_factory=JobSpec)
