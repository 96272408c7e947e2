"""vLLM generating tensor-parallel beside its actor (engines/rollout/vllm.py at t_g > 1): its TP groups made the
3D-HybridEngine's strided generation groups, and each transition's shards installed into its own storage.

vLLM forms its groups from consecutive ranks; `ranks_in_order` lists the world in generation-group order while the
engine is built, so each of its TP groups is one generation group. `install_shards` then takes this rank's
generation shard under HF names (q/k/v and gate/up fused as vLLM packs them), never a whole tensor."""
from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any, Iterable, Iterator

import torch

from hybridflow.engines import collectives


@contextlib.contextmanager
def ranks_in_order(order: list[int] | None) -> Iterator[None]:
    """vLLM (0.32, distributed/parallel_state.initialize_model_parallel) lays the world out as
    `torch.arange(world_size)` and cuts its TP groups from it, consecutive ranks each. While the engine is built,
    that arange gives `order` instead, so its groups are the ones `order` lists consecutively: the 3D-HybridEngine's
    strided generation groups. Every group vLLM makes (TP, PP, DP, ...) follows the same order.

    On CPU its TP groups talk through shared memory named after the group's ranks only (under external_launcher its
    instance name is empty), so a segment a killed run left in /dev/shm stops the next engine of the same ranks
    (`create shm in SHMManager failed. errno: 17`): the names get an identity of this engine, the same on every rank
    (collective over the world). vLLM never removes them, so once every rank has mapped its group's segments (the
    engine is built), each rank unlinks its own: the memory lives while the engine does and goes with its process,
    however it ends."""
    if order is None:
        yield
        return
    from vllm.distributed import parallel_state as vps
    from vllm.distributed.device_communicators import cpu_communicator

    ident = [uuid.uuid4().hex[:12]]
    collectives.broadcast_object_list(ident, src=0)
    named = cpu_communicator._CPUSHMDistributed.make_group_name

    segments: list[str] = []  # this rank's, as vLLM's shared-memory manager names them: "<group name>_<rank>"

    def with_identity(communicator: Any) -> str:
        name = named(communicator)  # "//-tp:0-[0-2]-cpushm": a shared-memory name has no "/" past its first ones
        rest = name.lstrip("/")
        segments.append(f"hf{ident[0]}{rest}_{communicator.rank_in_group}")
        return f"{name[:len(name) - len(rest)]}hf{ident[0]}{rest}"

    cpu_communicator._CPUSHMDistributed.make_group_name = staticmethod(with_identity)  # type: ignore[method-assign]

    class _Ordered:
        def __getattr__(self, name: str) -> object:
            return getattr(torch, name)

        @staticmethod
        def arange(*args: object, **kwargs: object) -> torch.Tensor:
            if args == (len(order),) and not kwargs:
                return torch.tensor(order)
            return torch.arange(*args, **kwargs)  # type: ignore[call-overload]

    vps.torch = _Ordered()  # type: ignore[assignment]
    try:
        yield
    finally:
        vps.torch = torch
        cpu_communicator._CPUSHMDistributed.make_group_name = staticmethod(named)  # type: ignore[method-assign]
    collectives.barrier()  # every rank has mapped every segment of its groups
    for segment in dict.fromkeys(segments):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{segment}")


def check_vocabulary_shards(model: torch.nn.Module, tp: int) -> None:
    """vLLM pads the vocabulary before splitting it; the actor's vocabulary shards are its own only without padding."""
    embed = model.model.embed_tokens
    if embed.org_vocab_size != embed.num_embeddings_padded:
        raise ValueError(f"spec.rollout.tensorParallel = {tp}: vLLM pads this model's vocabulary of "
                         f"{embed.org_vocab_size} to {embed.num_embeddings_padded}, so its shards are not the actor's; "
                         "use a vocabulary that is a multiple of 64 x tensorParallel, or spec.rollout.engine: megatron")


def install_shards(model: torch.nn.Module, shards: Iterable[tuple[str, torch.Tensor]]) -> None:
    """This rank's TP shards under HF names, copied into vLLM's parameters' own storage (never rebinding
    `param.data`, which would move a GPU weight out of sleep mode's memory and away from captured CUDA graphs): q/k/v
    and gate/up are fused in the order of vLLM's `packed_modules_mapping` (each of its fused shards is [q_r; k_r;
    v_r], [gate_r; up_r]); a tied LM head is the embedding. Each layer's GEMMs are packed again (CPU) once its
    weights are in. Only a CPU parameter that vLLM's GEMM packing left empty gets storage anew."""
    packed = {part: (fused, i, len(parts)) for fused, parts in getattr(model, "packed_modules_mapping", {}).items()
              for i, part in enumerate(parts)}
    params = dict(model.named_parameters())
    tied = "lm_head.weight" not in params
    pending: dict[str, list[torch.Tensor | None]] = {}
    touched: set[str] = set()
    for name, t in shards:
        if name == "lm_head.weight" and tied:
            continue
        module_name, _, kind = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if leaf in packed:
            fused, i, n = packed[leaf]
            target = f"{parent}.{fused}.{kind}"
            parts = pending.setdefault(target, [None] * n)
            parts[i] = t
            if any(p is None for p in parts):
                continue
            t = torch.cat(pending.pop(target))  # type: ignore[arg-type]
            name = target
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = module.get_parameter(kind)
        if param.shape == t.shape:
            param.data.copy_(t)  # into the storage vLLM allocated (sleep mode's, the graphs'): module docstring
        elif param.numel() == 0 and param.device.type == "cpu":  # emptied: vLLM's CPU GEMM packing keeps the weight
            # only as the packed handle (or release() dropped it); the post-load step below packs this new one
            param.data = t.to(dtype=param.dtype, device=param.device).contiguous()
        else:
            raise ValueError(f"vLLM's {name} is {tuple(param.shape)} on {param.device}, its shard "
                             f"{tuple(t.shape)}: the shard does not fit the storage it must be copied into")
        touched.add(module_name)
    if pending:
        raise KeyError(f"vLLM shards incomplete: {sorted(pending)[:3]}")
    for module_name in sorted(touched):
        module = model.get_submodule(module_name)
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def install_shards_in_worker(worker: Any, shards: Iterable[tuple[str, torch.Tensor]]) -> None:
    """`install_shards` inside vLLM's worker (collective_rpc hands the worker over), in the worker's config context
    as its own reload_weights runs: the layers' post-load steps may read the current vLLM config."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        install_shards(worker.get_model(), shards)
