"""The 3D-HybridEngine inside the actor: which process groups a megatron actor needs to generate at a different
layout than it trains, which data-parallel coordinate each rank has in either stage, and the transition itself.

Training is megatron's p-t-d layout; generation is t_g-way TP in groups at stride t/t_g within a stage, one stage
(p_g = 1: the micro-DP group joins every stage), with d * (t/t_g) * p generation replicas. Every rank creates every
group in the same order, as torch.distributed requires.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from hybridflow.single_controller.protocol import DPRank
from hybridflow.engines.bridge import layout as lay
from hybridflow.engines.bridge.reshard import ReshardStats, gather_micro_dp, gather_stages
from hybridflow.engines import collectives


def training_dp_rank(L: lay.Layout, rank: int) -> DPRank:
    """`rank`'s training data-parallel coordinate: a model-parallel group (TP ranks, pipeline stages) shares one
    shard, and its first rank answers (every stage returns the last stage's outputs)."""
    tp, dp, pp = L.coords(rank)
    return DPRank(dp, L.d, tp == 0 and pp == 0)


def _own(groups: list[list[int]], rank: int) -> tuple[dist.ProcessGroup, list[int]]:
    handles = [collectives.new_group(g) for g in groups]
    i = next(i for i, g in enumerate(groups) if rank in g)
    return handles[i], groups[i]


class HybridEngine:
    def __init__(self, L: lay.Layout, rank: int) -> None:
        if L.p_g != 1:
            raise ValueError("the actor's hybrid engine generates in one pipeline stage (p_g = 1)")
        self.L, self.rank = L, rank
        self.micro_group, self.micro_ranks = _own(lay.micro_dp_groups(L), rank)
        self.gen_tp_group, self.gen_tp_ranks = _own(lay.gen_tp_groups(L), rank)

    def dp_rank(self, mesh: str) -> DPRank:
        """Generation: each generation TP group is a replica and its first member answers (training:
        training_dp_rank)."""
        L, r = self.L, self.rank
        if mesh == "rollout":
            return DPRank(lay.gen_dp_rank(L, r), L.d * L.d_g, lay.gen_tp_rank(L, r) == 0)
        return training_dp_rank(L, r)

    @property
    def generation_replica(self) -> int:
        return lay.gen_dp_rank(self.L, self.rank)

    def transition(self, shards: Iterator[tuple[str, torch.Tensor]], stats: ReshardStats, layers_per_stage: int):
        """Training shards in, generation shards out (a generator: buckets stream into the generation engine)."""
        if self.L.p == 1:
            return gather_micro_dp(shards, self.micro_group, len(self.micro_ranks), stats)
        return gather_stages(shards, self.micro_group, self.micro_ranks, self.L.p, self.L.coords(self.rank)[2],
                             layers_per_stage, stats)
