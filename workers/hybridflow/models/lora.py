"""LoRA's facts in one place (spec.training.lora): which modules get adapters for a model family, the PEFT config a
spec asks for, which of a module's tensors are its adapters and under which names PEFT saves them, switching the
adapters off (the reference policy is the base model), and the adapter directory that `peft` and vLLM both load
(adapter_config.json + adapter_model.safetensors).

Adapters are injected into the HF model in place (`peft.inject_adapter_in_model`, no PeftModel wrapper), so the
model keeps its class and its HF names, except that a targeted linear layer's own weight moves under
`<module>.base_layer.weight` and its adapters appear as `<module>.lora_A.default.weight` and
`<module>.lora_B.default.weight` (`hf_name` and `peft_name` convert).
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
from torch import nn

from hybridflow.api.training import LORA_DEFAULT_TARGETS

if TYPE_CHECKING:
    from peft import LoraConfig

    from hybridflow.api.training import Lora

ADAPTER = "default"  # peft's name for the one adapter a module holds (part of every adapter parameter's name)
PEFT_PREFIX = "base_model.model."  # what PEFT's save_pretrained puts before a module's name
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraSettings:
    """What a role asks of LoRA: the spec's fields, frozen (TrainSettings carries it to the engine)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()

    @classmethod
    def from_spec(cls, lora: "Lora | None") -> "LoraSettings | None":
        if lora is None:
            return None
        return cls(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))

    @property
    def scaling(self) -> float:
        """What an adapter's output is multiplied by (PEFT's `scaling`, no rsLoRA): merging adds scaling * B @ A."""
        return self.alpha / self.rank


def target_modules(settings: LoraSettings, model_type: str) -> list[str]:
    """The spec's modules, or the family's default; a family without one is refused, naming the field."""
    if settings.target_modules:
        return list(settings.target_modules)
    if model_type not in LORA_DEFAULT_TARGETS:
        raise ValueError(f"spec.training.lora.targetModules: no default for model type {model_type!r} (defaults for "
                         f"{', '.join(sorted(LORA_DEFAULT_TARGETS))}); name the linear modules to adapt, e.g. "
                         f"[q_proj, v_proj]")
    return list(LORA_DEFAULT_TARGETS[model_type])


def peft_config(settings: LoraSettings, model_type: str, inference_mode: bool = False) -> "LoraConfig":
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=target_modules(settings, model_type), bias="none",
                      inference_mode=inference_mode)


def is_adapter(name: str) -> bool:
    """Whether a parameter (module or PEFT naming) is an adapter's."""
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """A base parameter's name in the model's own checkpoint (`...q_proj.base_layer.weight` -> `...q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def peft_name(name: str) -> str:
    """An adapter parameter's name as PEFT saves it (`model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`): what `peft` and vLLM load."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def module_name(saved: str) -> str:
    """The inverse of `peft_name`."""
    name = saved[len(PEFT_PREFIX):] if saved.startswith(PEFT_PREFIX) else saved
    for part in (".lora_A.", ".lora_B."):
        name = name.replace(part, f"{part}{ADAPTER}.")
    return name


