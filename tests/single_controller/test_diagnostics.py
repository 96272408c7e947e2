"""The worker diagnostics the GPU suite reads with (hybridflow.single_controller.diagnostics, run by
`WorkerHost.diagnose`), here on the CPU: on a stand-in host holding a real FSDP2 engine (one gloo rank, bfloat16
compute over fp32 master weights) and a real HF generation engine, the readings tests/gpu judges on a GPU."""
from __future__ import annotations

import ast
import json
from types import SimpleNamespace

import pytest

from hybridflow.registry import Registry
from hybridflow.single_controller import diagnostics
from hybridflow.single_controller.diagnostics import DIAGNOSTICS, run_diagnostic

from support.paths import TESTS

GPU_TESTS = TESTS / "gpu"


def _names_the_gpu_suite_reads() -> set[str]:
    """Every diagnostic name tests/gpu passes to `diagnose(...)` (its first string argument) or lists as used."""
    names: set[str] = set()
    for path in GPU_TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "diagnose":
                names.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "USED_DIAGNOSTICS" for t in node.targets):
                names.update(ast.literal_eval(node.value))
    return names


def test_every_diagnostic_the_gpu_suite_reads_is_registered():
    used = _names_the_gpu_suite_reads()
    assert {"device_memory", "process_group", "precision_probe", "precision", "generation_weights"} <= used
    assert used <= set(DIAGNOSTICS), f"not registered: {sorted(used - set(DIAGNOSTICS))}"


def test_an_unknown_diagnostic_names_the_registered_ones():
    with pytest.raises(KeyError, match="unknown diagnostic 'nope'; registered: .*device_memory"):
        run_diagnostic(SimpleNamespace(), "nope")


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="diagnostic 'precision' is registered twice"):
        diagnostics.diagnostic("precision")(lambda host: None)
    assert DIAGNOSTICS["precision"] is diagnostics.precision


def test_worker_host_diagnose_runs_the_registered_function(monkeypatch):
    """WorkerHost.diagnose (the Ray actor's own method, called here on a stand-in self) runs what is registered."""
    from hybridflow.single_controller.worker_host import WorkerHost

    calls = []
    registry = Registry("diagnostic")  # the module's table with "echo" added, for this test only
    for name, fn in DIAGNOSTICS.items():
        registry.add(name, fn)
    registry.add("echo", lambda host, *args: calls.append((host, args)) or list(args))
    monkeypatch.setattr(diagnostics, "DIAGNOSTICS", registry)
    host = SimpleNamespace()
    assert WorkerHost.__ray_metadata__.modified_class.diagnose(host, "echo", 1, "two") == [1, "two"]
    assert calls == [(host, (1, "two"))]


