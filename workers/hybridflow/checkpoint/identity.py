"""Whose checkpoint this is: the job (and namespace) that wrote it and the architecture of each saved role's model,
recorded in its manifest. A directory shared by mistake, another namespace's checkpoint or one of another model is
refused on resume before any weights are read, and pruning never touches another job's checkpoints."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hybridflow.checkpoint.store import TRAINER_STATE, CheckpointError, list_checkpoints, read_manifest, read_text_in

log = logging.getLogger("hybridflow.checkpoint")

# HF config fields that fix every parameter's name and shape (what makes a checkpoint loadable into a model)
_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def model_architecture(source: Any) -> dict[str, Any]:
    """What must match for a checkpoint to load into a model built from `source` (a spec ModelSource).

    Cheap and known before any worker starts: the tiny model's config (it fixes every shape), the shape fields of
    config.json for a model directory, the source's name for the built-in SmolLM2. Not the weights (training
    changes them) and not the dtype (`load_state_dict` casts, so a resume may switch between float32 and bfloat16).
    """
    if source.source == "tiny":
        return {"source": "tiny", **source.tiny.model_dump()}
    if source.source == "path":
        try:
            config = json.loads((Path(source.path) / "config.json").read_text())
        except (OSError, ValueError):
            return {"source": "path", "path": source.path}
        return {"source": "path", **{k: config[k] for k in _ARCH_KEYS if k in config}}
    return {"source": source.source}


def identity(job: str, namespace: str | None, models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Whose checkpoint this is: the job, and each saved role's `model_architecture`."""
    return {"job": job, "namespace": namespace, "models": models}


def label(ident: dict[str, Any]) -> str:
    """`namespace/job` (or the job alone), as messages name a checkpoint's owner."""
    return f"{ident['namespace']}/{ident['job']}" if ident.get("namespace") else str(ident.get("job"))


def read_identity(ckpt: Path) -> dict[str, Any] | None:
    """The manifest's identity; None for a checkpoint written before checkpoints recorded one."""
    try:
        found = read_manifest(ckpt).get("identity")
    except (ValueError, OSError):
        return None
    if found is None:  # older checkpoints named their job in the trainer state only
        try:
            job = json.loads(read_text_in(ckpt, TRAINER_STATE)).get("job")
        except (ValueError, OSError):
            job = None
        return {"job": job, "namespace": None, "models": None} if job else None
    return found


def other_job(found: dict[str, Any] | None, ckpt: Path, ident: dict[str, Any]) -> str | None:
    """The other job's name when `ckpt` is not `ident`'s job's (a namespace counts only where both record one)."""
    if found is None or not found.get("job"):
        return None
    ns_differ = found.get("namespace") and ident.get("namespace") and found["namespace"] != ident["namespace"]
    return label(found) if found["job"] != ident["job"] or ns_differ else None


def _other_namespace(found: dict[str, Any] | None, ident: dict[str, Any]) -> str | None:
    """The checkpoint's namespace when both it and `ident` record one and they differ."""
    theirs, ours = (found or {}).get("namespace"), ident.get("namespace")
    return theirs if theirs and ours and theirs != ours else None


def model_mismatch(found: dict[str, Any] | None, ident: dict[str, Any]) -> str | None:
    """How the checkpoint's models differ from `ident`'s, or None (also when the checkpoint recorded none)."""
    if found is None or found.get("models") is None:
        return None
    problems = []
    for role, want in ident["models"].items():
        have = found["models"].get(role)
        if have is None:
            problems.append(f"it has no {role}")
        elif have != want:
            diff = ", ".join(f"{k} {have.get(k)!r} there, {want.get(k)!r} here"
                             for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k))
            problems.append(f"{role}: {diff}")
    return "; ".join(problems) or None


def refuse_other_jobs(root: Path, ident: dict[str, Any]) -> None:
    """Raise when `root` holds any checkpoint of another job: checked before a save writes anything."""
    for c in list_checkpoints(root):
        other = other_job(read_identity(c), c, ident)
        if other:
            raise CheckpointError(
                f"{root} holds checkpoints of job '{other}' ({c.name}), not of '{label(ident)}': jobs must not share "
                f"a checkpoint directory. Point spec.trainer.checkpointDir at a directory of this job's own")


def check_compatible(ckpt: Path, ident: dict[str, Any], other_job_ok: bool = False) -> None:
    """Refuse to resume `ident`'s job from `ckpt` when it belongs to another job (unless `other_job_ok`: the job
    named it as trainer.resumeFrom, and that job is of the same namespace: another namespace's checkpoint is
    refused always), or to an incompatible model; a checkpoint written before identities were recorded is accepted
    with a warning (its model is unknown). Called before any weights are read."""
    found = read_identity(ckpt)
    other = other_job(found, ckpt, ident)
    foreign = _other_namespace(found, ident)
    if foreign and other_job_ok:  # another job's, yes; another namespace's, never: namespaces are the tenants
        raise CheckpointError(
            f"spec.trainer.resumeFrom: {ckpt} belongs to job '{other}' of namespace {foreign}, not to this job's "
            f"namespace {ident['namespace']}: a job resumes only from checkpoints of its own namespace. Name a job "
            f"of namespace {ident['namespace']} (or one of its step_* checkpoints)")
    if other and not other_job_ok:
        raise CheckpointError(
            f"{ckpt} belongs to job '{other}', not to '{label(ident)}': will not resume another job's training. "
            f"Point spec.trainer.checkpointDir at a directory of this job's own (the other job's checkpoints stay)")
    problem = model_mismatch(found, ident)
    if problem:
        raise CheckpointError(
            f"{ckpt} was saved for a different model than job '{label(ident)}' has now ({problem}). Point "
            f"spec.trainer.checkpointDir elsewhere, or set spec.trainer.resume: never to start over (this job's "
            f"checkpoints of the old model are then replaced)")
    if found is None or found.get("models") is None:
        log.warning("%s records no model (written by an older version): assuming it fits job '%s'", ckpt,
                    label(ident))
