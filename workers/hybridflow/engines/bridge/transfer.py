"""The weight transfer between a training engine and the generation engine beside it, picked for the (train kind,
rollout kind) pair by their registered facts (hybridflow.api.engines), never by their names:

* a trainer that is not model parallel (FSDP) hands over full tensors: each parameter all-gathered whole, under HF
  names, straight into the generation engine's `load_weights`; with LoRA (the trainer's `lora`) only the adapters,
  into its `load_adapter` (the base it loaded from the model directory never changes);
* a model-parallel trainer (megatron) goes through the 3D-HybridEngine: its TP shards all-gathered inside micro-DP
  groups (reshard.gather_micro_dp) into generation shards, installed as they are by a tensor-parallel generation
  engine (megatron names), or converted to HF names for one that generates whole (t_g = 1).

The transfer also knows the layout generation runs at (which replica a rank is, its generation TP group), so the
rollout role asks it instead of asking which engines it holds. It connects a training engine to a generation engine
in one process (the rollout role colocated with the actor). A rollout on a pool of its own takes the weights over
the stream instead (engines.bridge.stream: two ends in different processes, over a group the controller forms anew as
replicas come and go, with versions and checksums), which is no kind of transfer and is not picked here: the one
choice between the two is trainer.generation.weight_sync's, made once per job by placement.
"""
from __future__ import annotations

import time
from typing import Iterator, Protocol, cast

import torch
import torch.distributed as dist

from hybridflow.api.engines import RolloutEngineKind, TrainEngineKind
from hybridflow.single_controller.protocol import DPRank
from hybridflow.single_controller.context import WorkerContext
from hybridflow.engines.bridge.hybrid_engine import HybridEngine, training_dp_rank
from hybridflow.engines.bridge import layout as lay
from hybridflow.engines.bridge.layout import Layout
from hybridflow.engines.bridge.reshard import ReshardStats
from hybridflow.models.lora import adapter_checksum
from hybridflow.engines.rollout.base import GenerationFeed, RolloutEngine
from hybridflow.engines.train import megatron_model as mm
from hybridflow.engines.train.base import ModelParallelTrainEngine, TrainEngine


class WeightTransfer(GenerationFeed, Protocol):
    """Train -> generate for one pair of engines, and the generation layout it implies (its generation TP groups
    and `push` are what a generation engine fed by it reads: GenerationFeed)."""

    generation_replica: int  # this rank's generation replica (its sampling stream)
    generation_replicas: int

    def dp_rank(self, mesh: str) -> DPRank:
        """This rank's data-parallel coordinate when training ("train") or generating ("rollout")."""

    def push(self, rollout: RolloutEngine) -> ReshardStats:
        """The training engine's current weights into `rollout`, in memory (collective)."""

    def train_checksums(self, dtype: torch.dtype) -> dict[str, float]:
        """The sums `rollout.weight_checksums()` gives once a push landed, from the training side (collective)."""


def train_dp_rank(ctx: WorkerContext, train: TrainEngineKind, train_tp: int, train_pp: int = 1) -> DPRank:
    """This rank's training data-parallel coordinate, as the transfer for any rollout kind gives it for "train":
    the actor reports it when it is built, before the rollout role beside it builds the transfer. A model-parallel
    trainer's TP group and stages share one shard and their first rank answers."""
    if not train.model_parallel:
        return DPRank(ctx.rank, ctx.world_size, True)
    return training_dp_rank(_layout(ctx, train_tp, train_pp, train_tp), ctx.rank)


