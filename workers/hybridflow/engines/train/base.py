"""What every training engine is (`TrainEngine`, the whole surface roles, checkpoints and the weight bridge use), how
one is built (`TrainSettings` and the one factory signature every kind's module defines), and the training loop
every engine shares (`TrainLoop`): micro-batch accumulation, one optimizer step per mini-batch, PPO epochs.

Engines differ only in how gradients are reduced and their norm computed (FSDP: by torch; megatron: over the
tensor- and data-parallel groups), and in how log-probabilities come out of the model (whole or vocab-parallel).
Each kind is registered by name in `hybridflow.api.engines.TRAIN_ENGINES` with a lazy "module:build" factory.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Protocol

import torch
from torch import nn

from hybridflow.api import Training
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.context import WorkerContext
from hybridflow.data.packing import merge_rows, micro_batches, to_count
from hybridflow.models.lora import LoraSettings

LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class InertRows:
    """Rows whose loss the caller knows has no gradient (an advantage-weighted loss on rows of zero advantage): the
    update leaves them out of its forward and backward and still counts them in what the loss averages over.
    `zero_stats`: the loss function's statistics that are 0 on such rows, so their whole-batch value needs none of
    them computed; every other statistic is observed on the rows and is reported as the computed rows' mean."""

    rows: torch.Tensor  # (B,) bool
    zero_stats: frozenset[str] = frozenset()


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, betas, weight decay...): what a resumed job keeps from its own spec when
    it loads a checkpoint's optimizer state (saved under settings that a new job may have changed)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def restore_optimizer_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)


@dataclass(frozen=True)
class TrainSettings:
    """What a role asks of its training engine, the same fields for every kind (one factory signature): the model
    to load and its head, and how to train it (a frozen scorer: `trainable=False`)."""

    model_dir: Path
    dtype: str | None  # the weights' (and optimizer state's) dtype; None: as the checkpoint's loader defaults
    head: Literal["lm", "value"] = "lm"  # a causal LM, or a one-label token classifier (critics, reward models)
    lr: float = 0.0
    grad_clip: float = 1.0
    trainable: bool = True
    compute_dtype: str = "auto"  # spec.training.computeDtype
    dynamic_batch_size: bool = False
    shared_prompt: bool = False  # spec.training.sharedPrompt
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    seed: int = 0
    lora: LoraSettings | None = None  # spec.training.lora: adapters trained on a frozen base (models.lora)
    keep_gathered_for_backward: str = "off"  # spec.training.keepGatheredForBackward: auto, on, off (FSDP)
    reduce_gradients_per_step: str = "off"  # spec.training.reduceGradientsPerStep: auto, on, off (FSDP)
    fp32_attention_backward: str = "off"  # spec.training.fp32AttentionBackward: auto, on, off (FSDP, HF models)


