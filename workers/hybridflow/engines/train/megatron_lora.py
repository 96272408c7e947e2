"""LoRA on the megatron engine (spec.training.lora) at tensorParallel 1 and pipelineParallel 1: low-rank adapters on
each layer's four megatron linears (linear_qkv, linear_proj, linear_fc1, linear_fc2), the base frozen in its dtype
(no fp32 master of it, no optimizer state), the adapters fp32 with their optimizer alone.

Own adapters rather than PEFT's LoraParallelLinear: a wrapper that keeps megatron's (output, bias) contract is all a
TP=1 layer needs, and its tensors are named as PEFT names them (`<module>.base_layer.weight`,
`<module>.lora_A.default.weight`), so `models.lora` (is_adapter, merged, initial_adapters) applies unchanged.

Megatron fuses q/k/v into linear_qkv and gate/up into linear_fc1, where HF (so PEFT and vLLM) adapts each
projection. One adapter on a fused linear, lora_B's rows split as the weight's rows are (per query group for QKV,
halves for fc1), is exactly the separate adapters that each hold a copy of lora_A: B_q A x, B_k A x, B_v A x. So a
fused linear is adapted only when all of its projections are targeted, and what leaves the engine (a sync, a
checkpoint) is PEFT's per-module adapters (`hf_adapters`); a checkpoint's copies of lora_A fuse back only if equal.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from hybridflow.api.training import MEGATRON_LINEAR_PARTS
from hybridflow.engines.train import megatron_model as mm
from hybridflow.engines.train.megatron import MegatronEngine
from hybridflow.models import lora
from hybridflow.models.lora import LoraSettings

log = logging.getLogger(__name__)


def adapted_linears(settings: LoraSettings, model_type: str) -> list[str]:
    """The megatron linears (MEGATRON_LINEAR_PARTS' keys) the spec's target modules adapt. A fused linear needs all
    of its projections targeted (its one lora_A feeds them all); a target that is no layer projection (lm_head) has
    no adapter here. Both are refused naming the field."""
    targets = set(lora.target_modules(settings, model_type))
    out, covered = [], set()
    for linear, parts in MEGATRON_LINEAR_PARTS.items():
        names = {p.rsplit(".", 1)[1] for p in parts}
        if names & targets and not names <= targets:
            raise ValueError(f"spec.training.lora.targetModules: the megatron engine fuses {sorted(names)} into one "
                             f"linear ({linear}); target all of them or none")
        if names <= targets:
            out.append(linear)
            covered |= names
    if targets - covered:
        raise ValueError(f"spec.training.lora.targetModules: {sorted(targets - covered)} are not attention or MLP "
                         f"projections, which are what the megatron engine adapts")
    return out


class LoraLinear(nn.Module):
    """A megatron linear plus scaling * lora_B(lora_A(dropout(x))) on its output, in fp32, cast to the output's dtype;
    it returns (output, bias) as megatron's linears do. `enabled` False: the base linear alone."""

    def __init__(self, base: nn.Module, settings: LoraSettings) -> None:
        super().__init__()
        out_features, in_features = base.weight.shape
        device = base.weight.device
        self.base_layer = base
        self.lora_A = nn.ModuleDict({lora.ADAPTER: nn.Linear(in_features, settings.rank, bias=False, device=device)})
        self.lora_B = nn.ModuleDict({lora.ADAPTER: nn.Linear(settings.rank, out_features, bias=False, device=device)})
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout else nn.Identity()
        self.scaling = settings.scaling
        self.enabled = True

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = self.base_layer(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        delta = self.lora_B[lora.ADAPTER](self.lora_A[lora.ADAPTER](self.dropout(x.float())))
        return out + (self.scaling * delta).to(out.dtype), bias


def inject(module: nn.Module, settings: LoraSettings, linears: list[str], seed: int = 0) -> list[LoraLinear]:
    """`linears` of every decoder layer wrapped in place, the base frozen (megatron's linears then take their
    frozen-weight path: no weight gradient is computed), the adapters initialised as PEFT does, identically on
    every rank (generated from the job's seed: data-parallel replicas must start equal)."""
    module.requires_grad_(False)
    wrapped = []
    for layer in module.decoder.layers:
        for path in linears:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            wrapped.append(LoraLinear(getattr(parent, name), settings))
            setattr(parent, name, wrapped[-1])
    adapters = {n: p for n, p in module.named_parameters() if lora.is_adapter(n)}
    with torch.no_grad():
        for name, value in lora.initial_adapters(adapters, seed).items():
            adapters[name].copy_(value)
    for p in adapters.values():
        p.requires_grad_(True)
    return wrapped


def _parts(name: str) -> tuple[str, str, list[str]]:
    """A megatron adapter tensor's (linear's whole name, "A" or "B", the PEFT names of its projections' tensors)."""
    linear, kind = name.split(".lora_")
    _, _, i, inner = linear.split(".", 3)
    return linear, kind[0], [f"model.layers.{i}.{p}.lora_{kind[0]}.{lora.ADAPTER}.weight"
                             for p in MEGATRON_LINEAR_PARTS[inner]]


def hf_adapters(items: Iterable[tuple[str, torch.Tensor]],
                shape: mm.DecoderShape) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron adapter tensors (or moments shaped like them) as PEFT's per-projection ones, module names
    (`model.layers.0.self_attn.q_proj.lora_A.default.weight`): lora_B's rows split as the fused weight's are,
    lora_A copied to each projection. Each its own tensor: safetensors refuses tensors that share memory."""
    for name, t in items:
        linear, kind, hf = _parts(name)
        if kind == "A":
            yield from ((n, t.detach().clone()) for n in hf)
            continue
        for weight, rows in mm.megatron_to_hf_items([(f"{linear}.weight", t.detach())], shape):
            yield f"{weight.removesuffix('.weight')}.lora_B.{lora.ADAPTER}.weight", rows.clone()


def megatron_adapter(name: str, hf: dict[str, torch.Tensor], shape: mm.DecoderShape) -> torch.Tensor:
    """The inverse of `hf_adapters` for megatron adapter tensor `name`, from PEFT-named tensors: lora_B's rows fused
    back; lora_A taken once, refused where the projections' copies differ (an adapter trained unfused)."""
    _, kind, names = _parts(name)
    pieces = [hf[n] for n in names]
    if kind == "A":
        if any(not torch.equal(p, pieces[0]) for p in pieces[1:]):
            raise ValueError(f"{names}: these lora_A differ, so no fused megatron adapter holds them (an "
                             "adapter trained on the FSDP engine loads there, not here)")
        return pieces[0]
    return mm.fuse_qkv(*pieces, shape) if len(pieces) == 3 else torch.cat(pieces)


class MegatronLoraEngine(MegatronEngine):
    """The megatron engine training adapters alone (`MegatronEngine.adapt` is where they are injected, before the
    optimizer is made). The whole-weight views (`named_shards`, `whole_shards`, `full_params`) are the base merged
    with the adapters, as PEFT merges; a sync, a checkpoint and the single-file state hold the adapters alone."""

    def __init__(self, settings: LoraSettings, model_dir: Path, *args: Any, **kwargs: Any) -> None:
        self.lora = settings
        self.linears = adapted_linears(settings, lora.model_type(model_dir))  # refused before the model is built
        self.adapters: list[LoraLinear] = []
        super().__init__(model_dir, *args, **kwargs)

    def adapt(self) -> list[nn.Parameter]:
        """Adapters injected on the loaded, frozen base; they alone are stepped (fp32 already: no masters)."""
        if (self.tp_size, self.pp_size) != (1, 1):  # the spec's rules refuse it first (api.rules)
            raise ValueError(f"spec.training.lora on the megatron engine trains at tensorParallel 1 and "
                             f"pipelineParallel 1, not {self.tp_size} and {self.pp_size}")
        self.adapters = inject(self.module, self.lora, self.linears, self.seed)
        return [p for _, p in self.trained_parameters()]

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """The base alone while inside: the reference policy of a LoRA actor."""
        for layer in self.adapters:
            layer.enabled = False
        try:
            yield
        finally:
            for layer in self.adapters:
                layer.enabled = True

    def num_trained_parameters(self) -> int:
        """The adapters' (TP 1 x PP 1: this rank holds them whole)."""
        return int(sum(p.numel() for _, p in self.trained_parameters()))

    def trained_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters (fp32: stepped as they are, no masters), megatron names."""
        return ((n, p) for n, p in self.named_parameters() if lora.is_adapter(n))

    def named_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's weights, megatron names: each adapted one merged (base + scaling * B @ A, in its dtype)."""
        yield from lora.merged(((n, p.detach()) for n, p in self.named_parameters()), self.lora.scaling)

    def sync_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters alone, whole (this rank holds them whole at TP 1), PEFT's per-projection module names."""
        yield from hf_adapters(self.trained_parameters(), self.shape)

    def _hf_blocks(self, items: Iterable[tuple[str, torch.Tensor]],
                   params_only: bool = False) -> Iterator[tuple[str, Any]]:
        """Adapter tensors (and their moments) under PEFT's names, whole: `checkpoint_state` then holds the adapters
        and their AdamW state alone, as the FSDP engine's LoRA checkpoint does (what `hybridflow export` writes)."""
        yield from hf_adapters(items, self.shape)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        names = {p: n for n, p in self.trained_parameters()}
        with torch.no_grad():
            for p, n in names.items():
                p.copy_(megatron_adapter(n, state["model"], self.shape))
        optim = state.get("optimizer")
        if optim is None:
            log.warning("checkpoint has no optimizer state: adapters restored, optimizer starts fresh")
            return
        saved = optim["state"]
        for p, n in names.items():  # the moments from the checkpoint; lr and betas stay the spec's
            entry = saved[_parts(n)[2][0]]  # its scalars (the step): the first projection's
            self.optimizer.state[p] = {
                k: megatron_adapter(n, {hf: e[k] for hf, e in saved.items()}, self.shape).to(p.device)
                if torch.is_tensor(v) and v.dim() else v for k, v in entry.items()}

    def state_dict(self) -> dict[str, Any]:
        """`checkpoint_state` on the CPU: at TP 1 and PP 1 this rank's adapters and moments are the whole state."""
        state = self.checkpoint_state()
        cpu = (lambda v: v.cpu() if torch.is_tensor(v) else v)  # noqa: E731
        return {"model": {k: v.cpu() for k, v in state["model"].items()},
                "optimizer": {"state": {k: {m: cpu(v) for m, v in e.items()} for k, e in
                                        state["optimizer"]["state"].items()},
                              "param_groups": state["optimizer"]["param_groups"]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_checkpoint_state(state)
