"""Device profiles as data: what one device of a pool can hold, by name (`resourcePools[].accelerator`).

Torch-free, so the schema validates the names and the operator can refuse a job that cannot fit before any pod
starts. A new accelerator is one row here, not code: `hybridflow.memory` reads `capacity_bytes` and
`runtime_bytes` only; the device-mapping planner (`hybridflow.mapping`) reads the speeds too (peak bf16 FLOP/s,
memory bandwidth, the links within and between nodes, devices per node).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceProfile:
    """One device: the memory a process can allocate on it and what the runtime holds before any tensor."""

    name: str
    capacity_bytes: int  # what CUDA reports as total (torch.cuda.mem_get_info), a little under the marketing size
    runtime_bytes: int  # CUDA context, cuBLAS/NCCL workspaces, the allocator's slack; on CPU the process's imports
    description: str
    # Speeds, for the planner's stage-time model (0: unknown, the planner refuses the profile). Dense (no sparsity)
    # bf16 tensor-core FLOP/s; bytes/s of device memory; bytes/s one way per device over the link inside a node
    # (NVLink, PCIe) and between nodes (the node's network share of one device).
    peak_flops: float = 0.0
    memory_bandwidth: float = 0.0
    intra_node_bandwidth: float = 0.0
    inter_node_bandwidth: float = 0.0
    devices_per_node: int = 8
    # FLOP/s in float32, for layouts that compute in it (megatron computes in its weights' dtype); 0: unknown, the
    # planner takes peak_flops (the GPU rows leave it so); the cpu profile's is measured at start like its peak.
    fp32_peak_flops: float = 0.0


# Capacities are the totals CUDA reports on these parts (nvidia-smi's MiB less the driver's reservation); the GPU
# runtime term is what a process holds beyond its tensors: the CUDA context (~0.5 GiB), NCCL's buffers and cuBLAS
# workspaces (~0.5 GiB), and the caching allocator's fragmentation (~0.5 GiB). The CPU profile is this project's
# calibration machine (bench/memory_model.py): a rank of `hybridflow run` with torch, transformers, Ray and a vLLM
# engine holds 0.82 GiB resident before its models; its capacity is the host's and is checked by
# hybridflow.capacity, so it is left at 0 (no fit verdict here).
#
# Speeds are the vendors' published numbers for the SXM parts in 8-GPU nodes (HGX/DGX): H100 and H200 989 TFLOP/s
# dense bf16, HBM 3.35 and 4.8 TB/s, NVLink 4 900 GB/s both ways (450 one way), one 400 Gb/s NDR NIC per GPU
# (50 GB/s); A100 80GB 312 TFLOP/s, 2.04 TB/s, NVLink 3 600 GB/s both ways (300 one way), one 200 Gb/s HDR NIC per
# GPU (25 GB/s); L40S 362 TFLOP/s dense bf16, 864 GB/s GDDR6, no NVLink (PCIe 4.0 x16, 32 GB/s one way) and an
# assumed 200 Gb/s per GPU between nodes. The CPU profile's peak is a placeholder for a 2-core AVX2 machine: the
# planner takes this machine's measured matmul peak instead (`calibrated`, as the MFU metric does:
# hybridflow.flops.matmul_peak_flops); its links are gloo over loopback and over a 10 Gb/s network.
PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile("h100-80gb", int(79.1 * GIB), int(1.5 * GIB), "NVIDIA H100 80GB SXM (NVLink)",
                  989e12, 3.35e12, 450e9, 50e9, 8),
    DeviceProfile("h200-141gb", int(139.8 * GIB), int(1.5 * GIB), "NVIDIA H200 141GB",
                  989e12, 4.8e12, 450e9, 50e9, 8),
    DeviceProfile("a100-80gb", int(79.1 * GIB), int(1.5 * GIB), "NVIDIA A100 80GB",
                  312e12, 2.039e12, 300e9, 25e9, 8),
    DeviceProfile("l40s-48gb", int(44.4 * GIB), int(1.5 * GIB), "NVIDIA L40S 48GB",
                  362e12, 864e9, 32e9, 25e9, 8),
    DeviceProfile("cpu", 0, int(0.82 * GIB), "a CPU rank of `hybridflow run` (host memory: hybridflow.capacity)",
                  5e10, 1e10, 2e9, 1.25e9, 64),
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


def calibrated(base: DeviceProfile, peak_flops: float, fp32_peak_flops: float | None = None) -> DeviceProfile:
    """`base` with a measured peak (FLOP/s of this device's matmuls in the compute dtype; optionally in float32
    too): how the CPU profile is made real at start, as the MFU metric divides by the rank's own measured peak
    rather than a data sheet's."""
    for value in (peak_flops, 1.0 if fp32_peak_flops is None else fp32_peak_flops):
        if not value > 0:
            raise ValueError(f"a measured peak must be a positive FLOP/s, got {value}")
    fp32 = base.fp32_peak_flops if fp32_peak_flops is None else float(fp32_peak_flops)
    return replace(base, peak_flops=float(peak_flops), fp32_peak_flops=fp32, description=f"{base.description}; "
                   f"peak measured {peak_flops / 1e9:.1f} GFLOP/s" + (f" ({fp32_peak_flops / 1e9:.1f} in float32)"
                                                                    if fp32_peak_flops is not None else ""))
