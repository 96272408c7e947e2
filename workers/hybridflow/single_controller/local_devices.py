"""Which device each worker process of a group uses, and which torch.distributed backend its world runs on.

Ray gives each GPU worker exactly the GPU of its bundle: it sets CUDA_VISIBLE_DEVICES to that one id, so inside the
process the GPU is `cuda:0`. The bundle index (0..7 on an 8-GPU node) is therefore no device index, and a
LOCAL_RANK taken from it crashed every rank but the first on any multi-GPU node (vLLM's `external_launcher` asserts
`local_rank < torch.cuda.device_count()`). As Ray Train does, the ranks of one group on one node see every GPU of
those ranks (CUDA_VISIBLE_DEVICES lists them in rank order, so NCCL can use peer-to-peer links between them) and
LOCAL_RANK is the process's own position in that list. Ranks that stand alone (independent replicas) keep Ray's
single GPU and are local rank 0.

Ray-free and torch-free: `local_device_env` decides from what each rank reports (`Placement`); the worker host only
applies what it returns (single_controller.worker_group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

GPU_BACKEND = "cpu:gloo,cuda:nccl"
"""A GPU world's backend: NCCL for CUDA tensors, gloo for CPU ones. Groups made from it (torch's new_group, and
megatron-core's) inherit both, so a collective on a CPU tensor (an object list, a flag, a sampled token) works on
GPU nodes too, instead of failing with "No backend type associated with device type cpu"."""
CPU_BACKEND = "gloo"


@dataclass(frozen=True)
class Placement:
    """Where Ray put one rank: its node's address and the GPU ids Ray assigned to its process (empty on CPU)."""

    node: str
    gpu_ids: tuple[str, ...] = ()


def process_group_backend(device: str) -> str:
    """The backend string a worker group's torch.distributed world is initialised with."""
    return GPU_BACKEND if device == "gpu" else CPU_BACKEND


def local_device_env(placements: Sequence[Placement], independent: bool = False) -> list[dict[str, str]]:
    """Per rank (in rank order), the environment that says which local device it is: LOCAL_RANK, LOCAL_WORLD_SIZE
    and, for GPU ranks, CUDA_VISIBLE_DEVICES.

    A rank's local peers are the ranks of the group on the same node (all of them, unless `independent`: each rank
    its own world). LOCAL_RANK is the rank's position among its peers, and on GPU its GPU's position in
    CUDA_VISIBLE_DEVICES, which lists the peers' GPUs in rank order, so `cuda:LOCAL_RANK` is the rank's own GPU."""
    envs = []
    for rank, mine in enumerate(placements):
        if len(mine.gpu_ids) > 1:
            raise ValueError(f"rank {rank} was given {len(mine.gpu_ids)} GPUs ({', '.join(mine.gpu_ids)}); a worker "
                             "process uses exactly one")
        peers = [rank] if independent else [r for r, p in enumerate(placements) if p.node == mine.node]
        env = {"LOCAL_RANK": str(peers.index(rank)), "LOCAL_WORLD_SIZE": str(len(peers))}
        if mine.gpu_ids:
            visible = [gpu for r in peers for gpu in placements[r].gpu_ids]
            if len(set(visible)) != len(visible):
                raise ValueError(f"node {mine.node}: ranks {peers} were given the GPUs {visible}: one GPU for two "
                                 "processes")
            if len(visible) != len(peers):
                raise ValueError(f"node {mine.node}: ranks {peers} mix GPU and CPU processes in one group")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        envs.append(env)
    return envs
