"""What every generation engine is: token ids in, token ids out, weights replaced in memory after every actor update.

Each kind is registered by name in `hybridflow.api.engines.ROLLOUT_ENGINES` with a lazy "module:build" factory of
one signature (`RolloutEngineFactory`), so the actor builds any of them the same way and never asks which it got.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import torch
import torch.distributed as dist

from hybridflow.api import Rollout
from hybridflow.capacity import kv_cache_bytes
from hybridflow.models.lora import LoraSettings
from hybridflow.single_controller.context import WorkerContext

if TYPE_CHECKING:
    from hybridflow.engines.train.base import TrainEngine


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    log_probs: bool = False  # also return each token's log-prob (vLLM's first such call costs seconds of set-up)


@dataclass
class Generation:
    tokens: list[int]
    log_probs: list[float]  # the engine's own log-prob of each token after temperature, when asked (truncated IS)


class RolloutEngine(Protocol):
    """What the actor needs of a generation engine; every engine implements all of it."""

    instance_id: str  # made once when the engine is built: a changed id means the engine was re-created

    def generate(self, prompts: list[list[int]], cfgs: Sequence[SamplingConfig]) -> list[Generation]:
        """One response per prompt, each with its own sampling settings (e.g. sampled and greedy in one call)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights in memory from HF-named tensors (whole, or the engine's own shards)."""

    def load_adapter(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """With spec.training.lora: the trainer's LoRA adapters (module names, `...q_proj.lora_A.default.weight`)
        on top of the base the engine loaded from the model directory, which never changes and is never re-sent.
        Replaces the adapter generation runs with; returns the bytes of the tensors it took."""

    def release(self) -> None:
        """Free what generation holds that training does not need (a no-op where the engine cannot). With LoRA the
        base must survive: it is never sent again, only adapters are."""

    def weight_checksums(self) -> dict[str, float]:
        """Sums of the weights it generates with, to check that a transition landed: with LoRA, of the adapter
        (`{"adapter": models.lora.adapter_checksum}`: the base is the model directory's and never moves)."""


class GenerationFeed(Protocol):
    """What a generation engine fed by the training engine beside it reads of the transfer between them: the
    generation TP groups it runs on, and the push of the trainer's weights into it. engines.bridge.transfer's
    WeightTransfer is one (the bridge imports the generation engines, so they type against this, not against it)."""

    # Read-only (properties): a plain attribute of a transfer conforms, and one typed narrower too (a transfer whose
    # group is always made, tuple[ProcessGroup, list[int]]), which a mutable Protocol attribute would refuse.
    @property
    def generation_group(self) -> tuple[dist.ProcessGroup | None, list[int]]:
        """This rank's generation TP group (None: a group of one, no collective) and its ranks."""

    @property
    def generation_groups(self) -> list[list[int]]:
        """Every generation TP group's ranks, in replica order."""

    def push(self, rollout: RolloutEngine) -> object:
        """The training engine's current weights into `rollout`, in memory (collective)."""


@dataclass(frozen=True)
class RolloutSetup:
    """All a generation engine is built from, the same for every kind, so one factory signature serves them all.
    Each kind reads the fields it needs: a KV-cache engine sizes its cache from `sequences`, an engine with weights
    of its own loads them from `model_dir`, one fed by shards takes its process group from `transfer`."""

    model_dir: Path
    rollout: Rollout  # spec.rollout
    model_dtype: str  # the weights' dtype on disk (spec.models.actor.dtype)
    generation_dtype: torch.dtype  # what generation computes in: the training engine's compute dtype
    seed: int  # this generation replica's sampling seed
    sequences: int  # the most sequences one generation call holds on this replica
    device: torch.device  # where generation runs
    # Colocated only (None on a rollout pool of its own): the training engine beside it (a model-parallel one's
    # model shape), and how its weights reach this engine (and the generation process group).
    trainer: TrainEngine | None
    transfer: GenerationFeed | None
    lora: LoraSettings | None = None  # spec.training.lora: the engine takes adapters (load_adapter) on its base


class RolloutEngineFactory(Protocol):
    """The `build` every generation engine module defines (registered as "module:build")."""

    def __call__(self, ctx: WorkerContext, setup: RolloutSetup) -> RolloutEngine: ...


def model_kv_cache_bytes(model_dir: Path, dtype: torch.dtype, sequences: int, max_len: int) -> int:
    """`kv_cache_bytes` for the HF model in `model_dir` (its config.json)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return kv_cache_bytes(cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads, head_dim,
                          torch.tensor([], dtype=dtype).element_size(), sequences, max_len)
