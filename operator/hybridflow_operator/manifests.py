"""Every object the operator creates, built by pure functions from the parsed job (and the job object's uid,
the one fact of its children the spec does not hold): the job in, dicts out, no I/O. This module makes the job's
static children (Service, PodGroup, token Secrets, NetworkPolicy) and checks what pods may reference; the pods are
pods.py's, the resolved spec and its ConfigMaps resolve.py's, names and labels meta.py's. It is the one name the
rest of the operator (and its tests) imports them by.
"""
from __future__ import annotations

import base64
from typing import Any

from hybridflow.api import API_GROUP as GROUP
from hybridflow.api import REWARD_MOUNT, RLHFJob, reward_configmap_key
from hybridflow.api.agents import ENDPOINT_PORTS_ENV, ENVIRONMENT_URLS_ENV, POD_IP_ENV, sandbox_pool
from hybridflow.api.names import (
    LABEL_GENERATION, LABEL_INDEX, LABEL_JOB, LABEL_POOL, LABEL_ROLE, head_pod_name, names, worker_pod_name,
)
from hybridflow.api.scaling import sized
from hybridflow.api.storage import CHECKPOINT_MOUNT, is_url, job_checkpoint_url

from hybridflow_operator.meta import (
    AGENT_ENDPOINT_PORTS, ENVIRONMENT_PORT, ENVIRONMENT_ROLE, FS_GROUP, MANAGED_BY, MODEL_CACHE, MODELS_MOUNT,
    RAY_AGENT_PORT, RAY_PORT, RESUME_MOUNT, SANDBOX_ENV, SANDBOX_PARTIAL, SANDBOX_REQUIRED, SANDBOX_TOKEN_ENV,
    SANDBOX_TOKEN_KEY, SCRATCH_MOUNT, SCRATCH_SIZE, SPEC_KEY, SPEC_MOUNT, object_meta, job_labels, job_namespace,
    metrics_port, owner_reference, ray_token_secret_name, selector,
)
from hybridflow_operator.pods import (
    CONTAINER_SECURITY, POD_SECURITY, agent_endpoint_ports, environment_pod_name, environment_service_name,
    environment_urls, gang_pods, head_pod, leave_grace_seconds, runs_program, sandbox_token_env, sandbox_urls_env,
    worker_pod,
)
from hybridflow_operator.policy import Egress
from hybridflow_operator.resolve import (
    MAX_CONFIGMAP_BYTES, code_copy_problem, code_digests, code_keys, configmap, content_digest, resolved_job,
    reward_configmap, reward_copy_problem, reward_key, spec_text,
)

__all__ = [  # what the operator's modules and tests reach through this module
    "GROUP", "REWARD_MOUNT", "reward_configmap_key", "ENVIRONMENT_URLS_ENV", "LABEL_GENERATION", "LABEL_INDEX",
    "LABEL_JOB", "LABEL_POOL", "LABEL_ROLE", "head_pod_name", "names", "worker_pod_name", "CHECKPOINT_MOUNT", "is_url",
    "job_checkpoint_url", "ENVIRONMENT_PORT", "ENVIRONMENT_ROLE", "FS_GROUP", "MANAGED_BY", "MODEL_CACHE",
    "MODELS_MOUNT", "RAY_AGENT_PORT", "RAY_PORT", "RESUME_MOUNT", "SANDBOX_ENV", "SANDBOX_PARTIAL", "SANDBOX_REQUIRED",
    "SANDBOX_TOKEN_ENV", "SANDBOX_TOKEN_KEY", "SCRATCH_MOUNT", "SCRATCH_SIZE", "SPEC_KEY", "SPEC_MOUNT", "job_labels",
    "job_namespace", "metrics_port", "owner_reference", "ray_token_secret_name", "selector", "CONTAINER_SECURITY",
    "POD_SECURITY",
    "environment_pod_name", "environment_service_name", "environment_urls", "gang_pods", "head_pod",
    "leave_grace_seconds", "sandbox_token_env", "sandbox_urls_env", "worker_pod", "MAX_CONFIGMAP_BYTES",
    "agent_endpoint_ports", "runs_program", "AGENT_ENDPOINT_PORTS", "ENDPOINT_PORTS_ENV", "POD_IP_ENV",
    "code_copy_problem", "code_digests", "code_keys", "configmap", "content_digest", "resolved_job",
    "reward_configmap", "reward_copy_problem", "reward_key", "spec_text", "head_service", "podgroup", "token_secret",
    "ray_token_secret", "network_policy", "pod_references", "accepted_references", "foreign_references",
    "static_children",
]