def inject(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Adapters into `model` in place (on whatever device its parameters are, the meta device included: they are
    then initialised by `initial_adapters` once materialised); every base parameter frozen, the adapters trainable."""
    from peft import inject_adapter_in_model

    config = peft_config(settings, model.config.model_type)
    try:
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER,
                                        low_cpu_mem_usage=any(p.is_meta for p in model.parameters()))
    except ValueError as err:  # PEFT's "Target modules {...} not found in the base model"
        raise ValueError(f"spec.training.lora.targetModules: {err} (name linear modules of the model, e.g. q_proj, "
                         f"v_proj; empty: the family's default)") from err
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model


def adapter_layers(model: nn.Module) -> Iterator[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return (m for m in model.modules() if isinstance(m, LoraLayer))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone while inside (the reference policy of a LoRA actor: no second copy of the model).

    Only the layers' switch moves: PEFT's `enable_adapters(False)` also marks the adapters frozen, and FSDP2 fixes a
    layer group's gradient dtypes from the parameters that require grad at its first forward, so a reference pass
    that ran first (the default GRPO step's first forward) left bf16 compute unable to assign the adapters' fp32
    gradients ("attempting to assign a gradient with dtype 'BFloat16' to a tensor with grad_dtype 'Float'")."""
    layers = list(adapter_layers(model))
    trained = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    for p, flag in trained:
        p.requires_grad_(flag)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in trained:
            p.requires_grad_(flag)


def initial_adapters(adapters: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """Whole adapter tensors initialised as PEFT's `reset_lora_parameters` does (lora_A kaiming-uniform with
    a=sqrt(5), lora_B zero, so the adapted model starts as the base) for the given tensors' (global) shapes and
    dtypes. A seeded generator makes them identical on every rank: a model injected on the meta device has no
    adapters in its files and is sharded before they exist."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(adapters):
        whole = torch.zeros(adapters[name].shape, dtype=adapters[name].dtype)
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
        out[name] = whole
    return out


def _adapted_module(name: str) -> str:
    """The module a base weight or adapter parameter belongs to (`...q_proj.lora_A.default.weight` -> `...q_proj`)."""
    return name.removesuffix(".base_layer.weight").split(".lora_A.")[0].split(".lora_B.")[0]


def merged(params: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole parameters under module names, adapters included, as the plain model's: each adapted weight merged
    (base + scaling * B @ A in fp32, as PEFT's merge, in the base's dtype) under its HF name, the adapters gone.
    Streams: a module's base weight waits only for its own two adapters (they follow it in parameter order)."""
    held: dict[str, torch.Tensor] = {}
    for name, t in params:
        if not (is_adapter(name) or name.endswith(".base_layer.weight")):
            yield hf_name(name), t
            continue
        held[name] = t
        module = _adapted_module(name)
        parts = (f"{module}.base_layer.weight", f"{module}.lora_A.{ADAPTER}.weight",
                 f"{module}.lora_B.{ADAPTER}.weight")
        if all(p in held for p in parts):
            base, a, b = (held.pop(p) for p in parts)
            yield f"{module}.weight", (base.float() + scaling * (b.float() @ a.float())).to(base.dtype)
    if held:
        raise ValueError(f"adapted weights without their base or adapters: {sorted(held)}")


def adapter_config(settings: LoraSettings, model_type: str, base_model: str) -> dict:
    """adapter_config.json's content, as PEFT writes it (PeftConfig.to_dict) with the base model's path."""
    config = peft_config(settings, model_type, inference_mode=True).to_dict()
    config["target_modules"] = sorted(config["target_modules"])  # a set in the config: JSON wants a list
    config["base_model_name_or_path"] = base_model
    return json.loads(json.dumps(config, default=str))


def write_adapter(directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], settings: LoraSettings,
                  model_type: str, base_model: str) -> int:
    """An adapter directory `peft` (PeftModel.from_pretrained) and vLLM (LoRARequest) load, from adapter tensors under
    module names; returns the bytes of the tensors written."""
    return save_adapter(directory, tensors, adapter_config(settings, model_type, base_model))


def save_adapter(directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> int:
    """`write_adapter` with the adapter_config.json content given (a checkpoint's, for `hybridflow export`)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    saved = {peft_name(n): t.detach().contiguous().cpu() for n, t in tensors if is_adapter(n)}
    save_file(saved, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return sum(t.numel() * t.element_size() for t in saved.values())


def model_type(model_dir: Path) -> str:
    """The HF config's model_type of a model directory (which family's default target modules apply)."""
    return str(json.loads((Path(model_dir) / "config.json").read_text())["model_type"])


def adapter_checksum(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> float:
    """The sum of the adapter tensors (cast to `dtype` first: what the generation engine holds), added in name order
    so that the trainer's side and an engine that holds them in another order give the same float: with LoRA the
    base never moves, so this is what tells whether a weight sync landed (`weight_checksums`)."""
    sums = {n: float((t if dtype is None else t.to(dtype)).detach().double().sum())
            for n, t in tensors if is_adapter(n)}
    return float(sum(sums[n] for n in sorted(sums)))
