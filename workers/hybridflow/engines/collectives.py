"""Every collective the engines run goes through here (tests/engines/test_gpu_decisions.py forbids direct `dist.*` collective
calls elsewhere in engines/), so that one check sees every tensor a group is given.

On a GPU node a worker group's world is `cpu:gloo,cuda:nccl` (single_controller.local_devices): NCCL carries CUDA
tensors and gloo CPU ones. A group made with one backend only (NCCL alone, as a GPU world used to be, or a gloo group
of our own) cannot carry the other device's tensors; torch then fails deep inside ("No backend type associated with
device type cpu"), on GPU nodes only, where the tests never ran. `check_devices` fails first, on every machine, with
the operation and the tensor's device named: a CPU test of a CUDA-only group's decision is a test of the GPU path.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

# which device types a backend serves on its own (a mixed "cpu:gloo,cuda:nccl" names them per device)
_SERVES = {"gloo": ("cpu",), "nccl": ("cuda",), "mpi": ("cpu", "cuda"), "ucc": ("cpu", "cuda"), "fake": ("cpu", "cuda")}


def served_devices(backend: str) -> set[str]:
    """The device types a backend string serves: "gloo" -> {cpu}, "nccl" -> {cuda}, "cpu:gloo,cuda:nccl" -> both."""
    out: set[str] = set()
    for part in backend.lower().split(","):
        device, sep, name = part.strip().partition(":")
        if sep:
            out.add(device)
        else:
            out.update(_SERVES.get(device, ()))
    return out


def check_devices(op: str, backend: str, tensors: Sequence[torch.Tensor]) -> None:
    """Refuse a collective whose tensors lie on a device the group's backend does not serve, naming both."""
    served = served_devices(backend)
    for t in tensors:
        if t.device.type not in served:
            raise ValueError(f"{op}: a {t.device.type} tensor {tuple(t.shape)} on a process group with backend "
                             f"'{backend}', which serves {sorted(served) or 'no device'}; move it to "
                             f"{' or '.join(sorted(served))}, or make the group with a backend for {t.device.type}")


def _checked(op: str, group: dist.ProcessGroup | None, *tensors: torch.Tensor) -> None:
    check_devices(op, str(dist.get_backend(group)), tensors)


def all_reduce(t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    _checked("all_reduce", group, t)
    dist.all_reduce(t, op=op, group=group)


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    _checked("all_gather", group, t, *parts)
    dist.all_gather(parts, t, group=group)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); older torch has only the old.
_ALL_GATHER_INTO: Any = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Every member's `t` into row m of `out`, (size, t.numel()), one contiguous buffer (no list, no cat)."""
    _checked("all_gather_into", group, out, t)
    if _ALL_GATHER_INTO is not None:
        _ALL_GATHER_INTO(out.view(-1), t, group=group)
    else:  # no single-tensor all-gather in this torch: the list form, writing into rows of the same buffer
        dist.all_gather(list(out.unbind(0)), t, group=group)


def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """`src` is a global rank, as in torch."""
    _checked("broadcast", group, t)
    dist.broadcast(t, src=src, group=group)


def broadcast_object_list(objects: list[Any], src: int, group: dist.ProcessGroup | None = None) -> None:
    """Pickled objects travel as a byte tensor on the device torch picks for the group (the CPU where the group has
    gloo): nothing to check here but that the group exists."""
    dist.broadcast_object_list(objects, src=src, group=group)


def all_gather_object(out: list[Any], obj: Any, group: dist.ProcessGroup | None = None) -> None:
    dist.all_gather_object(out, obj, group=group)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    dist.barrier(group=group)


def new_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """A subgroup with the world's backend (both devices' backends on a GPU world)."""
    return dist.new_group(list(ranks))