def head_service(job: RLHFJob, uid: str) -> dict[str, Any]:
    name = job.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, uid, names(name)["service"]),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # workers must resolve the head before it is Ready
            "selector": {LABEL_JOB: name, LABEL_ROLE: "head"},
            "ports": [
                {"name": "gcs", "port": RAY_PORT, "targetPort": RAY_PORT, "protocol": "TCP"},
                {"name": "metrics", "port": metrics_port(job), "protocol": "TCP"},
            ],
        },
    }


def podgroup(job: RLHFJob, uid: str) -> dict[str, Any]:
    """Volcano gang: nothing starts until the head and every pool pod can be placed (an elastic rollout pool's
    minReplicas of them: pods past it join when they can)."""
    rp = job.spec.rollout_pool
    least = sized(job, rp.min_replicas if rp else None)
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": object_meta(job, uid, names(job.metadata.name)["podgroup"]),
        "spec": {"minMember": 1 + sum(p.nodes for p in least.spec.resource_pools)},
    }



def token_secret(job: RLHFJob, uid: str, kind: str, token: str) -> dict[str, Any]:
    """A token of the job's own (`kind`: "ray_token", "sandbox_token"), under key `token`: owned by the job, so it
    goes with it. Created once by name; a later create with another token is refused (409) and the first one
    stays."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": object_meta(job, uid, names(job.metadata.name)[kind]),
        "data": {"token": base64.b64encode(token.encode()).decode()},
        "immutable": True,  # the job's pods hold this token for their lives: it is never changed under them
    }


def ray_token_secret(job: RLHFJob, uid: str, token: str) -> dict[str, Any]:
    """The job's own Ray token (when the spec names no Secret)."""
    return token_secret(job, uid, "ray_token", token)


def network_policy(job: RLHFJob, uid: str, metrics_namespaces: list[str],
                   egress: Egress | None = None) -> dict[str, Any]:
    """Ingress to the job's pods only from the job's own pods, plus the driver's metrics port from the namespaces
    that scrape it (Prometheus, and the operator, which polls progress there). Egress from them only to the job's
    own pods, the cluster's DNS, the object store when the job checkpoints to one, and the platform's extra rules
    (`egress`, from the chart's networkPolicy values); no ipBlock reaches the link-local range (the cloud's metadata
    service), and nothing reaches the Kubernetes API (the pods hold no token either). The policy keeps the name it
    had when it was ingress only (`<job>-ingress`), so jobs running across an upgrade keep one policy each."""
    name = job.metadata.name
    own = {"podSelector": {"matchLabels": {LABEL_JOB: name}}}
    pool = sandbox_pool(job.spec) is not None
    # Ingress from the job's pods but its sandbox pods (which run user code), and from those only to the rollout's
    # endpoint ports when the job has an agent program (its runs call the endpoint back; nothing else of theirs may
    # reach the gang): environments.environment_policy lets them out there only.
    rules: list[dict[str, Any]] = [{"from": [{"podSelector": gang_selector(name)} if pool else own]}]
    if pool and runs_program(job):
        rules.append({"from": [{"podSelector": {"matchLabels": {LABEL_JOB: name, LABEL_ROLE: ENVIRONMENT_ROLE}}}],
                      "ports": [agent_endpoint_ports()]})
    if metrics_namespaces:
        rules.append({
            "from": [{"namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name",
                                                                  "operator": "In",
                                                                  "values": sorted(set(metrics_namespaces))}]}}],
            "ports": [{"protocol": "TCP", "port": metrics_port(job)}],
        })
    trainer = job.spec.trainer
    object_storage = is_url(trainer.checkpoint_dir) or bool(trainer.resume_from and is_url(trainer.resume_from))
    out_rules = [{"to": [own]}, *(egress or Egress()).rules(object_storage)]
    # Policies add up: selecting the environment pods here too would grant them this policy's egress. Theirs
    # (environments.environment_policy) denies all of it (but a program's calls to the endpoint ports).
    selected = gang_selector(name) if pool else {"matchLabels": {LABEL_JOB: name}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, uid, names(name)["network_policy"]),
        "spec": {"podSelector": selected, "policyTypes": ["Ingress", "Egress"],
                 "ingress": rules, "egress": out_rules},
    }