class TrainEngine(Protocol):
    """Everything a role, the checkpoint role side and the weight bridge use of a training engine; every registered
    kind implements all of it (tests/engines/test_engine_protocols.py checks each one's signatures)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    compute_dtype: torch.dtype  # forward, backward and generation run in it
    dynamic_batch_size: bool
    shared_prompt: bool  # rows with the same prompt run as one sequence (engines.train.shared_prompt)
    lora: LoraSettings | None  # adapters trained on a frozen base (models.lora); None: every weight trains

    def forward_micro(self, batch: Batch, micro_batch_size: int, fn: Callable[[nn.Module, Batch], Any]) -> Any:
        """`fn` over micro-batches, outputs merged back in the batch's row order (no gradients)."""

    def train_mini_batch(self, batch: Batch, micro_batch_size: int, loss_fn: LossFn, per: str = "rows",
                         inert: InertRows | None = None) -> dict[str, float]:
        """One optimizer step over `batch`; `inert`: rows whose loss has no gradient, not computed."""

    def ppo_update(self, batch: Batch, t: Training, prompts_per_step: int, loss_fn: LossFn, per: str = "rows",
                   inert: InertRows | None = None) -> dict[str, float]:
        """`ppoEpochs` passes over this rank's shard, one optimizer step per mini-batch."""

    def log_probs(self, model: nn.Module, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the response tokens, and the logits (however the engine holds them) that predicted them."""

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-token entropy of logits as `log_probs` returned them."""

    def clip_grad_norm(self) -> torch.Tensor:
        """Reduce gradients as the layout needs, clip them to `grad_clip`, return the global norm before clipping."""

    def full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter whole under HF names (collective): what a generation engine fed full tensors loads. With
        LoRA the policy's weights: each adapted one merged (base + scaling * B @ A), no adapter among them. A tensor
        may be the live weight itself (an unsharded engine's): copy it before the next update."""

    def sync_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a generation engine that holds the base must receive after an update, whole (collective): every
        parameter as `full_params` gives it, or with LoRA the adapter tensors alone under module names
        (`model.layers.0.self_attn.q_proj.lora_A.default.weight`)."""

    def num_parameters(self) -> int:
        """The whole model's parameter count (collective where the engine must gather to count)."""

    def num_trained_parameters(self) -> int:
        """What the update computes weight gradients for: every parameter, or with LoRA the adapters (and a critic's
        value head): the update's FLOPs (hybridflow.flops.training_flops). Collective as num_parameters."""

    def adapters_off(self) -> contextlib.AbstractContextManager[None]:
        """The base model alone while inside (a LoRA actor's reference policy: no second copy of the model); without
        adapters, the model itself."""

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's part of the model and optimizer state for torch.distributed.checkpoint, as (D)Tensors under
        names that do not depend on the layout (HF parameter names, whole-tensor shapes): each rank writes its own
        shards, and a load re-shards them to another world size or tensor-parallel size. The same call on a freshly
        built engine gives the template that a load fills in place. With LoRA "model" holds the adapters alone
        (module names; the base is the model directory's, never changed)."""

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Take `state` (a `checkpoint_state()` that a load filled in) as the engine's model and optimizer state."""

    def state_dict(self) -> dict[str, Any]:
        """The whole state, HF-named full tensors (the single-file checkpoint format); with LoRA the adapters'."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a `state_dict()`."""


class ModelParallelTrainEngine(TrainEngine, Protocol):
    """A kind registered `model_parallel`: it holds tensor-parallel shards under megatron names, which the
    3D-HybridEngine's transfer (engines.bridge.transfer) regroups for generation."""

    shape: Any  # the decoder's shape (megatron_model.DecoderShape), whole-model sizes

    def named_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameter shards, whole-model megatron names (a pipeline stage's layers by global number)."""

    def whole_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter of the whole model, whole, megatron names, on every rank (collective)."""


class TrainEngineFactory(Protocol):
    """The `build` every training engine module defines (registered as "module:build")."""

    def __call__(self, ctx: WorkerContext, settings: TrainSettings) -> TrainEngine: ...


class TrainLoop:
    """The loop code every engine shares, over the engine's `module`, `optimizer` and `clip_grad_norm`."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    dynamic_batch_size: bool = False  # token-budget micro-batches cut to their own lengths (data/packing.py)
    shared_prompt: bool = False  # micro-batches keep a prompt's rows together, and forwards pack them
    lora: LoraSettings | None = None  # spec.training.lora (FSDP; megatron at TP 1, PP 1); None: every weight

    def clip_grad_norm(self) -> torch.Tensor:
        raise NotImplementedError

    def full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def adapters_off(self) -> contextlib.AbstractContextManager[None]:
        """No adapters here: the model is its base (an engine training LoRA adapters switches them off)."""
        return contextlib.nullcontext()

    def sync_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a generation engine takes after an update (collective): every weight whole; an engine training
        LoRA adapters, the adapters alone."""
        yield from self.full_params()

    def micro_batch_count(self, own: int) -> int:
        """How many micro-batches this rank runs when it cut its own rows into `own`: the same count on every rank
        whose forwards are collective (FSDP: the most any rank cut, engines.train.fsdp); here its own."""
        return own

    def split_micro(self, batch: Batch, micro_batch_size: int) -> list[tuple[list[int], Batch]]:
        """(row indices, micro-batch) pairs over `batch`, as many as `micro_batch_count` says (padding ones have no
        indices: data.packing.to_count)."""
        split = micro_batches(batch, micro_batch_size, self.dynamic_batch_size, self.shared_prompt)
        return to_count(split, self.micro_batch_count(len(split)))

    def run_micro_batches(self, micro: list[Batch], fn: Callable[[nn.Module, Batch], Any],
                          backward: bool) -> list[Any]:
        """`fn(module, mb)` for each micro-batch in order, its outputs in that order on every rank. With `backward`,
        `fn` returns (loss, output) and the loss's gradients accumulate. Here one module runs them all; a pipeline
        engine runs them through its stages' schedule instead (engines.train.megatron_pipeline)."""
        outs = []
        for i, mb in enumerate(micro):
            out = fn(self.module, mb.to(self.device))
            if backward:
                loss, out = out
                self.gradient_sync(i == len(micro) - 1)
                loss.backward()
            outs.append(out)
        return outs

    def gradient_sync(self, last: bool) -> None:
        """Before a micro-batch's backward (`last`: the optimizer step's last): an engine that can defer reducing
        its gradients over the data-parallel ranks to the last one (FSDP with reduceGradientsPerStep) says so here.
        Here nothing changes: the engine reduces as its layout does (megatron: once per step, in clip_grad_norm)."""

    @torch.no_grad()
    def forward_micro(self, batch: Batch, micro_batch_size: int, fn: Callable[[nn.Module, Batch], Any]) -> Any:
        """`fn` over micro-batches; its outputs (a tensor or a tuple of tensors, per row or per response token) come
        back as one, in the batch's row order and at its full response width."""
        self.module.eval()
        split = self.split_micro(batch, micro_batch_size)
        outs = self.run_micro_batches([mb for _, mb in split], fn, backward=False)
        width = batch["responses"].shape[1] if "responses" in batch else None
        kept = [(out, idx) for out, (idx, _) in zip(outs, split) if idx]  # padding micro-batches' outputs go
        return merge_rows([out for out, _ in kept], [idx for _, idx in kept], width)

    def train_mini_batch(self, batch: Batch, micro_batch_size: int, loss_fn: LossFn, per: str = "rows",
                         inert: InertRows | None = None) -> dict[str, float]:
        """One optimizer step over `batch`, accumulating micro-batches weighted by their share of what the loss
        averages over (`per`: "rows", or "tokens" for a token mean), so the step is the same however the rows were
        grouped (length-sorted micro-batches hold few long rows or many short ones).

        `inert`: rows whose loss the caller knows has no gradient (InertRows). They are not computed, yet still
        count in what the loss averages over, so the gradient is the whole batch's. The statistics in
        `inert.zero_stats` keep their whole-batch values; the others become the computed rows' means (here, where
        every stage of a pipeline sees the statistics its last stage took), and a batch with no row computed
        reports none of them. Where every row is inert one row runs, weighing nothing: the optimizer steps on zero
        gradients, as it would have."""
        assert self.optimizer is not None, "this engine was built frozen"
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        size = (lambda b: float(b["response_mask"].sum())) if per == "tokens" else len  # noqa: E731
        total = size(batch)
        computed = batch if inert is None else batch.index(torch.nonzero(~inert.rows.bool()).flatten())
        counted = size(computed)

        split = self.split_micro(computed if len(computed) else batch.index(slice(0, 1)), micro_batch_size)
        # each micro-batch's weight, taken in the order the loop runs them (a padding one, or the one row run where
        # every row is inert, weighs nothing)
        shares = iter([size(mb) / total if counted and idx else 0.0 for idx, mb in split])

        def step(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            share = next(shares)
            loss, mstats = loss_fn(model, mb)
            return loss * share, {k: float(v) * share for k, v in mstats.items()}

        micro = [mb for _, mb in split]
        stats: dict[str, float] = {}
        for mstats in self.run_micro_batches(micro, step, backward=True):
            for k, v in mstats.items():
                stats[k] = stats.get(k, 0.0) + v
        if inert is not None:  # the rows left out counted as 0 in each: what was observed on the rows computed
            share = counted / total if total else 0.0  # becomes their mean, or nothing where none was computed
            for k in stats.keys() - inert.zero_stats:
                if share:
                    stats[k] /= share
                else:
                    del stats[k]
        norm = self.clip_grad_norm()
        stats["grad_norm"] = float(norm)
        if torch.isfinite(norm):
            self.optimizer.step()
        # Gradients live in the update only (as the memory model prices them): held until the next step's
        # zero_grad they would sit beside the generation engine's weights and KV cache (on a GPU, vLLM woken
        # from sleep into memory they still take).
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def ppo_update(self, batch: Batch, t: Training, prompts_per_step: int, loss_fn: LossFn, per: str = "rows",
                   inert: InertRows | None = None) -> dict[str, float]:
        """`ppoEpochs` passes over this rank's shard, one optimizer step per mini-batch; stats averaged over steps.

        A mini-batch is `miniBatchSize` prompts of the global batch, i.e. the same fraction of this rank's rows.
        `inert`: rows whose loss has no gradient (train_mini_batch).
        """
        t0 = time.perf_counter()
        prompts = prompts_per_step
        rows = max(1, len(batch) * (t.mini_batch_size or prompts) // prompts)
        totals: dict[str, float] = {}
        counts: dict[str, int] = {}  # the optimizer steps that reported each statistic (train_mini_batch)
        for _ in range(t.ppo_epochs):
            minis = batch.split(rows)
            inerts = ([None] * len(minis) if inert is None
                      else [InertRows(part, inert.zero_stats) for part in inert.rows.split(rows)])
            for mini, mini_inert in zip(minis, inerts):
                for k, v in self.train_mini_batch(mini, t.micro_batch_size, loss_fn, per, mini_inert).items():
                    totals[k] = totals.get(k, 0.0) + v
                    counts[k] = counts.get(k, 0) + 1
        out = {k: v / counts[k] for k, v in totals.items()}
        out["update_seconds"] = time.perf_counter() - t0
        return out
