"""The job as its pods run it (`resolved_job`): every path the author wrote turned into one inside the job's own
volumes, or refused as a SpecError naming the field; and the spec and code ConfigMaps that carry it to the pods."""
from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath
from typing import Any

from hybridflow.api import (
    DATA_MOUNT, REWARD_MOUNT, JobSpec, ModelSource, RLHFJob, SpecError, dump_job, reward_configmap_key,
)
from hybridflow.api.agents import code_files
from hybridflow.api.names import names
from hybridflow.api.rules import kubernetes_code_problems
from hybridflow.api.storage import (
    CHECKPOINT_MOUNT, is_url, job_checkpoint_dir, job_checkpoint_url, namespace_url, resume_source,
)

from hybridflow_operator.meta import MODELS_MOUNT, RESUME_MOUNT, SCRATCH_MOUNT, SPEC_KEY, object_meta, job_namespace


def resolved_job(job: RLHFJob) -> RLHFJob:
    """The spec as it runs in pods: metrics on all interfaces, checkpoints in the job's own directory (under the
    object-storage URL trainer.checkpointDir names, else on the PVC when one is given), trainer.resumeFrom, model
    paths and data.cacheDir confined to what this job may read or write, prompt files inside the data volume and
    the code files (reward function, tools, environment, agent program) inside the mount of the job's copy of its
    code ConfigMap. Idempotent (the accepted spec is resolved again when compared with the live one). A spec that
    names what its pods may not have (another namespace's checkpoint, a path outside its claims, object storage
    without kubernetes.checkpointSecret, a code file on the data claim) raises SpecError, naming the fields."""
    run = job.model_copy(deep=True)
    s, k8s = run.spec, run.spec.kubernetes
    s.metrics.address = "0.0.0.0"
    ns, name = run.metadata.namespace or "default", run.metadata.name
    # (parse_job refuses code on the data claim already: here too, for a spec changed since it was parsed)
    problems = _credential_problems(s) + kubernetes_code_problems(s)
    problems += _resolve_checkpoints(s, ns, name) + _resolve_models(s) + _resolve_cache_dir(s)
    if problems:
        raise SpecError("; ".join(problems))
    if k8s.data_pvc:
        s.data.train = [_inside(DATA_MOUNT, p) for p in s.data.train]
        s.data.eval = [_inside(DATA_MOUNT, p) for p in s.data.eval]
    if k8s.reward_config_map:  # every code file: inside the mount of the job's copy of its code ConfigMap
        if s.models.reward.function is not None:
            s.models.reward.function.path = _inside(REWARD_MOUNT, s.models.reward.function.path)
        if (agent := s.rollout.agent) is not None:
            if agent.environment_file:
                agent.environment_file = _inside(REWARD_MOUNT, agent.environment_file)
            if agent.tools_file:
                agent.tools_file = _inside(REWARD_MOUNT, agent.tools_file)
            if agent.program:
                agent.program = _inside(REWARD_MOUNT, agent.program)
    return run


def _credential_problems(s: JobSpec) -> list[str]:
    """Object storage only with the job's own credentials: without a Secret the cloud SDKs in the pods would fall
    back to the node's identity (its instance role), which is the cluster's, not the job author's."""
    if s.kubernetes.checkpoint_secret:
        return []
    return [f"spec.kubernetes.checkpointSecret: spec.trainer.{field} '{where}' is on object storage, and no Secret "
            f"gives the pods its credentials; name one holding AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
            f"AWS_ENDPOINT_URL, AWS_REGION) or the AZURE_STORAGE_* keys (job pods never use the node's cloud identity)"
            for field, where in (("checkpointDir", s.trainer.checkpoint_dir), ("resumeFrom", s.trainer.resume_from))
            if where and is_url(where)]


