"""The engine kinds a job may name: training engines (spec.training.engine) and generation engines
(spec.rollout.engine), each registered by name with the facts the spec's rules, `capacity` and the CLI need.

Lazy like verl's rollout registry: an entry names its implementation as "module:attribute" and nothing is imported
until a role builds one, so this table stays importable where torch is not (the operator, `hybridflow crd`). Adding
an engine is its module plus one `register` call here (or from a plug-in's own import, as the tests do); the
schema's enums, the rules and the CLI's choices follow from the table.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from hybridflow.algorithms.registry import Registry


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class TrainEngineKind:
    """A training engine: `factory` builds it for a role (hybridflow.engines.train.base.TrainEngineFactory)."""

    name: str
    factory: str  # "module:function"
    summary: str
    model_parallel: bool = False  # tensor (and pipeline) parallel training; shards the vocabulary over TP ranks
    computes_in_model_dtype: bool = False  # no separate compute dtype: it computes in its weights' dtype
    lora: bool = False  # trains LoRA adapters on a frozen base (spec.training.lora)

    def load(self) -> Any:
        return _load(self.factory)


@dataclass(frozen=True)
class RolloutEngineKind:
    """A generation engine: `factory` builds it beside a training engine (hybridflow.engines.rollout.base)."""

    name: str
    factory: str  # "module:function"
    summary: str
    tensor_parallel: bool = False  # generates tensor-parallel on the 3D-HybridEngine's strided groups
    megatron_shards: bool = False  # takes the transition's megatron-named shards as they are (else HF names)
    vocab_padding: int = 1  # pads the vocabulary to a multiple of this (vLLM: 64), so TP shards align only then
    fed_by: frozenset[str] | None = None  # the training engines whose shards it takes; None: any (full tensors)
    head_sizes: tuple[int, ...] | None = None  # attention head sizes its kernels support; None: any
    kv_cache: bool = False  # preallocates a KV cache (counted by capacity)
    per_row_sampling: bool = True  # one call may give each row its own sampling settings (multi-turn budgets)
    cuda_graphs: bool = False  # can capture CUDA graphs (spec.rollout.cudaGraphs)
    max_lora_rank: int | None = None  # the largest LoRA rank it serves (spec.training.lora); None: any, 0: no LoRA

    def load(self) -> Any:
        return _load(self.factory)


TRAIN_ENGINES: Registry[TrainEngineKind] = Registry("training engine")
ROLLOUT_ENGINES: Registry[RolloutEngineKind] = Registry("generation engine")


def register_train_engine(kind: TrainEngineKind) -> TrainEngineKind:
    TRAIN_ENGINES.add(kind.name, kind)
    return kind


def register_rollout_engine(kind: RolloutEngineKind) -> RolloutEngineKind:
    ROLLOUT_ENGINES.add(kind.name, kind)
    return kind


def model_parallel_train_engines() -> list[str]:
    return [n for n in TRAIN_ENGINES.names() if TRAIN_ENGINES[n].model_parallel]


def lora_train_engines() -> list[str]:
    return [n for n in TRAIN_ENGINES.names() if TRAIN_ENGINES[n].lora]


def tensor_parallel_rollout_engines() -> list[str]:
    return [n for n in ROLLOUT_ENGINES.names() if ROLLOUT_ENGINES[n].tensor_parallel]


def standalone_rollout_engines() -> list[str]:
    """Generation engines any training engine can feed (the CLI's --engine choices)."""
    return [n for n in ROLLOUT_ENGINES.names() if ROLLOUT_ENGINES[n].fed_by is None]


# vLLM's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py, 0.32).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

register_train_engine(TrainEngineKind("fsdp", "hybridflow.engines.train.fsdp:build", "torch FSDP2", lora=True))
register_train_engine(TrainEngineKind(
    "megatron", "hybridflow.engines.train.megatron_build:build", "megatron-core 3D", model_parallel=True,
    computes_in_model_dtype=True, lora=True))  # LoRA at tensorParallel 1, pipelineParallel 1 (api.rules)
register_rollout_engine(RolloutEngineKind(
    "vllm", "hybridflow.engines.rollout.vllm:build", "in-process vLLM", head_sizes=VLLM_CPU_HEAD_SIZES, kv_cache=True,
    tensor_parallel=True, vocab_padding=64, cuda_graphs=True, max_lora_rank=512))  # vLLM's MaxLoRARanks
register_rollout_engine(RolloutEngineKind("hf", "hybridflow.engines.rollout.hf:build", "plain torch generation"))
register_rollout_engine(RolloutEngineKind(
    "megatron", "hybridflow.engines.rollout.megatron:build", "tensor-parallel generation with megatron-core layers "
    "on the 3D-HybridEngine's generation groups", tensor_parallel=True, megatron_shards=True,
    fed_by=frozenset({"megatron"}), per_row_sampling=False, max_lora_rank=0))  # its layers hold no LoRA modules
