"""`hybridflow doctor`: the pure verdict on made-up nodes (a good H100 node, each mismatch a GPU node can have, a CPU
node), the parsers of what it reads (nvidia-smi's CSV, vLLM's torch pin), and the real command once on this machine,
a CPU node: facts printed, exit 0, and exit 1 when `--gpu` asks for a GPU that is not there."""
from __future__ import annotations

import dataclasses

import pytest

from hybridflow import doctor
from hybridflow.doctor import Gpu, NodeFacts, problems

GOOD = NodeFacts(driver="580.95.05", gpus=(Gpu("NVIDIA H100 80GB HBM3", 81559),) * 8, torch="2.13.0+cu130",
                 torch_cuda="13.0", torch_gpus=8, nccl="2.29.7", vllm="0.32.0", vllm_torch="2.13.0")
CPU = NodeFacts(torch="2.13.0+cpu", vllm="0.32.0", vllm_torch="2.13.0+cpu")


def test_a_good_gpu_node_and_a_cpu_node_have_no_problem():
    assert problems(GOOD, want_gpu=True) == [] and problems(GOOD) == []
    assert problems(CPU) == []
    lines, code = doctor.verdict(CPU, [], want_gpu=False)
    assert code == 0 and "CPU node" in lines[0]
    assert doctor.verdict(GOOD, [], want_gpu=True)[1] == 0


@pytest.mark.parametrize("change,want_gpu,words", [
    ({"driver": "570.172.08"}, False, ["driver 570.172.08", "580 or newer", "upgrade"]),
    ({"torch": "2.9.0+cu128", "torch_cuda": "12.8", "vllm_torch": "2.9.0"}, False, ["CUDA 12.8", "CUDA 13 build"]),
    ({"torch": "2.13.0+cpu", "torch_cuda": None, "torch_gpus": 0, "nccl": None}, False, ["CPU build", "worker-gpu"]),
    ({"torch_gpus": 0}, False, ["cannot use", "CUDA_VISIBLE_DEVICES"]),
    ({"vllm": "0.31.1"}, False, ["vLLM 0.31.1", "pins 0.32.0", "constraints/gpu.txt"]),
    ({"vllm_torch": "2.12.0"}, False, ["torch 2.12.0", "vllm._C", "install torch 2.12.0"]),
    ({"vllm": None, "vllm_torch": None}, True, ["vLLM is not installed"]),
    ({"torch": None, "torch_cuda": None, "nccl": None}, False, ["torch is not installed"]),
])
def test_each_mismatch_is_one_sentence_that_says_what_to_do(change, want_gpu, words):
    found = problems(dataclasses.replace(GOOD, **change), want_gpu=want_gpu)
    assert len(found) == 1, found
    assert all(w in found[0] for w in words), found[0]
    lines, code = doctor.verdict(GOOD, found, want_gpu)
    assert code == 1 and lines == [f"error: {found[0]}"]


def test_a_driver_too_old_for_cuda_12_too():
    """The driver check follows the CUDA torch was built for, not only CUDA 13 (minor versions share a driver)."""
    old = dataclasses.replace(GOOD, driver="520.61.05", torch="2.9.0+cu128", torch_cuda="12.8", vllm_torch="2.9.0")
    assert any("525 or newer" in p for p in problems(old, cuda_major=12))
    assert problems(dataclasses.replace(old, driver="535.0"), cuda_major=12) == []


def test_gpu_asked_on_a_cpu_node():
    found = problems(CPU, want_gpu=True)
    assert any("no GPU is visible" in p and "--gpu" in p for p in found)
    assert any("CPU build" in p for p in found)  # and its torch could not use one anyway


def test_describe_prints_one_fact_per_line():
    lines = doctor.describe(GOOD)
    text = "\n".join(lines)
    for fact in ("NVIDIA driver: 580.95.05", "torch: 2.13.0+cu130", "CUDA (torch built with): 13.0", "NCCL: 2.29.7",
                 "vLLM: 0.32.0 (built against torch 2.13.0)", "GPUs: 8 visible, torch can use 8",
                 "GPU 7: NVIDIA H100 80GB HBM3, 79.6 GiB"):
        assert fact in lines, text
    assert doctor.describe(CPU)[-1] == "GPUs: none visible: a CPU node"


def test_parsers():
    smi = "580.95.05, NVIDIA H100 80GB HBM3, 81559\n580.95.05, NVIDIA H100 80GB HBM3, 81559\n"
    assert doctor.parse_nvidia_smi(smi) == ("580.95.05", (Gpu("NVIDIA H100 80GB HBM3", 81559),) * 2)
    failed = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
    assert doctor.parse_nvidia_smi(failed) == (None, ())
    assert doctor.torch_pin(["numpy", "torch==2.13.0", "torchvision==0.28.0"]) == "2.13.0"
    vllm_cpu = ['torch==2.13.0+cpu; platform_machine == "x86_64"', 'torch==2.13.0; platform_machine == "ppc64le"',
                "torch>=2; extra == 'dev'"]
    assert doctor.torch_pin(vllm_cpu) == "2.13.0+cpu"
    assert doctor.torch_pin(["torch>=2.4"]) is None
    assert doctor.release("2.13.0+cu130") == (2, 13, 0) and doctor.release(None) is None


def test_the_command_on_this_cpu_machine(capsys):
    """The real facts of this machine through the CLI: it prints them and calls it a CPU node (exit 0); `--gpu`
    refuses it (exit 1) with the sentence that says why."""
    from hybridflow.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch: 2.13.0+cpu" in out and "vLLM: 0.32.0" in out and "ok: a CPU node" in out, out
    assert main(["doctor", "--gpu"]) == 1
    assert "error: no GPU is visible on this node" in capsys.readouterr().out