def _resolve_checkpoints(s: JobSpec, ns: str, name: str) -> list[str]:
    """trainer.checkpointDir becomes the job's own directory, `<base>/<namespace>/<job>`; trainer.resumeFrom, another
    job of the namespace or one of its checkpoints, `<base>/<namespace>/<job>[/step_N]` (on the claim: below
    RESUME_MOUNT, where that job's directory, subPath `<namespace>/<job>`, is mounted read-only). Returns what
    cannot be resolved."""
    t, claim = s.trainer, s.kubernetes.checkpoint_pvc
    if is_url(t.checkpoint_dir):
        t.checkpoint_dir = job_checkpoint_url(t.checkpoint_dir, ns, name)
    elif claim:
        t.checkpoint_dir = job_checkpoint_dir(CHECKPOINT_MOUNT, ns, name)
    if not t.resume_from:
        return []
    if is_url(t.checkpoint_dir):
        base = namespace_url(t.checkpoint_dir, ns, name)
        where, rel = f"under {base}", resume_source(t.resume_from, (base,))
    elif is_url(t.resume_from):
        return [f"spec.trainer.resumeFrom: '{t.resume_from}' is on object storage, but spec.trainer.checkpointDir is "
                f"not: a job resumes only from checkpoints below its own checkpointDir's prefix and namespace; set "
                f"checkpointDir to that prefix (s3://bucket/prefix, whose jobs are s3://bucket/prefix/{ns}/<job>) "
                f"and name the old job"]
    elif claim:
        base = f"{RESUME_MOUNT}/{ns}/"
        # a path into the namespace's directory as the whole claim was once mounted: the same checkpoint
        where, rel = f"on kubernetes.checkpointPvc '{claim}'", resume_source(
            t.resume_from, (base, f"{CHECKPOINT_MOUNT}/{ns}/"))
    else:
        return []  # a path in the pod's own filesystem: nothing shared to confine
    if rel is None:
        return [f"spec.trainer.resumeFrom: '{t.resume_from}' is not a checkpoint of namespace {ns} {where}; name a "
                f"job of this namespace ('<job>': its newest intact checkpoint) or one of its checkpoints "
                f"('<job>/step_00000006'){f', or a URL under {base}' if is_url(base) else ''}"]
    t.resume_from = base + rel
    return []


def model_sources(s: JobSpec) -> dict[str, ModelSource]:
    """The spec's models that may come from a directory, by field."""
    m = s.models
    found = {"spec.models.actor": m.actor, "spec.models.critic": m.critic, "spec.models.reward.model":
             m.reward.model, "spec.models.reward.judge.model": m.reward.judge.model if m.reward.judge else None,
             "spec.models.cost.model": m.cost.model if m.cost is not None else None}
    return {field: src for field, src in found.items() if src is not None}


def _resolve_models(s: JobSpec) -> list[str]:
    """With kubernetes.modelPvc, a model's path lies on that claim (relative to it, or below MODELS_MOUNT), where
    each model directory is mounted read-only by its own subPath."""
    if not s.kubernetes.model_pvc:
        return []
    out = []
    for field, src in model_sources(s).items():
        if src.source != "path" or not src.path:
            continue
        rel = is_below(MODELS_MOUNT, src.path)
        if rel is None:
            out.append(f"{field}.path: with kubernetes.modelPvc, give the model's directory on that claim (relative, "
                       f"or below {MODELS_MOUNT}/; no '..'), got '{src.path}'")
        else:
            src.path = f"{MODELS_MOUNT}/{rel}" if rel else MODELS_MOUNT
    return out


def _resolve_cache_dir(s: JobSpec) -> list[str]:
    """data.cacheDir is written by the job: inside its own checkpoint directory or the pod's scratch (a relative
    path is below the scratch, the containers' working directory), never a directory of the claim it shares."""
    d, own = s.data, s.trainer.checkpoint_dir
    if not d.cache_dir:
        return []
    path = str(PurePosixPath(SCRATCH_MOUNT, d.cache_dir))  # an absolute cacheDir stays as it is
    roots = [SCRATCH_MOUNT] + ([own] if own.startswith("/") else [])
    if ".." not in PurePosixPath(path).parts and any(is_below(root, path) is not None for root in roots):
        d.cache_dir = path
        return []
    return [f"spec.data.cacheDir: '{d.cache_dir}' is outside this job's own directories; give a path inside "
            f"trainer.checkpointDir ({own}) or below {SCRATCH_MOUNT} (the pod's scratch), or leave it unset "
            f"(<checkpointDir>/data-cache)"]


