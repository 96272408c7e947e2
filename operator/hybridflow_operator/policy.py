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

The Secrets a job names (rayAuthSecret, checkpointSecret, trackingSecret) are judged for every job, wherever it is
created (issue 51 H2): those three rules are a policy of their own (`<release>-job-secrets`), bound in every
namespace, not only in the served ones, so a job created before its namespace was served (labelled, or added to
watchNamespaces) was judged when it named them, by the authorizer, with the full identity of whoever named them
(user, groups, extra). The alternative, recording the creator at admission and asking a SubjectAccessReview at every
gang start, was not chosen: a validating policy cannot write the record, a MutatingAdmissionPolicy is alpha in
Kubernetes 1.32 and a beta API off by default in 1.34 (the chart supports 1.30+), a webhook would put the operator
in the path of every job create, and the operator would need cluster-wide `create subjectaccessreviews`. Left as
before: a job created while no such policy existed (admissionPolicy.enabled=false, or before the chart was
installed) was never judged; a revoked right does not stop a job admitted before.

Where a job's pods may connect to (`Egress`, the chart's `networkPolicy` values): their own pods, the cluster's DNS,
the object store when the job checkpoints to one, and what the platform team adds; never the addresses where
clouds serve instance metadata and credentials (`METADATA_RANGES`: the link-local ranges, 169.254.169.254, and
fd00:ec2::254, fd00:ec2::23, 100.100.100.200). A cluster-wide operator acts only in namespaces carrying
`NAMESPACE_LABEL`. With `require_queue` (the chart's kueue.required) every job must be queued through Kueue.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from hybridflow.api import API_GROUP, RLHFJob

FOR_JOBS_LABEL = f"{API_GROUP}/for-jobs"
# A cluster-wide install acts only in namespaces labelled so (the chart's clusterWide mode sets it).
NAMESPACE_LABEL = f"{API_GROUP}/jobs=enabled"

# Where clouds serve instance metadata and credentials of the node's cloud identity. No egress rule may reach them:
# an ipBlock inside one is refused, one that contains one gets it as `except`. The link-local ranges (169.254.169.254
# on AWS, GCP, Azure; EKS Pod Identity's 169.254.170.23), and the addresses outside them: AWS's IPv6 instance
# metadata service and Pod Identity agent (fd00:ec2::254, fd00:ec2::23, in a unique-local range) and Alibaba
# Cloud's metadata service (100.100.100.200, in the shared 100.64.0.0/10). In this order (the excepts' order). The
# chart's _helpers.tpl (hybridflow.metadataRanges, hybridflow.relation) decides the same for the operator's own
# NetworkPolicy.
LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
METADATA_RANGES = (LINK_LOCAL[0], ipaddress.ip_network("100.100.100.200/32"), LINK_LOCAL[1],
                   ipaddress.ip_network("fd00:ec2::254/128"), ipaddress.ip_network("fd00:ec2::23/128"))
DNS_PORTS = ({"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53})
# kube-dns / CoreDNS as kubeadm, kind, GKE, EKS and AKS run it (its pods keep the k8s-app=kube-dns label).
DEFAULT_DNS: dict[str, Any] = {
    "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
    "ports": [dict(p) for p in DNS_PORTS],
}


class PolicyError(ValueError):
    """The chart's values (the operator's environment) ask for something that is never allowed."""


def _network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(cidr, strict=False)
    except ValueError as err:
        raise PolicyError(f"'{cidr}' is not a CIDR ({err})") from None


def relation(cidr: str, other: str) -> str:
    """What `other` is to the CIDR: "inside" (the CIDR lies in it, or is it), "contains" (the CIDR holds all of it)
    or "apart" (they share no address; another family always)."""
    net, bad = _network(cidr), _network(other)
    if net.version != bad.version:
        return "apart"
    if net.subnet_of(bad):  # type: ignore[arg-type]
        return "inside"
    return "contains" if bad.subnet_of(net) else "apart"  # type: ignore[arg-type]


def metadata_relations(cidr: str) -> list[tuple[str, str]]:
    """(relation, range) for each of METADATA_RANGES of the CIDR's family, in their order."""
    version = _network(cidr).version
    return [(relation(cidr, str(r)), str(r)) for r in METADATA_RANGES if r.version == version]


def _what(bad: str) -> str:
    if _network(bad) in LINK_LOCAL:
        return "link-local: the cloud metadata service"
    return "a cloud metadata service's address"


def confine_peer(peer: dict[str, Any], where: str) -> dict[str, Any]:
    """A NetworkPolicyPeer that cannot reach the metadata addresses (METADATA_RANGES): an ipBlock containing one gets
    it as `except`; one inside one is refused (PolicyError naming `where`). Selector peers (pods, namespaces) pass as
    they are."""
    if not isinstance(peer, dict) or not peer:
        raise PolicyError(f"{where}: a NetworkPolicyPeer (ipBlock, namespaceSelector, podSelector), got {peer!r}")
    block = peer.get("ipBlock")
    if block is None:
        return peer
    if not isinstance(block, dict) or not isinstance(block.get("cidr"), str):
        raise PolicyError(f"{where}.ipBlock: needs a cidr, got {block!r}")
    found = metadata_relations(block["cidr"])
    for verdict, bad in found:
        if verdict == "inside":
            raise PolicyError(f"{where}.ipBlock.cidr {block['cidr']} is inside {bad} ({_what(bad)}); no job or "
                              "operator may reach it")
    excepts = [str(e) for e in block.get("except") or []]
    added = False
    for verdict, bad in found:
        # unless an `except` already holds the whole range
        if verdict == "contains" and not any(relation(bad, e) == "inside" for e in excepts):
            excepts.append(bad)
            added = True
    return {**peer, "ipBlock": {**block, "except": excepts}} if added else peer


def confine_rule(rule: dict[str, Any], where: str) -> dict[str, Any]:
    """A NetworkPolicyEgressRule with every peer confined. A rule must name its peers: one without `to` would allow
    every destination, the metadata service included."""
    if not isinstance(rule, dict) or set(rule) - {"to", "ports"}:
        raise PolicyError(f"{where}: an egress rule has only `to` and `ports`, got {rule!r}")
    to = rule.get("to")
    if not to or not isinstance(to, list):
        raise PolicyError(f"{where}.to: list the peers it allows (an egress rule without `to` allows every "
                          "destination); for anywhere but link-local give ipBlock 0.0.0.0/0 (and ::/0)")
    out = {"to": [confine_peer(p, f"{where}.to[{i}]") for i, p in enumerate(to)]}
    if rule.get("ports"):
        if not isinstance(rule["ports"], list) or not all(isinstance(p, dict) for p in rule["ports"]):
            raise PolicyError(f"{where}.ports: a list of NetworkPolicyPorts ({{protocol, port}}), got {rule['ports']!r}")
        out["ports"] = [dict(p) for p in rule["ports"]]
    return out


@dataclass(frozen=True)
class Egress:
    """Where a job's pods may connect to besides their own pods (the chart's `networkPolicy` values): `dns` and
    `object_store` are egress rules ({to: [peers], ports: [...]}); the object store's applies only to jobs whose
    trainer.checkpointDir or resumeFrom is a URL, and only when it names peers; `extra` rules apply to every job.
    Every rule is confined (`confine_rule`) when the policy is read, so a bad value stops the operator at start."""

    dns: dict[str, Any] = field(default_factory=lambda: json.loads(json.dumps(DEFAULT_DNS)))
    object_store: dict[str, Any] = field(default_factory=lambda: {"to": [], "ports": [{"protocol": "TCP",
                                                                                         "port": 443}]})
    extra: tuple[dict[str, Any], ...] = ()

    def rules(self, object_storage: bool) -> list[dict[str, Any]]:
        """The egress rules for a job's pods, beyond the one to the job's own pods."""
        out = [confine_rule(self.dns, "networkPolicy.dns")]
        if object_storage and self.object_store.get("to"):
            out.append(confine_rule(self.object_store, "networkPolicy.objectStore"))
        out += [confine_rule(r, f"networkPolicy.egressExtra[{i}]") for i, r in enumerate(self.extra)]
        return out

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "Egress":
        def parsed(key: str, kind: type) -> Any:
            raw = env.get(key)
            if raw is None or not raw.strip():
                return None
            try:
                value = json.loads(raw)
            except ValueError as err:
                raise PolicyError(f"{key}: not JSON ({err})") from None
            if not isinstance(value, kind):
                raise PolicyError(f"{key}: a JSON {kind.__name__}, got {raw[:200]}")
            return value

        d = cls()
        egress = cls(dns=parsed("HYBRIDFLOW_EGRESS_DNS", dict) or d.dns,
                     object_store=parsed("HYBRIDFLOW_EGRESS_OBJECT_STORE", dict) or d.object_store,
                     extra=tuple(parsed("HYBRIDFLOW_EGRESS_EXTRA", list) or ()))
        egress.rules(object_storage=True)  # every rule checked now: a value the chart should have refused stops here
        return egress


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
    egress: Egress = field(default_factory=Egress)
    # "key=value": the label a namespace must carry for the operator to act in it ("": every namespace it watches)
    namespace_label: str = ""
    require_queue: bool = False  # every job is queued through Kueue (chart value kueue.required)
    # RuntimeClasses a job may name in spec.sandbox.runtimeClassName (its sandbox pods only): runtimes with a kernel
    # of their own, gVisor's and Kata's usual names. A RuntimeClass picks the pods' runtime handler (one configured
    # unconfined, privileged, with the node's devices) and can carry scheduling (tolerations, a nodeSelector) and
    # overhead; naming one is the platform team's choice, not the job author's. Empty: none (the default below).
    allowed_runtime_classes: tuple[str, ...] = ("gvisor", "runsc", "kata", "kata-qemu", "kata-clh", "kata-fc")
    # The RuntimeClass of the sandbox pods of jobs that leave spec.sandbox.runtimeClassName unset ("": the
    # cluster's default runtime); chart value jobPolicy.sandboxRuntimeClassName. The platform team's own choice: not
    # judged by allowed_runtime_classes. Given to the pod builder (environments.environment_pod).
    sandbox_runtime_class: str = ""

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
            egress=Egress.from_env(env),
            namespace_label=_label(env.get("HYBRIDFLOW_NAMESPACE_LABEL", d.namespace_label)),
            require_queue=flag("HYBRIDFLOW_KUEUE_REQUIRED", d.require_queue),
            allowed_runtime_classes=tuple(_runtime_class("HYBRIDFLOW_ALLOWED_RUNTIME_CLASSES", c) for c in
                                          items("HYBRIDFLOW_ALLOWED_RUNTIME_CLASSES", d.allowed_runtime_classes)),
            sandbox_runtime_class=_runtime_class("HYBRIDFLOW_SANDBOX_RUNTIME_CLASS",
                                                 env.get("HYBRIDFLOW_SANDBOX_RUNTIME_CLASS", d.sandbox_runtime_class)),
        )

    def acts_in(self, namespace_labels: dict[str, str] | None) -> bool:
        """Whether the operator may act in a namespace with these labels (None: the namespace was not found)."""
        if not self.namespace_label:
            return True
        key, value = self.namespace_label.split("=", 1)
        return namespace_labels is not None and namespace_labels.get(key) == value


# A RuntimeClass's name: a DNS subdomain (the API server refuses a pod naming anything else).
_RUNTIME_CLASS = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def _runtime_class(key: str, raw: str) -> str:
    raw = raw.strip()
    if raw and (len(raw) > 253 or not _RUNTIME_CLASS.match(raw)):
        raise PolicyError(f"{key}: a RuntimeClass name (lowercase letters, digits, '-', '.'), got '{raw}'")
    return raw


def _label(raw: str) -> str:
    raw = raw.strip()
    if raw and (raw.count("=") != 1 or not all(raw.split("="))):
        raise PolicyError(f"HYBRIDFLOW_NAMESPACE_LABEL: key=value, got '{raw}'")
    return raw


def violations(job: RLHFJob, policy: Policy) -> list[str]:
    """Every rule the job's spec breaks, each naming the field, the value and the chart value that governs it."""
    k8s, run = job.spec.kubernetes, job.spec.run_policy
    out = []
    pool = job.spec.environments
    for where, image in (("spec.kubernetes.image", k8s.image),
                         ("spec.environments.image", pool.image if pool is not None else None)):
        if image is None:  # the environment pool's default: kubernetes.image, judged above
            continue
        if not any(image.startswith(p) for p in image_prefixes(policy.allowed_images)):
            out.append(f"{where} '{image}' is not under an allowed prefix "
                       f"({', '.join(policy.allowed_images) or 'none'}; chart value jobPolicy.allowedImages)")
        if policy.require_image_digest and "@sha256:" not in image:
            out.append(f"{where} '{image}' must be pinned by digest (image@sha256:...; "
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
    rc = job.spec.sandbox.runtime_class_name
    if rc and rc not in policy.allowed_runtime_classes:
        out.append(f"spec.sandbox.runtimeClassName '{rc}' is not allowed "
                   f"({', '.join(policy.allowed_runtime_classes) or 'none'}; chart value "
                   "jobPolicy.allowedRuntimeClasses)")
    for i, pool in enumerate(job.spec.resource_pools):
        if pool.tolerations and not policy.allow_tolerations:
            out.append(f"spec.resourcePools[{i}].tolerations: tolerations are not allowed "
                       "(chart value jobPolicy.allowTolerations)")
        if (pool.affinity or pool.node_selector) and not policy.allow_affinity:
            which = "affinity" if pool.affinity else "nodeSelector"
            out.append(f"spec.resourcePools[{i}].{which}: node placement (affinity, nodeSelector) is not allowed "
                       "(chart value jobPolicy.allowAffinity)")
    return out


def queue_problem(queue: str | None, policy: Policy) -> str | None:
    """Why a job labelled for this Kueue LocalQueue (None: not labelled) may not be accepted, or None: with
    kueue.required, a job that is not queued would run past every queue's quota. Judged at acceptance, as the
    admission policy judges the label at creation (and its removal by an update)."""
    if queue or not policy.require_queue:
        return None
    return ("metadata.labels[kueue.x-k8s.io/queue-name]: this cluster admits jobs only through Kueue (chart value "
            "kueue.required); label the job with its LocalQueue (kueue.x-k8s.io/queue-name: <queue>) and create it "
            "again")


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
