"""A checkpoint's trained model as an HF model directory (safetensors + config + tokenizer), for users to load with
`transformers` or serve with vLLM.

Each checkpoint carries what the export needs besides the weights: the role's model directory minus its weights
(config, generation config, tokenizer, chat template) is copied next to the weight file at save time, as
`<role>.hf.<file>`, and sealed by the manifest with everything else. A checkpoint written before that needs
`model_dir` (the HF directory the job trained from)."""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

from hybridflow import checkpoint as ckpt
from hybridflow.checkpoint import dcp
from hybridflow.checkpoint.model_files import HF_FILES_INFIX, model_metadata_files

log = logging.getLogger("hybridflow.export")

def chosen_checkpoint(location: str | Path) -> ckpt.StoragePath:
    """The checkpoint `location` names: a step_* directory as it is, a checkpointDir's newest intact one. A
    CheckpointError says what is wrong with the place named."""
    source = ckpt.storage_path(location)
    found = ckpt.list_checkpoints(source) if not (source / ckpt.MANIFEST).exists() else []
    if not found and not source.is_dir():
        raise ckpt.CheckpointError(f"{source}: no such checkpoint directory")
    if found:
        newest = ckpt.latest_good(source)
        if newest is None:
            raise ckpt.CheckpointError(f"{source} holds no intact checkpoint")
        return newest[0]
    return source


def _model_class(role: str):
    """Actors are causal LMs; critics are the same backbone with a one-label token-classification (value) head."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if role == "actor":
        return AutoModelForCausalLM, {}
    if role.endswith("critic"):
        return AutoModelForTokenClassification, {"num_labels": 1}
    raise ckpt.CheckpointError(f"cannot export role {role!r}: only the actor and critics are trained models")


def saved_roles(checkpoint: Path) -> list[str]:
    sharded = {p.name for p in checkpoint.iterdir() if p.is_dir() and dcp.is_dcp_dir(p)}
    return sorted(sharded | {p.stem for p in checkpoint.glob("*.pt")})


def role_weights(checkpoint: Path, role: str) -> dict:
    """`role`'s model weights in `checkpoint`, each tensor whole, under HF names: from its sharded directory, or
    from the single file older checkpoints have."""
    full = checkpoint / f"{role}.pt"
    if full.is_file():
        return ckpt.load_tensors(full)["model"]
    return dcp.read_full(checkpoint / role, keys={"model"})["model"]


def export(checkpoint: Path, out: Path, role: str = "actor", dtype: str | None = None,
           model_dir: Path | None = None) -> Path:
    """Write `role`'s weights from a sealed `checkpoint` into `out` as an HF model directory; returns `out`.

    `dtype` (float32, bfloat16, float16) casts the weights; by default they keep the dtype they trained in (the
    fp32 masters under mixed precision). The checkpoint is verified against its manifest first: a torn or
    tampered one is refused, not exported."""
    checkpoint, out = ckpt.storage_path(checkpoint), Path(out)
    problem = ckpt.verify_once(checkpoint)  # a checkpointDir's newest was verified just now, when it was chosen
    if problem is not None:
        raise ckpt.CheckpointError(f"{checkpoint} is not a complete checkpoint ({problem}); export an intact one "
                                   f"(the step_* directories under the job's checkpointDir)")
    if role not in saved_roles(checkpoint):
        raise ckpt.CheckpointError(f"{checkpoint} holds no {role} (it holds: {', '.join(saved_roles(checkpoint))}); "
                                   f"pass --role with one of those")
    metadata = sorted(checkpoint.glob(f"{role}{HF_FILES_INFIX}*"))
    if not metadata and model_dir is None:
        raise ckpt.CheckpointError(f"{checkpoint} has no model config for {role} (it was written before checkpoints "
                                   f"carried one); pass --model-dir with the HF directory the job trained from")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; export into a new directory")
    t0 = time.perf_counter()
    state = role_weights(checkpoint, role)
    log.info("export: read %s's %.1f MB of weights from %s in %.1fs", role,
             sum(t.numel() * t.element_size() for t in state.values()) / 1e6, checkpoint, time.perf_counter() - t0)
    sources = ({p.name.split(HF_FILES_INFIX, 1)[1]: p for p in metadata} if metadata
               else {p.name: p for p in model_metadata_files(Path(model_dir))})
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        meta_dir = Path(tmp)
        for name, p in sources.items():
            (meta_dir / name).write_bytes(p.read_bytes())  # the checkpoint may be on object storage
        model = _build(meta_dir, role, state, dtype)
        out.mkdir(parents=True, exist_ok=True)
        for p in meta_dir.iterdir():  # tokenizer and template; config files are rewritten by save_pretrained
            shutil.copyfile(p, out / p.name)
    model.save_pretrained(out, safe_serialization=True)
    from hybridflow.engines.precision import dtype_name

    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    log.info("export: wrote %s (%.1f MB of safetensors, %s) in %.1fs", out, written / 1e6,
             dtype_name(next(iter(model.parameters())).dtype), time.perf_counter() - t0)
    return out


def _build(meta_dir: Path, role: str, state: dict, dtype: str | None):
    """The role's HF model from its config with the checkpoint's weights, every parameter accounted for."""
    import torch
    from transformers import AutoConfig

    cls, extra = _model_class(role)
    config = AutoConfig.from_pretrained(meta_dir, **extra)
    first = next(iter(state.values()))
    want = getattr(torch, dtype) if dtype else first.dtype
    model = cls.from_config(config, dtype=want)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not (getattr(config, "tie_word_embeddings", False)
                                                             and k == "lm_head.weight")]
    if missing or unexpected:
        raise ckpt.CheckpointError(f"the {role} weights do not fit its config: missing {missing[:5]}, unexpected "
                                   f"{unexpected[:5]}; was the checkpoint written by another model?")
    model.tie_weights()
    return model.eval()