def _layout(ctx: WorkerContext, train_tp: int, train_pp: int, rollout_tp: int) -> Layout:
    return Layout(p=train_pp, t=train_tp, d=ctx.world_size // (train_tp * train_pp), p_g=1, t_g=rollout_tp)


def weight_transfer(ctx: WorkerContext, train: TrainEngineKind, rollout: RolloutEngineKind, engine: TrainEngine,
                    train_tp: int, rollout_tp: int, train_pp: int = 1) -> WeightTransfer:
    """The transfer for this pair (collective: a model-parallel one creates its process groups)."""
    if train.model_parallel:
        layout = _layout(ctx, train_tp, train_pp, rollout_tp)
        return MicroDPTransfer(ctx, cast(ModelParallelTrainEngine, engine), layout, native_shards=rollout.megatron_shards)
    return FullTensorTransfer(ctx, engine)


class FullTensorTransfer:
    """Every parameter gathered whole into the generation engine; every rank is a generation replica."""

    def __init__(self, ctx: WorkerContext, engine: TrainEngine) -> None:
        self.ctx, self.engine = ctx, engine
        self.generation_replica, self.generation_replicas = ctx.rank, ctx.world_size
        self.generation_group: tuple[dist.ProcessGroup | None, list[int]] = (None, [ctx.rank])
        self.generation_groups = [[r] for r in range(ctx.world_size)]

    def dp_rank(self, mesh: str) -> DPRank:
        return DPRank(self.ctx.rank, self.ctx.world_size, True)

    def push(self, rollout: RolloutEngine) -> ReshardStats:
        """`sync_params` (every weight, or with LoRA the adapters alone) into the engine; the stats count what
        moved, so with LoRA they are the adapter's bytes."""
        stats = ReshardStats()

        def whole() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.engine.sync_params():
                n = tensor.numel() * tensor.element_size()
                stats.generation_bytes += n
                stats.peak_transient_bytes = max(stats.peak_transient_bytes, n)
                yield name, tensor

        t0 = time.perf_counter()
        if self.engine.lora is not None:
            rollout.load_adapter(whole())
        else:
            rollout.load_weights(whole())
        world = self.ctx.world_size
        stats.bytes_received = stats.generation_bytes * (world - 1) // world
        stats.seconds = time.perf_counter() - t0
        return stats

    def train_checksums(self, dtype: torch.dtype) -> dict[str, float]:
        return full_tensor_checksums(self.engine, dtype)


def full_tensor_checksums(engine: TrainEngine, dtype: torch.dtype) -> dict[str, float]:
    """The embedding's sum in the generation dtype, as an engine fed whole HF tensors (vLLM, HF) reports it
    (collective: full_params gathers; every rank stops at the same parameter). With LoRA the adapters' sum
    instead: the base never moves, the adapters are what a sync must have delivered."""
    if engine.lora is not None:
        return {"adapter": adapter_checksum(engine.sync_params(), dtype)}
    for name, tensor in engine.full_params():
        if "embed_tokens" in name:
            return {"embedding": float(tensor.to(dtype).double().sum())}
    raise KeyError("no embedding parameter found")


class MicroDPTransfer:
    """The 3D-HybridEngine: training at TP = t in p stages over d replicas, generation at TP = t_g in strided
    groups and one stage, the shards regrouped by an all-gather inside each micro-DP group. `native_shards`: the
    generation engine takes megatron-named TP shards; otherwise it gets HF-named ones (whole tensors at t_g = 1)."""

    def __init__(self, ctx: WorkerContext, engine: ModelParallelTrainEngine, layout: Layout,
                 native_shards: bool) -> None:
        self.engine, self.native_shards = engine, native_shards
        self.adapters = FullTensorTransfer(ctx, engine) if engine.lora is not None else None
        self.hybrid = HybridEngine(layout, ctx.rank)
        self.generation_replica = self.hybrid.generation_replica
        self.generation_replicas = layout.d * layout.d_g
        self.generation_group = (self.hybrid.gen_tp_group, self.hybrid.gen_tp_ranks)
        self.generation_groups = sorted(lay.gen_tp_groups(layout), key=lambda g: lay.gen_dp_rank(layout, g[0]))
        self.hf_shape = mm.local_shape(engine.shape, layout.t_g)  # what one generation shard converts under

    def dp_rank(self, mesh: str) -> DPRank:
        return self.hybrid.dp_rank(mesh)

    def push(self, rollout: RolloutEngine) -> ReshardStats:
        """The shards regrouped for generation; with LoRA (trained at TP 1, PP 1: every rank holds the adapters
        whole) the adapters alone, as a non-model-parallel trainer sends them."""
        if self.adapters is not None:
            return self.adapters.push(rollout)
        stats = ReshardStats()
        shards = self.hybrid.transition(self.engine.named_shards(), stats, self.engine.shape.layers // self.hybrid.L.p)
        rollout.load_weights(shards if self.native_shards else mm.megatron_to_hf_items(shards, self.hf_shape))
        return stats

    def train_checksums(self, dtype: torch.dtype) -> dict[str, float]:
        """Every whole tensor for an engine fed shards (it sums all of its own); the embedding for one fed HF
        tensors. Megatron generation computes in the weights' dtype, so no cast. With LoRA the adapters' sum."""
        if self.adapters is not None:
            return self.adapters.train_checksums(dtype)
        sums = {n: float(t.double().sum()) for n, t in self.engine.whole_shards()}
        if self.native_shards:
            return dict(sorted(sums.items()))
        return {"embedding": sums["embedding.word_embeddings.weight"]}
