"""A checkpoint's trained model as an HF model directory (safetensors + config + tokenizer), for users to load with
`transformers` or serve with vLLM.

Each checkpoint carries what the export needs besides the weights: the role's model directory minus its weights
(config, generation config, tokenizer, chat template) is copied next to the weight file at save time, as
`<role>.hf.<file>`, and sealed by the manifest with everything else. A checkpoint written before that needs
`model_dir` (the HF directory the job trained from).

A LoRA role's checkpoint holds its adapter alone (and `<role>.lora.json`, its adapter_config.json): it exports as a
PEFT adapter directory, which `peft` and vLLM (as a LoRA) load on the base model, or with `merge` as the base
model with the adapter merged in (the base read from `model_dir`, else from the path the job trained from)."""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from hybridflow import checkpoint as ckpt
from hybridflow.checkpoint import dcp
from hybridflow.checkpoint.model_files import HF_FILES_INFIX, LORA_CONFIG_SUFFIX, model_metadata_files

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
           model_dir: Path | None = None, merge: bool = False) -> Path:
    """Write `role`'s weights from a sealed `checkpoint` into `out` as an HF model directory (a LoRA role's: as a
    PEFT adapter directory, or merged into its base with `merge`); returns `out`.

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
    adapter = checkpoint / f"{role}{LORA_CONFIG_SUFFIX}"
    lora_config = json.loads(adapter.read_text()) if adapter.exists() else None
    if merge and lora_config is None:
        raise ckpt.CheckpointError(f"--merge: {checkpoint}'s {role} is not a LoRA adapter (its weights are the whole "
                                   f"model); export it without --merge")
    if lora_config is not None and role != "actor":
        raise ckpt.CheckpointError(f"{checkpoint}'s {role} is a LoRA adapter; only the actor's adapter exports")
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
    if lora_config is not None and not merge:
        return _export_adapter(state, lora_config, sources, out, dtype, t0)
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        meta_dir = Path(tmp)
        for name, p in sources.items():
            (meta_dir / name).write_bytes(p.read_bytes())  # the checkpoint may be on object storage
        if lora_config is not None:
            model = _merged(_base_dir(lora_config, model_dir, checkpoint), state, lora_config, dtype)
        else:
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


# a model directory's files that describe the model itself: an adapter directory holding them would read as a model
_MODEL_CONFIGS = ("config.json", "generation_config.json")


def _export_adapter(state: dict, config: dict, sources: dict[str, Path], out: Path, dtype: str | None,
                    t0: float) -> Path:
    """The adapter as PEFT saves it (adapter_model.safetensors + adapter_config.json) with the tokenizer's files."""
    import torch

    from hybridflow.models import lora

    cast = getattr(torch, dtype) if dtype else None
    tensors = [(name, t.to(cast) if cast is not None else t) for name, t in state.items()]
    out.mkdir(parents=True, exist_ok=True)
    written = lora.save_adapter(out, tensors, config)
    for name, p in sources.items():
        if name not in _MODEL_CONFIGS:
            (out / name).write_bytes(p.read_bytes())
    log.info("export: wrote the LoRA adapter %s (%.1f MB, rank %s, base %s) in %.1fs", out, written / 1e6,
             config.get("r"), config.get("base_model_name_or_path"), time.perf_counter() - t0)
    return out


def _base_dir(config: dict, model_dir: Path | None, checkpoint: Path) -> Path:
    """The base model an adapter merges into: `--model-dir`, else the directory the job trained from if it is here."""
    base = Path(model_dir) if model_dir else Path(config.get("base_model_name_or_path") or "")
    if not (base / "config.json").is_file():
        raise ckpt.CheckpointError(f"--merge: {checkpoint}'s actor is a LoRA adapter of {base}, which is not an HF "
                                   f"model directory here; pass --model-dir with the base model's directory")
    return base


def _merged(base: Path, state: dict, config: dict, dtype: str | None):
    """The base model with the adapter merged into its weights (peft's merge_and_unload), in fp32 while merging,
    then in `dtype` or the base's own (a bf16 base is not written back twice its size)."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridflow.models import lora

    own = getattr(AutoConfig.from_pretrained(base), "dtype", None) or torch.float32
    own = getattr(torch, own) if isinstance(own, str) else own
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="export-adapter-") as adapter:
        lora.save_adapter(Path(adapter), state.items(), config)
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return merged.to(getattr(torch, dtype) if dtype else own).eval()
