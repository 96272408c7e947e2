"""What a job's author may ask of the operator: the platform team's rules, from the chart's values.

The operator creates pods with its own rights, so whatever an RLHFJob names (image, ServiceAccount, volumes,
Secrets, scheduler, priority, tolerations, affinity) would otherwise be granted to anyone who may create an
RLHFJob: a confused deputy. These rules are checked at every gang start (a job that breaks them is Failed with the
rule and the value to change) and are shipped as a ValidatingAdmissionPolicy too (helm/.../admissionpolicy.yaml),
so that the API server refuses such a job at `kubectl apply`, and an update that sets or changes what they judge;
tests hold the two to the same verdicts.

Volumes a job mounts (PersistentVolumeClaims, the reward ConfigMap) must carry `FOR_JOBS_LABEL: "true"`: marking
one is a deliberate act of someone who may label it, so naming it in a job gives the author nothing its owner did
not grant; the operator checks it (an admission policy cannot look other objects up). A Ray token Secret the job
names is checked by the admission policy instead, with the API server's authorizer: its author must be allowed to
read that Secret (the operator itself may create Secrets but never read one).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from hybridflow.spec import API_GROUP, RLHFJob

FOR_JOBS_LABEL = f"{API_GROUP}/for-jobs"


@dataclass(frozen=True)
class Policy:
    """The chart's `jobPolicy` values. An empty allow-list allows nothing but the default (e.g. no priority class);
    `allowed_images` holds prefixes (`registry.example.com/team/`)."""

    allowed_images: tuple[str, ...] = ("hybridflow/",)
    require_image_digest: bool = False
    allowed_service_accounts: tuple[str, ...] = ()
    allowed_priority_classes: tuple[str, ...] = ()
    allowed_schedulers: tuple[str, ...] = ("volcano",)
    allow_tolerations: bool = False
    allow_affinity: bool = False  # affinity and nodeSelector: both pick nodes
    require_for_jobs_label: bool = True
    metrics_namespaces: tuple[str, ...] = field(default=())  # who may scrape the driver (plus the operator's own)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Policy":
        """From the operator Deployment's environment (the chart sets every variable)."""
        env = dict(os.environ if env is None else env)

        def items(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
            raw = env.get(key)
            return default if raw is None else tuple(x.strip() for x in raw.split(",") if x.strip())

        def flag(key: str, default: bool) -> bool:
            raw = env.get(key)
            return default if raw is None else raw.strip().lower() in ("1", "true", "yes")

        d = cls()
        return cls(
            allowed_images=items("HYBRIDFLOW_ALLOWED_IMAGES", d.allowed_images),
            require_image_digest=flag("HYBRIDFLOW_REQUIRE_IMAGE_DIGEST", d.require_image_digest),
            allowed_service_accounts=items("HYBRIDFLOW_ALLOWED_SERVICE_ACCOUNTS", d.allowed_service_accounts),
            allowed_priority_classes=items("HYBRIDFLOW_ALLOWED_PRIORITY_CLASSES", d.allowed_priority_classes),
            allowed_schedulers=items("HYBRIDFLOW_ALLOWED_SCHEDULERS", d.allowed_schedulers),
            allow_tolerations=flag("HYBRIDFLOW_ALLOW_TOLERATIONS", d.allow_tolerations),
            allow_affinity=flag("HYBRIDFLOW_ALLOW_AFFINITY", d.allow_affinity),
            require_for_jobs_label=flag("HYBRIDFLOW_REQUIRE_FOR_JOBS_LABEL", d.require_for_jobs_label),
            metrics_namespaces=items("HYBRIDFLOW_METRICS_NAMESPACES", d.metrics_namespaces),
        )


def violations(job: RLHFJob, policy: Policy) -> list[str]:
    """Every rule the job's spec breaks, each naming the field, the value and the chart value that governs it."""
    k8s, run = job.spec.kubernetes, job.spec.run_policy
    out = []
    image = k8s.image
    if not any(image.startswith(p) for p in image_prefixes(policy.allowed_images)):
        out.append(f"spec.kubernetes.image '{image}' is not under an allowed prefix "
                   f"({', '.join(policy.allowed_images) or 'none'}; chart value jobPolicy.allowedImages)")
    if policy.require_image_digest and "@sha256:" not in image:
        out.append(f"spec.kubernetes.image '{image}' must be pinned by digest (image@sha256:...; "
                   "chart value jobPolicy.requireImageDigest)")
    sa = k8s.service_account_name
    if sa and sa not in policy.allowed_service_accounts:
        out.append(f"spec.kubernetes.serviceAccountName '{sa}' is not allowed "
                   f"({', '.join(policy.allowed_service_accounts) or 'none'}; chart value "
                   "jobPolicy.allowedServiceAccounts)")
    pc = run.priority_class_name
    if pc and pc not in policy.allowed_priority_classes:
        out.append(f"spec.runPolicy.priorityClassName '{pc}' is not allowed "
                   f"({', '.join(policy.allowed_priority_classes) or 'none'}; chart value "
                   "jobPolicy.allowedPriorityClasses)")
    scheduler = run.scheduler_name or ("volcano" if run.gang_scheduling else None)
    if scheduler and scheduler not in policy.allowed_schedulers:
        out.append(f"spec.runPolicy.schedulerName '{scheduler}' is not allowed "
                   f"({', '.join(policy.allowed_schedulers) or 'none'}; chart value jobPolicy.allowedSchedulers)")
    for i, pool in enumerate(job.spec.resource_pools):
        if pool.tolerations and not policy.allow_tolerations:
            out.append(f"spec.resourcePools[{i}].tolerations: tolerations are not allowed "
                       "(chart value jobPolicy.allowTolerations)")
        if (pool.affinity or pool.node_selector) and not policy.allow_affinity:
            which = "affinity" if pool.affinity else "nodeSelector"
            out.append(f"spec.resourcePools[{i}].{which}: node placement (affinity, nodeSelector) is not allowed "
                       "(chart value jobPolicy.allowAffinity)")
    return out


def image_prefixes(prefixes: tuple[str, ...]) -> list[str]:
    """Prefixes end at a path boundary: `registry.example.com/ml` allows `registry.example.com/ml/...`, never
    `registry.example.com/ml-evil/...` (the chart's admission policy normalises them the same way)."""
    return [p if p.endswith(("/", ":", "@")) else p + "/" for p in prefixes]


def unmarked(kind: str, field_path: str, name: str, labels: dict[str, str] | None, policy: Policy) -> str | None:
    """The problem with mounting an object its owner did not mark for jobs, or None."""
    if not policy.require_for_jobs_label or (labels or {}).get(FOR_JOBS_LABEL) == "true":
        return None
    return (f"{field_path}: {kind} '{name}' is not marked for jobs; its owner marks it with "
            f"`kubectl label {kind.lower()} {name} {FOR_JOBS_LABEL}=true`")