def is_below(mount: str, path: str) -> str | None:
    """`path` relative to `mount` ("" for the mount itself), given relative to it or as an absolute path below it;
    None when it is elsewhere or climbs ('..')."""
    p = PurePosixPath(path)
    if p.is_absolute():
        if p != PurePosixPath(mount) and PurePosixPath(mount) not in p.parents:
            return None
        p = p.relative_to(mount)
    if ".." in p.parts:
        return None
    return "" if str(p) == "." else str(p)


def _inside(mount: str, path: str) -> str:
    """A path the spec gives relative to a volume, as the pod sees it (idempotent: the accepted spec is resolved
    again when compared with the live one)."""
    return path if path.startswith(mount + "/") else f"{mount}/{path}"


def content_digest(text: str) -> str:
    """What status.acceptedSpecDigest, status.rewardDigest and status.codeDigests record: the spec ConfigMap's
    content, the reward file's, each code file's, as the pods read them."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def spec_text(job: RLHFJob) -> str:
    """What the spec ConfigMap holds under SPEC_KEY: the spec as it runs in pods, as JSON; status.acceptedSpecDigest
    is its digest."""
    doc = dump_job(resolved_job(job))
    doc["metadata"] = {"name": job.metadata.name, "namespace": job_namespace(job)}
    return json.dumps(doc, indent=1)


def configmap(job: RLHFJob, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(job, uid, names(job.metadata.name)["configmap"]),
        "data": {SPEC_KEY: spec_text(job)},
        "immutable": True,  # what the pods run cannot be edited under a live job
    }


# What a ConfigMap may hold (data and binaryData together), as the API server counts it.
MAX_CONFIGMAP_BYTES = 1 << 20


def reward_key(job: RLHFJob) -> str:
    """The reward file's key in kubernetes.rewardConfigMap and in the job's copy ("" without a reward function)."""
    fn = job.spec.models.reward.function
    return reward_configmap_key(fn.path) if fn is not None else ""


def code_keys(job: RLHFJob) -> dict[str, str]:
    """The job's code files in kubernetes.rewardConfigMap (the job's code ConfigMap), key -> the field naming it:
    the reward function's, the agent's tools file, environment file and program ({} without that ConfigMap). Each is
    copied into the job's own ConfigMap at acceptance, its digest recorded in status.codeDigests."""
    if not job.spec.kubernetes.reward_config_map:
        return {}
    out: dict[str, str] = {}
    for field, path in code_files(job.spec).items():
        out.setdefault(reward_configmap_key(path), field)
    return out


def reward_configmap(job: RLHFJob, uid: str, files: dict[str, str] | str) -> dict[str, Any]:
    """The job's own copy of its code files (`files`: key -> text; a str: the reward file alone), made when the
    operator first finds them in kubernetes.rewardConfigMap: immutable and owned by the job, and what the head and
    sandbox pods mount. The user's ConfigMap stays theirs to edit; an edit (anyone's who may update it) must not
    become code that the running job, or its next gang, executes."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(job, uid, names(job.metadata.name)["reward"]),
        "data": {reward_key(job): files} if isinstance(files, str) else dict(files),
        "immutable": True,
    }


def code_digests(files: dict[str, str]) -> dict[str, str]:
    """What status.codeDigests records: each code file's digest, by key."""
    return {key: content_digest(text) for key, text in sorted(files.items())}


def code_copy_problem(files: dict[str, str]) -> str:
    """Why the job's code files cannot be copied into one ConfigMap ("" if they can)."""
    size = sum(len(key.encode()) + len(text.encode()) for key, text in files.items())
    if size <= MAX_CONFIGMAP_BYTES:
        return ""
    what = (f"the file '{next(iter(files))}' is" if len(files) == 1
            else f"the job's code files ({', '.join(sorted(files))}) are")
    return (f"spec.kubernetes.rewardConfigMap: {what} {size} bytes with their keys; a ConfigMap holds at most "
            f"{MAX_CONFIGMAP_BYTES} (1 MiB); make {'it' if len(files) == 1 else 'them'} smaller")


def reward_copy_problem(key: str, text: str) -> str:
    """Why the reward file cannot be copied into a ConfigMap ("" if it can)."""
    return code_copy_problem({key: text})


