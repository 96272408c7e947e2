"""The names the job's objects, pods and processes agree on: the API group and kind, roles, exit codes, mounts,
Kubernetes' naming grammars and the bounds that keep every child object's name valid. One place, imported by the
CRD, the schema, the operator and the runtime."""
from __future__ import annotations

import re

from hybridflow.api.roles import ROLE_KINDS

API_GROUP = "hybridflow.io"
VERSION = "v1alpha1"
PLURAL = "rlhfjobs"
API_VERSION = f"{API_GROUP}/{VERSION}"
KIND = "RLHFJob"

# The roles, in the order they are built and listed: those registered in hybridflow.api.roles (ROLE_KINDS). Fixed
# here, once: every role registers while hybridflow.api.roles is imported (the import above), before this reads
# them, and the placement's bound and the CRD (api.sections) are built from this tuple; so a role is registered in
# api.roles itself, never later by a plug-in or a test (it would be missing here and from the CRD).
ROLES: tuple[str, ...] = tuple(ROLE_KINDS)

# `hybridflow run|driver` exit codes; the operator fails a job without restarts when its driver exits EXIT_BAD_INPUT
# (a restart would read the same bad input again).
EXIT_FAILED, EXIT_BAD_INPUT = 1, 2
# A sandbox pod that refused to run user code without every layer of the sandbox (HYBRIDFLOW_SANDBOX=require):
# retrying on the same nodes cannot help, so the operator fails the job with the pod's message.
EXIT_SANDBOX_UNAVAILABLE = 3
# The driver's gauge of the layers its sandbox pool lacks (label `layer`), which the operator's progress poll
# turns into the job's SandboxPartial condition.
SANDBOX_MISSING_METRIC = "hybridflow_sandbox_layer_missing"

# Where the job's pods see the user's inputs: kubernetes.dataPvc (the prompt files, read-only in the head pod) and
# the job's copy of kubernetes.rewardConfigMap (its code files: the reward function's, the agent's tools and
# environment files; read-only in the head pod and the sandbox pool's). The operator rewrites spec.data.train/eval,
# reward.function.path and rollout.agent.toolsFile/environmentFile to point inside them.
DATA_MOUNT = "/data"
REWARD_MOUNT = "/var/lib/hybridflow/reward"


def reward_configmap_key(path: str) -> str:
    """The kubernetes.rewardConfigMap key a code file's path names (reward.function.path, rollout.agent.toolsFile or
    environmentFile; as written, or resolved into the mount)."""
    return path.removeprefix(REWARD_MOUNT + "/")


def pool_resource(name: str) -> str:
    """The Ray custom resource a node advertises for each device it brings to pool `name` (set by the operator's
    worker pods and by `hybridflow run`, requested by the controller's placement groups)."""
    return f"hybridflow_pool_{name}"


def pool_slot_resource(name: str, index: int) -> str:
    """The Ray custom resource the pod of index `index` in a pool of independent replicas (an async job's rollout
    pool) advertises beside its pool's, a unit per device. The controller's placement group for that pod asks for
    it, so Ray places a lost pod's replicas again only in its replacement (same index), and a pod added to an
    elastic pool (a new index) is told apart from one replacing another (trainer.generation's replicas)."""
    return f"{pool_resource(name)}_slot{index}"


# Kubernetes' own grammars (k8s.io/apimachinery's validation and resource.Quantity). Each is both a pydantic check
# and the CRD's `pattern`, so `hybridflow validate` and the API server give the same verdict. Anchored: pydantic and
# JSON Schema search, Kubernetes' Go regexp does too.
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
QUANTITY = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"  # unsigned: requests/limits
# No '-' in a pool name: worker pods are `<job>-<pool>-<index>-g<gen>`, and job names have dashes, so job `a` with
# pool `b-c` and job `a-b` with pool `c` would both name a pod `a-b-c-0-g0`. Without dashes the pool is the third
# dash-separated field from the right and the job everything before it: two jobs never share a pod name.
POOL_NAME = r"^[a-z0-9]+$"


# The objects the operator names after a job (`names`, `head_pod_name`, `worker_pod_name` below): the head Service
# `<job>-head` must be a DNS-1035 label (63 characters, a letter first), and the job name is also the value of the
# label hybridflow.io/job (63). The rest (`<job>-spec`, `-gang`, `-ray-token`, `-ingress`, pods `<job>-head-g<gen>`,
# `<job>-<pool>-<index>-g<gen>` and `<job>-plan`) are DNS-1123 subdomains (253), which the bounds below keep them far
# under (58 + 1 + 63 + 1 + 4 + 2 + 4 = 133).
SERVICE_SUFFIX = "-head"
MAX_JOB_NAME = 63 - len(SERVICE_SUFFIX)

# The labels the operator puts on a job's children (the chart's admission policy lets only the operator set them).
LABEL_JOB = f"{API_GROUP}/job"
LABEL_ROLE = f"{API_GROUP}/role"
LABEL_POOL = f"{API_GROUP}/pool"
LABEL_INDEX = f"{API_GROUP}/index"
LABEL_GENERATION = f"{API_GROUP}/generation"


def names(job_name: str) -> dict[str, str]:
    """The objects the operator names after a job, by kind."""
    return {
        "configmap": f"{job_name}-spec",
        "service": f"{job_name}{SERVICE_SUFFIX}",
        "podgroup": f"{job_name}-gang",
        "ray_token": f"{job_name}-ray-token",
        "sandbox_token": f"{job_name}-sandbox-token",  # opens the job's sandbox pool, nothing else
        "network_policy": f"{job_name}-ingress",
        "reward": f"{job_name}-reward",
        "workload": f"{job_name}-workload",  # Kueue's (a job labelled kueue.x-k8s.io/queue-name)
    }


def head_pod_name(job_name: str, generation: int) -> str:
    return f"{job_name}-head-g{generation}"


def worker_pod_name(job_name: str, pool: str, index: int, generation: int) -> str:
    return f"{job_name}-{pool}-{index}-g{generation}"


def plan_pod_name(job_name: str) -> str:
    """A `placement: auto` job's plan pod, run once before its first gang (no generation: the plan outlives
    restarts, in status.plan). No other pod's name ends so: gang pods end in -g<gen>, sandbox pods in a digit."""
    return f"{job_name}-plan"

# The rules on metadata.name; the CRD states them as CEL (crd.py), `hybridflow validate` with these messages.
JOB_NAME_TOO_LONG = (f"metadata.name: at most {MAX_JOB_NAME} characters, so that the head Service "
                     f"'<name>{SERVICE_SUFFIX}' fits in a 63-character DNS label; choose a shorter name")
JOB_NAME_NOT_DNS1035 = ("metadata.name: lowercase letters, digits and '-', starting with a letter and ending with a "
                        "letter or digit (a DNS-1035 label, as the head Service's name must be), e.g. 'tiny-grpo'")


def job_name_problems(name: str) -> list[str]:
    """What the CRD's CEL rules on metadata.name refuse (crd.py states the same two rules, with these messages)."""
    out = []
    if len(name) > MAX_JOB_NAME:
        out.append(JOB_NAME_TOO_LONG)
    if not re.fullmatch(DNS1035_LABEL, name):
        out.append(JOB_NAME_NOT_DNS1035)
    return out
