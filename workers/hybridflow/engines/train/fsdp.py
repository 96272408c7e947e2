"""Training engine on torch FSDP2 (`fully_shard`): each rank keeps 1/N of every parameter and its optimizer state.

Device-agnostic: gloo on CPU, NCCL on GPU. The engine knows nothing of RL; roles hand it loss functions.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.algorithms.core import entropy_from_logits
from hybridflow.engines import collectives
from hybridflow.models import lora
from hybridflow.data.packing import padded_positions
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.context import WorkerContext
from hybridflow.models.lora import LoraSettings
from hybridflow.engines.precision import compute_dtype, dtype_name, master_dtype
from hybridflow.engines.train.base import TrainLoop, TrainSettings, optimizer_settings, restore_optimizer_settings
from hybridflow.engines.train import cpu_attention
from hybridflow.engines.train.shared_prompt import can_share, packed_outputs, shared_layout
from hybridflow.api.training import fp32_attention_backward_on, fsdp_switch_on, fsdp_unsharded


def sequence_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """Model inputs for left-padded prompt + right-padded response rows; positions skip the left padding."""
    mask = batch["attention_mask"]
    return {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": padded_positions(mask)}


def response_outputs(model: nn.Module, batch: Batch, shared: bool = False, lm: bool = True) -> torch.Tensor:
    """The model's outputs that predict each response token, (B, R, V) logits of a causal LM (`lm`) or (B, R, 1) of
    a value head. Only those positions go through an LM's head (a vocabulary-sized matmul, and the largest
    activation, that prompt positions do not need). `shared`: rows with the same prompt run as one sequence
    (engines.train.shared_prompt), the same outputs for less compute."""
    packed = shared_layout(batch) if shared and can_share(model) else None
    if packed is not None:
        return packed_outputs(model, packed, keep_arg=lm)
    R = batch["responses"].shape[1]
    keep = {"logits_to_keep": R + 1} if lm else {}
    return model(**sequence_inputs(batch), use_cache=False, **keep).logits[:, -R - 1: -1]


def response_logits(model: nn.Module, batch: Batch, temperature: float, shared: bool = False) -> torch.Tensor:
    """Logits that predict each response token: (B, R, V), in the compute dtype."""
    logits = response_outputs(model, batch, shared)
    return logits.float() / temperature if temperature != 1.0 else logits  # no (B, R, V) copy at temperature 1


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax in fp32 whatever the logits' dtype (bf16 cannot hold a log-prob to the precision PPO's ratios
    need); the fp32 result is the one (B, R, V) tensor kept for backward."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _hf_class_and_config(model_dir: Path, head: str) -> tuple[Any, Any]:
    """The HF class a role's model is built as (a causal LM, or a one-label token classifier: a value or score
    head) and its config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    if head == "value":
        # no dropout before the head (HF's token classifiers default to 0.1): a critic's values while it trains must
        # be the values it computed for the batch, or the value clip compares noise (verl sets the same)
        config = AutoConfig.from_pretrained(model_dir, num_labels=1)
        config.classifier_dropout = 0.0  # set after loading: from_pretrained drops keys its config class lacks
        return AutoModelForTokenClassification, config
    return AutoModelForCausalLM, AutoConfig.from_pretrained(model_dir)


def load_hf_model(model_dir: Path, dtype: str | None, head: str = "lm") -> nn.Module:
    """The HF model a role trains or scores with, whole, in this process. `dtype` None leaves the loader's
    default."""
    cls, config = _hf_class_and_config(model_dir, head)
    kwargs: dict = {} if dtype is None else {"dtype": getattr(torch, dtype)}
    return cls.from_pretrained(model_dir, config=config, **kwargs)


def empty_hf_model(model_dir: Path, dtype: str | None, head: str = "lm") -> nn.Module:
    """The model's modules with every parameter on the meta device (no memory: shapes only), so that it can be
    sharded before any weight exists. Buffers are real: rotary tables are computed from the config, not loaded.
    `dtype` None: the dtype the checkpoint's config names (float32 where it names none)."""
    from accelerate import init_empty_weights

    cls, config = _hf_class_and_config(model_dir, head)
    own = getattr(config, "dtype", None) or torch.float32
    own = getattr(torch, own) if isinstance(own, str) else own
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config, dtype=getattr(torch, dtype) if dtype else own)
    model.tie_weights()  # from_config leaves a tied head a parameter of its own (from_pretrained ties it on load)
    return model