def gang_selector(name: str) -> dict[str, Any]:
    """The job's pods but its sandbox pods (ENVIRONMENT_ROLE)."""
    return {"matchLabels": {LABEL_JOB: name},
            "matchExpressions": [{"key": LABEL_ROLE, "operator": "NotIn", "values": [ENVIRONMENT_ROLE]}]}


def pod_references(pods: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(kind, name) of every object the pods would use: ConfigMaps, Secrets and PersistentVolumeClaims (volumes, env,
    envFrom) and their ServiceAccount. A volume of any other kind but emptyDir counts as a reference of that kind."""
    out: set[tuple[str, str]] = set()
    for pod in pods:
        spec = pod["spec"]
        if spec.get("serviceAccountName"):
            out.add(("ServiceAccount", spec["serviceAccountName"]))
        for v in spec.get("volumes") or []:
            source = next(k for k in v if k != "name")
            if source == "configMap":
                out.add(("ConfigMap", v["configMap"]["name"]))
            elif source == "secret":
                out.add(("Secret", v["secret"]["secretName"]))
            elif source == "persistentVolumeClaim":
                out.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
            elif source != "emptyDir":
                out.add((f"{source} volume", v["name"]))
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for ref in [(e.get("valueFrom") or {}) for e in c.get("env") or []] + (c.get("envFrom") or []):
                for key, kind in (("secretKeyRef", "Secret"), ("secretRef", "Secret"),
                                  ("configMapKeyRef", "ConfigMap"), ("configMapRef", "ConfigMap")):
                    if key in ref:
                        out.add((kind, ref[key]["name"]))
    return out


def accepted_references(job: RLHFJob) -> set[tuple[str, str]]:
    """What pods of this spec may use: the job's own spec and reward ConfigMaps (never the user's reward ConfigMap:
    its copy), its Ray token Secret (its own, or kubernetes.rayAuthSecret), kubernetes.checkpointSecret, its PVCs and
    its ServiceAccount."""
    k8s, own = job.spec.kubernetes, names(job.metadata.name)
    refs = {("ConfigMap", own["configmap"]), ("Secret", ray_token_secret_name(job))}
    if sandbox_pool(job.spec) is not None:
        refs.add(("Secret", own["sandbox_token"]))
    if k8s.reward_config_map:
        refs.add(("ConfigMap", own["reward"]))
    if k8s.checkpoint_secret:
        refs.add(("Secret", k8s.checkpoint_secret))
    if k8s.tracking_secret:
        refs.add(("Secret", k8s.tracking_secret))
    refs |= {("PersistentVolumeClaim", c) for c in (k8s.checkpoint_pvc, k8s.model_pvc, k8s.data_pvc) if c}
    if k8s.service_account_name:
        refs.add(("ServiceAccount", k8s.service_account_name))
    return refs


def foreign_references(pods: list[dict[str, Any]], accepted: RLHFJob) -> list[str]:
    """The objects the pods would use that the accepted spec does not name ("Secret x"), checked at every gang
    start: whatever was edited into the live spec, or however a pod came to be built, the pods get only what the
    job was accepted with."""
    return [f"{kind} {name}" for kind, name in sorted(pod_references(pods) - accepted_references(accepted))]


def static_children(job: RLHFJob, uid: str, ray_token: str, metrics_namespaces: list[str],
                    egress: Egress | None = None, accepted: RLHFJob | None = None) -> list[dict[str, Any]]:
    """What exists for the job's whole life, across gang restarts. `uid`: the job object's (its children's owner);
    `ray_token` is a fresh random token, used only when the job has no token Secret yet; `egress`: where the job's
    pods may connect (default: own pods and DNS); `accepted`: the spec the ConfigMap holds when `job` is not it (a
    `placement: auto` job's, before its plan is laid over it)."""
    out = [configmap(accepted or job, uid), head_service(job, uid), network_policy(job, uid, metrics_namespaces,
                                                                                 egress)]
    if not job.spec.kubernetes.ray_auth_secret:
        out.append(ray_token_secret(job, uid, ray_token))
    if job.spec.run_policy.gang_scheduling and job.spec.placement != "auto":
        # sized by the pools: a `placement: auto` job's PodGroup waits for its plan (made at its first gang start)
        out.append(podgroup(job, uid))
    return out