@pytest.fixture
def host(one_rank, tmp_path):
    """A stand-in WorkerHost: an FSDP2 actor engine (tiny Llama, fp32 master weights, bfloat16 compute) and an
    HF generation engine loaded from the same weights, as a colocated actor + rollout worker holds them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.engines.rollout.hf import HFRollout
    from hybridflow.engines.train.fsdp import FSDPEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "model")
    engine = FSDPEngine(model, lr=0.05, grad_clip=1.0, device="cpu", compute_dtype=torch.bfloat16)
    generator = HFRollout(tmp_path / "model", "float32", torch.device("cpu"), 0)
    actor = SimpleNamespace(engine=engine, config=SimpleNamespace(train_engine=SimpleNamespace(model_parallel=False)))
    rollout = SimpleNamespace(generator=generator, generation_dtype=torch.bfloat16)
    return SimpleNamespace(roles={"actor": actor, "rollout": rollout}, ctx=SimpleNamespace(device="cpu", local_rank=0))


def _train_step(engine) -> None:
    import torch

    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    loss = engine.module(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad()


def test_precision_probe_and_precision_read_master_and_compute_dtypes(host):
    assert run_diagnostic(host, "precision_probe") is True
    _train_step(host.roles["actor"].engine)
    r = run_diagnostic(host, "precision")
    json.dumps(r)
    assert r["engine"] == "FSDPEngine" and r["probe_installed"]
    assert r["compute_dtype"] == "torch.bfloat16"
    assert r["param_dtypes"] == r["shard_dtypes"] == ["torch.float32"]
    assert r["optimizer_state_dtypes"]["exp_avg"] == r["optimizer_state_dtypes"]["exp_avg_sq"] == ["torch.float32"]
    assert r["optimizer_states"] > 0 and r["shard_devices"] == ["cpu"]
    assert [s["grad_dtypes"] for s in r["step"]] == [["torch.float32"]] and r["step"][0]["grads"] > 0
    assert r["forward"] and all(f["weight"] == f["output"] == "torch.bfloat16" for f in r["forward"])
    assert any(f["grad_enabled"] for f in r["forward"])


def test_generation_weights_compare_every_tensor_and_see_a_stale_one(host):
    import torch

    engine, generator = host.roles["actor"].engine, host.roles["rollout"].generator
    _train_step(engine)  # the trainer moved on: the engine is stale until its weights are loaded
    stale = run_diagnostic(host, "generation_weights")
    assert not stale["exact"] and stale["all"]["exact"] < stale["all"]["tensors"]
    generator.load_weights(engine.full_params())
    r = run_diagnostic(host, "generation_weights")
    json.dumps(r)
    assert r["engine"] == "HFRollout" and r["exact"] and r["padding_zero"]
    assert r["all"]["tensors"] == r["all"]["exact"] > 0 and not r["all"]["unmatched"] and not r["all"]["differ"]
    assert r["gen_dtype"] == r["train_dtype"] == "torch.float32" and r["generation_dtype"] == "bfloat16"
    assert r["unit_roundoff"] == pytest.approx(torch.finfo(torch.float32).eps / 2)
    with torch.no_grad():
        generator.model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0  # one element of one tensor
    off = run_diagnostic(host, "generation_weights")
    assert off["exact"]  # the embedding alone does not see it
    assert off["all"]["exact"] == off["all"]["tensors"] - 1
    assert off["all"]["differ"] == ["model.layers.1.mlp.up_proj.weight (max |diff| 1.000e+00)"]


def test_device_memory_on_a_cpu_reads_rss_and_no_sleep_flag(host):
    r = run_diagnostic(host, "device_memory", True)
    json.dumps(r)
    assert r["engine"] == "HFRollout" and r["asleep"] is None and r["rss"] > 0 and "device_used" not in r


def test_device_memory_reads_vllms_sleep_flag():
    VLLMRollout = type("VLLMRollout", (), {"asleep": True})  # the flag is all it reads of the engine
    host = SimpleNamespace(roles={"rollout": SimpleNamespace(generator=VLLMRollout())})
    assert run_diagnostic(host, "device_memory")["asleep"] is True


def test_process_group_reads_the_backend_and_all_reduces(host, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    r = run_diagnostic(host, "process_group")
    json.dumps(r)
    assert r["rank"] == 0 and r["world_size"] == 1 and r["backend"] == "gloo"
    assert r["backend_class"] == {"cpu": "ProcessGroupGloo"}
    assert r["param_type"] == "DTensor" and r["param_device"] == "cpu" and r["mesh_backend"] == "gloo"
    assert r["all_reduce"] == r["all_reduce_expected"] == r["cpu_all_reduce"] == 1.0
    assert r["env"]["LOCAL_RANK"] == "0" and r["ctx_local_rank"] == 0


def test_megatron_reads_the_engine_layout(one_rank):
    import torch

    MegatronEngine = type("MegatronEngine", (), {})
    engine = MegatronEngine()
    engine.module, engine.device, engine.tp_size, engine.dp_size = torch.nn.Linear(2, 2), torch.device("cpu"), 1, 1
    host = SimpleNamespace(roles={"actor": SimpleNamespace(engine=engine),
                                  "rollout": SimpleNamespace(generator=type("MegatronRollout", (), {})())})
    r = run_diagnostic(host, "megatron")
    assert r == {"rank": 0, "engine": "MegatronEngine", "device": "cpu", "param_device": "cpu",
                 "param_dtype": "torch.float32", "backend": "gloo", "tp": 1, "dp": 1, "rollout": "MegatronRollout"}
