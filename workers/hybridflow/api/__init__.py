"""The job's contract, torch-free: what an RLHFJob may say (schema and rules), how a manifest is read, the names
and phases the operator and the runtime share, the storage-URL grammar and the engine kinds. The operator imports
only this package of the runtime (an import-linter contract in pyproject.toml keeps it so)."""
from hybridflow.api.errors import SpecError, format_validation_error
from hybridflow.api.fields import MAX_BACKOFF, MAX_COUNT, MAX_NODES, MAX_PATH
from hybridflow.api.manifest_io import MAX_MANIFEST_BYTES, MAX_YAML_DEPTH, dump_job, load_job, loads_job, parse_job
from hybridflow.api.names import (
    API_GROUP, API_VERSION, DATA_MOUNT, DNS1035_LABEL, DNS1123_LABEL, DNS1123_SUBDOMAIN, EXIT_BAD_INPUT, EXIT_FAILED,
    EXIT_SANDBOX_UNAVAILABLE, JOB_NAME_NOT_DNS1035, JOB_NAME_TOO_LONG, KIND, MAX_JOB_NAME, PLURAL, POOL_NAME,
    REWARD_MOUNT, ROLES, VERSION, job_name_problems, pool_resource, pool_slot_resource, reward_configmap_key,
)
from hybridflow.api.schema import (
    Algorithm, Data, JobSpec, Kubernetes, Metadata, Metrics, ResourcePool, RLHFJob, Rollout, RunPolicy, Trainer,
    Training,
)
from hybridflow.api.sources import ModelSource, Models, RewardFunctionSpec, RewardSpec, ScorerPart, TinyModel
from hybridflow.api.status import ACTIVE, TERMINAL, JobStatus, Phase

__all__ = [
    "API_GROUP", "API_VERSION", "DATA_MOUNT", "DNS1035_LABEL", "DNS1123_LABEL", "DNS1123_SUBDOMAIN", "EXIT_BAD_INPUT",
    "EXIT_FAILED", "EXIT_SANDBOX_UNAVAILABLE", "JOB_NAME_NOT_DNS1035", "JOB_NAME_TOO_LONG", "KIND", "MAX_BACKOFF",
    "MAX_COUNT", "MAX_JOB_NAME",
    "MAX_MANIFEST_BYTES", "MAX_NODES", "MAX_PATH", "MAX_YAML_DEPTH", "PLURAL", "POOL_NAME", "REWARD_MOUNT", "ROLES",
    "VERSION", "ACTIVE", "TERMINAL", "JobStatus", "Phase", "Algorithm", "Data", "JobSpec", "Kubernetes", "Metadata", "Metrics", "ModelSource", "Models",
    "RLHFJob", "ResourcePool", "RewardFunctionSpec", "RewardSpec", "Rollout", "RunPolicy", "ScorerPart", "SpecError",
    "TinyModel", "Trainer", "Training", "dump_job", "format_validation_error", "job_name_problems", "load_job", "loads_job",
    "parse_job", "pool_resource", "pool_slot_resource", "reward_configmap_key",
]
