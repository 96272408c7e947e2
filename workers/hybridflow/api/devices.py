"""Device profiles as data: what one device of a pool can hold, by name (`resourcePools[].accelerator`).

Torch-free, so the schema validates the names and the operator can refuse a job that cannot fit before any pod
starts. A new accelerator is one row here, not code: `hybridflow.memory` reads `capacity_bytes` and
`runtime_bytes` only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceProfile:
    """One device: the memory a process can allocate on it and what the runtime holds before any tensor."""

    name: str
    capacity_bytes: int  # what CUDA reports as total (torch.cuda.mem_get_info), a little under the marketing size
    runtime_bytes: int  # CUDA context, cuBLAS/NCCL workspaces, the allocator's slack; on CPU the process's imports
    description: str


# Capacities are the totals CUDA reports on these parts (nvidia-smi's MiB less the driver's reservation); the GPU
# runtime term is what a process holds beyond its tensors: the CUDA context (~0.5 GiB), NCCL's buffers and cuBLAS
# workspaces (~0.5 GiB), and the caching allocator's fragmentation (~0.5 GiB). The CPU profile is this project's
# calibration machine (bench/memory_model.py): a rank of `hybridflow run` with torch, transformers, Ray and a vLLM
# engine holds 0.82 GiB resident before its models; its capacity is the host's and is checked by
# hybridflow.capacity, so it is left at 0 (no fit verdict here).
PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile("h100-80gb", int(79.1 * GIB), int(1.5 * GIB), "NVIDIA H100 80GB (SXM/PCIe)"),
    DeviceProfile("h200-141gb", int(139.8 * GIB), int(1.5 * GIB), "NVIDIA H200 141GB"),
    DeviceProfile("a100-80gb", int(79.1 * GIB), int(1.5 * GIB), "NVIDIA A100 80GB"),
    DeviceProfile("l40s-48gb", int(44.4 * GIB), int(1.5 * GIB), "NVIDIA L40S 48GB"),
    DeviceProfile("cpu", 0, int(0.82 * GIB), "a CPU rank of `hybridflow run` (host memory: hybridflow.capacity)"),
)}
GPU_PROFILES = tuple(n for n in PROFILES if n != "cpu")
SIZE_GIB = re.compile(r"^([0-9]{1,5}(?:\.[0-9]{1,3})?)Gi$")
ACCELERATOR_PATTERN = rf"^({'|'.join(map(re.escape, GPU_PROFILES))}|[0-9]{{1,5}}(\.[0-9]{{1,3}})?Gi)$"


def accelerator_problem(value: str) -> str | None:
    """Why `value` names no device profile (None when it does): one of the profiles, or a size such as 96Gi."""
    if value in GPU_PROFILES or SIZE_GIB.match(value):
        return None
    return f"'{value}' is not a device profile: use one of {', '.join(GPU_PROFILES)}, or a size in GiB such as 96Gi"


def profile(value: str) -> DeviceProfile:
    """The profile an `accelerator` value names; a bare size gets the GPU runtime term of the named profiles."""
    if value in PROFILES:
        return PROFILES[value]
    size = SIZE_GIB.match(value)
    if size is None:
        raise ValueError(accelerator_problem(value))
    return DeviceProfile(value, int(float(size.group(1)) * GIB), PROFILES["h100-80gb"].runtime_bytes,
                         f"a GPU of {size.group(1)} GiB")