def safetensors_keys(model_dir: Path) -> set[str] | None:
    """The tensor names the model directory's safetensors files hold; None where it has none (a .bin checkpoint)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    keys: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            keys.update(st.keys())
    return keys


def load_sharded_weights(module: nn.Module, model_dir: Path, on_disk: set[str], init_std: float,
                         seed: int = 0) -> list[str]:
    """Fill a sharded, materialised module (FSDP2's DTensors, uninitialised) from the model's safetensors files.
    Each rank reads only the rows of its own shards (DCP's HF reader: safetensors slices over mmap) and converts
    them to its dtype as it copies: no rank ever holds a whole tensor of the checkpoint. Collective over the world.

    Parameters the files lack (a new value head on a causal LM's checkpoint) are initialised as HF would
    (normal(0, initializer_range), biases zero), identically on every rank; a tied copy (lm_head = embed_tokens)
    is loaded once, under the name the file has. LoRA adapters are initialised as PEFT does (lora.initial_adapters)
    and an adapted layer's base weight is read under its HF name (lora.hf_name). Returns the names initialised
    (adapters aside)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(module)
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    loaded = {n for names in aliases.values() if any(lora.hf_name(a) in on_disk for a in names) for n in names}
    wanted = {k: v for k, v in state.items() if lora.hf_name(k) in on_disk}
    dcp.load({lora.hf_name(k): v for k, v in wanted.items()},
             storage_reader=dcp.HuggingFaceStorageReader(str(model_dir)))
    fresh = sorted(k for k in state if k not in loaded and not lora.is_adapter(k))
    generator = torch.Generator().manual_seed(0)
    new = {}
    for k in fresh:  # small (a head): whole on every rank, then sharded by the full-state-dict path
        t = state[k]
        whole = torch.zeros(t.shape, dtype=t.dtype)
        if t.dim() > 1:
            whole.normal_(0.0, init_std, generator=generator)
        new[k] = whole
    new.update(lora.initial_adapters({k: v for k, v in state.items() if lora.is_adapter(k)}, seed))
    set_model_state_dict(module, wanted, options=StateDictOptions(strict=False))
    if new:
        set_model_state_dict(module, new, options=StateDictOptions(full_state_dict=True, strict=False))
    return fresh


def load_causal_lm(model_dir: Path, dtype: str) -> nn.Module:
    return load_hf_model(model_dir, dtype, "lm")


def weights_dtype(settings: TrainSettings, compute: torch.dtype) -> str | None:
    """The dtype the model is loaded and held in: a trained model's fp32 master, a frozen one's own
    (engines.precision). With LoRA the base is frozen and nothing steps it, so it is held in the compute dtype (no
    fp32 copy of the whole model); the adapters alone get fp32 masters (`with_adapters`)."""
    if settings.lora is not None and settings.trainable:
        return dtype_name(compute)
    return master_dtype(settings.dtype, settings.trainable)


def with_adapters(model: nn.Module, settings: LoraSettings, train_head: bool = False) -> nn.Module:
    """`model` with LoRA adapters injected before it is sharded (on the meta device too: `load_sharded_weights`
    initialises them), the base frozen, the adapters fp32: FSDP2 all-gathers both in the compute dtype, and it asks
    only the trained parameters of a layer to share one dtype. `train_head`: what lies outside the base model (a
    critic's value head, new and not low-rank) trains whole, in fp32 too."""
    lora.inject(model, settings)
    for layer in lora.adapter_layers(model):
        layer.lora_A.float()
        layer.lora_B.float()
    if train_head:
        for name, child in model.named_children():
            if name != model.base_model_prefix:
                child.float().requires_grad_(True)
    return model


def build(ctx: WorkerContext, settings: TrainSettings) -> FSDPEngine:
    """A trained model in fp32 (its master copy, whatever its dtype, which is the compute dtype:
    engines.precision), a frozen one in its dtype; `auto` compute dtype agreed over the world. With
    `settings.lora`, adapters on a base held in the compute dtype (`weights_dtype`).

    The model is built on the meta device, sharded, and each rank then reads only its own shards from the
    safetensors files (`load_sharded_weights`): a rank's peak while loading is its 1/N of the model, not the whole
    model (30 GB per GPU for a 7B one in fp32, and a 32B one could not start). A checkpoint without safetensors
    files (.bin) is loaded whole on every rank and then sharded, as before. A trained model on CPU computing in bf16
    runs its attention's backward in fp32 (training.fp32AttentionBackward: engines.train.cpu_attention)."""
    s = settings
    computes = compute_dtype(s.compute_dtype, ctx.device, model_dtype=s.dtype)
    dtype = weights_dtype(s, computes)
    on_disk = safetensors_keys(s.model_dir)
    if on_disk is None:
        model = load_hf_model(s.model_dir, dtype, s.head)
    else:
        model = empty_hf_model(s.model_dir, dtype, s.head)
    if s.lora is not None:
        model = with_adapters(model, s.lora, train_head=s.head == "value")
    if s.trainable and fp32_attention_backward_on(s.fp32_attention_backward, ctx.device, dtype_name(computes)):
        cpu_attention.adopt(model)
    switch = lambda value: s.trainable and fsdp_switch_on(value, ctx.device, ctx.world_size)  # noqa: E731
    engine = FSDPEngine(model, s.lr, s.grad_clip, ctx.device, trainable=s.trainable, compute_dtype=computes,
                        dynamic_batch_size=s.dynamic_batch_size, shared_prompt=s.shared_prompt, lora=s.lora,
                        keep_gathered=switch(s.keep_gathered_for_backward),
                        reduce_per_step=switch(s.reduce_gradients_per_step))
    if on_disk is not None:
        fresh = load_sharded_weights(engine.module, s.model_dir, on_disk, model.config.initializer_range, s.seed)
        if fresh and ctx.rank == 0:
            logging.getLogger(__name__).info("%s: initialised %s (not in the checkpoint)", s.model_dir, fresh)
    return engine


class FSDPEngine(TrainLoop):
    """A module sharded with FSDP2 plus its AdamW optimizer. With a `compute_dtype` narrower than the weights',
    FSDP gathers each layer's shards in that dtype and computes in it, while the shards, their gradients (reduced in
    fp32) and the optimizer state keep the weights' dtype: fp32 for a trained model (`build`).

    Where each copy lives (a trained model): the fp32 shard of every parameter (1/N of it) and its fp32 gradient
    and AdamW moments stay on the rank; a layer's whole weights exist, in the compute dtype, only while that layer
    runs (FSDP's all-gather before it, freed after it); the generation engine holds its own compute-dtype copy,
    loaded by the weight sync. With `lora` only the adapters train (their fp32 shards, gradients and moments);
    the base's shards are frozen, in the compute dtype. On one rank computing in its weights' dtype the module stays
    a plain one (`api.training.fsdp_unsharded`: nothing to shard, gather or cast), the rest as above."""

    def __init__(self, module: nn.Module, lr: float, grad_clip: float, device: str, trainable: bool = True,
                 compute_dtype: torch.dtype | None = None, dynamic_batch_size: bool = False,
                 shared_prompt: bool = False, lora: LoraSettings | None = None, keep_gathered: bool = False,
                 reduce_per_step: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.device = torch.device("cuda" if device == "gpu" else "cpu")
        self.dynamic_batch_size = dynamic_batch_size
        self.shared_prompt = shared_prompt
        self.lora = lora
        on_meta = any(p.is_meta for p in module.parameters())  # empty_hf_model's: sharded first, filled later
        buffers = {name: b.to(self.device) for name, b in module.named_buffers()}
        if not on_meta:
            module.to(self.device)
        param_dtype = next(module.parameters()).dtype
        self.compute_dtype = compute_dtype or param_dtype
        weights = {dtype_name(p.dtype) for p in module.parameters()}
        self.sharded = not fsdp_unsharded(dist.get_world_size(), weights, dtype_name(self.compute_dtype))
        self.keep_gathered, self.reduce_per_step = keep_gathered and self.sharded, reduce_per_step and self.sharded
        if self.sharded:
            mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            inner = getattr(module, "model", None) or getattr(module, getattr(module, "base_model_prefix", ""), None)
            for layer in getattr(inner, "layers", []):
                fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep_gathered)
            fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep_gathered)
        if on_meta:  # every rank's shards get storage (uninitialised until loaded), the buffers their values back
            module.to_empty(device=self.device)
            if not self.sharded:  # to_empty gives each module a parameter of its own: a tied head again shares
                module.tie_weights()
            with torch.no_grad():
                for name, b in buffers.items():
                    module.get_buffer(name).copy_(b)
        self.module = module
        self.grad_clip = grad_clip
        # fused: one kernel over all shards, no temporaries; the default foreach path allocates parameter-sized
        # intermediates at the step (measured on CPU, 272 MB of fp32 shards: +272 MB peak and 6x the time)
        if not trainable:
            module.requires_grad_(False)
            module.eval()
        # with LoRA the adapters (and a critic's head) alone; named once: PEFT's switch clears the adapters' flags
        self.trained_names = {n for n, p in module.named_parameters() if p.requires_grad}
        self.trained = [p for n, p in module.named_parameters() if n in self.trained_names]
        self.optimizer = torch.optim.AdamW(self.trained, lr=lr, weight_decay=0.0,
                                           fused=True) if trainable else None

    def micro_batch_count(self, own: int) -> int:
        """The most micro-batches any rank cut its rows into: every forward all-gathers each layer over the world,
        so a rank that ran fewer left the others waiting in a gather forever (dynamic micro-batches are cut by each
        rank's own lengths)."""
        count = torch.tensor([own], dtype=torch.int64)
        collectives.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item())

    def gradient_sync(self, last: bool) -> None:
        """With `reduce_per_step`, only the last micro-batch's backward reduce-scatters: the ones before accumulate
        unsharded fp32 gradients (FSDP2 upcasts them to its reduce dtype), reduced once with the last one's. With
        `keep_gathered`, the weights gathered by the first micro-batch's forward stay whole until the last one's
        backward: one gather of each layer per optimizer step, for no more memory than the pass already holds (the
        whole model, between a forward and its backward)."""
        if self.reduce_per_step:
            self.module.set_requires_gradient_sync(last)
        if self.keep_gathered:
            self.module.set_reshard_after_backward(last)

    def forward_micro(self, batch: Batch, micro_batch_size: int, fn: Any) -> Any:
        """TrainLoop's, each layer resharded right after its forward as without keepGatheredForBackward (no
        backward will reuse it: the pass holds two gathered layers, not the whole model), then the root too (FSDP2
        keeps the root gathered after a forward without backward, and the generation engine comes next)."""
        if self.keep_gathered:
            self.module.set_reshard_after_forward(True)
        try:
            out = super().forward_micro(batch, micro_batch_size, fn)
        finally:
            if self.keep_gathered:
                self.module.set_reshard_after_forward(False)
        self.resharded()
        return out

    def clip_grad_norm(self) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.trained, self.grad_clip)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def log_probs(self, model: nn.Module, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        logits = response_logits(model, batch, temperature, self.shared_prompt)
        return token_log_probs(logits, batch["responses"]), logits

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        return entropy_from_logits(logits)

    def resharded(self) -> nn.Module:
        """The module with every parameter back to its (master-dtype) shard: FSDP2 keeps the root's parameters
        gathered, in the compute dtype, after a forward pass without backward (and every layer's, where they keep
        their gathered weights for backward)."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return self.module

    def gathered(self, adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters gathered whole (an all-gather per tensor), module names; `adapters_only`: LoRA's alone."""
        for name, p in self.resharded().named_parameters():
            if adapters_only and not lora.is_adapter(name):
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, full.detach()

    def full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter whole, HF names; what a generation engine loads. With LoRA the merged policy weights."""
        if self.lora is None:
            yield from self.gathered()
            return
        yield from lora.merged(self.gathered(), self.lora.scaling)

    def sync_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """After an update: every weight, or with LoRA the adapters alone (the base never changes)."""
        if self.lora is None:
            yield from self.full_params()
            return
        yield from self.gathered(adapters_only=True)

    def saved(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint keeps of the model's state: all of it, or with LoRA what trains (the adapters, and a
        critic's value head; the base is the model directory's, never changed)."""
        if self.lora is None:
            return model_state
        return {k: v for k, v in model_state.items() if k in self.trained_names}

    def num_parameters(self) -> int:
        return int(sum(p.numel() for p in self.module.parameters()))  # DTensor.numel() is the global size

    def num_trained_parameters(self) -> int:
        return self.num_parameters() if self.lora is None else int(sum(p.numel() for p in self.trained))

    def adapters_off(self) -> contextlib.AbstractContextManager[None]:
        """PEFT's adapters switched off while inside (models.lora.adapters_disabled): the base policy."""
        return lora.adapters_disabled(self.module)

    def checkpoint_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": self.saved(get_model_state_dict(self.resharded()))}
        # sharded DTensors under HF names; a fresh optimizer gets zero state first, so the template has every slot
        model_sd, optim_sd = get_state_dict(self.resharded(), self.optimizer)
        return {"model": self.saved(model_sd), "optimizer": optim_sd}

    def load_checkpoint_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        opts = StateDictOptions(strict=self.lora is None)  # with LoRA the state holds the adapters alone
        if self.optimizer is None or "optimizer" not in state:
            set_model_state_dict(self.resharded(), state["model"], options=opts)
            return
        settings = optimizer_settings(self.optimizer)
        set_state_dict(self.resharded(), self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=opts)
        restore_optimizer_settings(self.optimizer, settings)  # the moments from the checkpoint, lr from the spec

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return {"model": self.saved(get_model_state_dict(self.resharded(), options=opts))}
        model_sd, optim_sd = get_state_dict(self.resharded(), self.optimizer, options=opts)
        return {"model": self.saved(model_sd), "optimizer": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False, strict=self.lora is None)
        set_state_dict(
            self.resharded(),  # after a no-grad forward the root's parameters are not the optimizer's DTensors
            self.optimizer or [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optimizer", {}) if self.optimizer else {},
            options=opts,
        )
