"""LoRA on the megatron engine (engines.train.megatron_lora) at tensorParallel 1, pipelineParallel 1: adapters on
megatron's fused linears, trained alone on a frozen base; what leaves the engine is PEFT's per-projection adapters,
which HF + peft (and so vLLM) load to the engine's own policy. The engine runs in a process of its own
(support/megatron_lora.py: gloo and megatron's parallel state stay out of this runner), once for the module, on the
small Qwen2 (tied embeddings, QKV bias, two query heads per key/value group: the fused QKV's per-group order)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support.megatron_inputs import hf_model
from support.paths import TESTS

from hybridflow.api import SpecError, parse_job
from hybridflow.engines.train import megatron_model as mm
from hybridflow.api.training import MEGATRON_LINEAR_PARTS
from hybridflow.engines.train.megatron_lora import adapted_linears, hf_adapters, megatron_adapter
from hybridflow.models import lora
from hybridflow.models.lora import LoraSettings

SETTINGS = LoraSettings(rank=4, alpha=8.0)
LINEARS = 2 * 4  # the small model's 2 layers x megatron's linear_qkv, linear_proj, linear_fc1, linear_fc2
PROJECTIONS = 2 * 7  # the same adapters as PEFT names them: q, k, v, o, gate, up, down of each layer


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("megatron_lora")
    hf_model("qwen2").save_pretrained(work / "model", safe_serialization=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "support.megatron_lora", str(work / "model"), str(work / "out.pt"),
                          str(work)], cwd=TESTS, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(work / "out.pt", weights_only=False)


def _qwen2_shape() -> mm.DecoderShape:
    return mm.shape_from_hf(hf_model("qwen2").config)


def test_a_fused_adapter_is_exactly_the_per_projection_adapters_with_lora_a_copied():
    """q/k/v (and gate/up) of x through one adapter on the fused linear, its lora_B's rows split as the weight's,
    are what separate adapters that each hold lora_A give; and the split fuses back to the same tensors."""
    shape = _qwen2_shape()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, shape.hidden, generator=g, dtype=torch.float64)
    for linear, rows in (("self_attention.linear_qkv", (shape.heads + 2 * shape.kv_heads) * shape.kv_channels),
                         ("mlp.linear_fc1", 2 * shape.ffn)):
        name = f"decoder.layers.1.{linear}"
        a = torch.randn(4, shape.hidden, generator=g, dtype=torch.float64)
        b = torch.randn(rows, 4, generator=g, dtype=torch.float64)
        fused = x @ (b @ a).T  # the fused linear's adapter output, its columns in megatron's row order
        per_projection = dict(mm.megatron_to_hf_items([(f"{name}.weight", fused.T)], shape))
        split = dict(hf_adapters([(f"{name}.lora_A.default.weight", a), (f"{name}.lora_B.default.weight", b)],
                                 shape))
        assert len(split) == 2 * len(MEGATRON_LINEAR_PARTS[linear])
        for weight, want in per_projection.items():
            module = weight.removesuffix(".weight")
            got = x @ (split[f"{module}.lora_B.default.weight"] @ split[f"{module}.lora_A.default.weight"]).T
            torch.testing.assert_close(got.T, want, rtol=1e-12, atol=1e-12, msg=module)
        assert torch.equal(megatron_adapter(f"{name}.lora_A.default.weight", split, shape), a)
        assert torch.equal(megatron_adapter(f"{name}.lora_B.default.weight", split, shape), b)


def test_lora_a_copies_that_differ_are_refused():
    shape = _qwen2_shape()
    name = "decoder.layers.0.self_attention.linear_qkv.lora_A.default.weight"
    split = dict(hf_adapters([(name, torch.randn(4, shape.hidden))], shape))
    split["model.layers.0.self_attn.k_proj.lora_A.default.weight"] += 1
    with pytest.raises(ValueError, match="lora_A differ"):
        megatron_adapter(name, split, shape)


def test_the_targets_map_onto_megatrons_linears_and_a_half_targeted_fused_linear_is_refused():
    assert adapted_linears(SETTINGS, "qwen2") == list(MEGATRON_LINEAR_PARTS)  # the family's default: every one
    assert adapted_linears(LoraSettings(4, 8.0, target_modules=("o_proj", "down_proj")), "llama") == [
        "self_attention.linear_proj", "mlp.linear_fc2"]
    with pytest.raises(ValueError, match=r"targetModules: the megatron engine fuses \['k_proj', 'q_proj', 'v_proj'\]"):
        adapted_linears(LoraSettings(4, 8.0, target_modules=("q_proj", "v_proj")), "llama")
    with pytest.raises(ValueError, match=r"targetModules: \['lm_head'\] are not attention or MLP projections"):
        adapted_linears(LoraSettings(4, 8.0, target_modules=("lm_head",)), "llama")


def _job(training: dict, rollout: str = "hf") -> dict:
    return {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
            "spec": {"training": {"engine": "megatron", "lora": {"rank": 4, "alpha": 8}, **training},
                     "rollout": {"engine": rollout}}}


def test_the_rules_take_megatron_lora_at_tp1_pp1_and_refuse_other_layouts_naming_the_fields():
    assert parse_job(_job({})).spec.training.lora.rank == 4
    for field, value in (("tensorParallel", 2), ("pipelineParallel", 2)):
        with pytest.raises(SpecError, match=rf"spec.training.{field} = {value}.*LoRA on the megatron engine trains "
                                            r"at tensorParallel 1 and pipelineParallel 1"):
            parse_job(_job({field: value}))
    with pytest.raises(SpecError, match=r"spec.rollout.engine: the megatron generation engine takes no LoRA "
                                        r"adapters; use spec.rollout.engine: .*hf"):
        parse_job(_job({}, rollout="megatron"))


def test_a_fresh_engine_scores_exactly_as_its_base_with_adapters_alone_trainable(run):
    assert torch.equal(run["fresh"], run["plain"])
    adapters = run["adapters_before"]
    assert len(adapters) == 2 * LINEARS
    assert run["requires_grad"] == run["stepped"] == sorted(adapters) and not run["masters"]
    for name, t in adapters.items():  # PEFT's initialisation: lora_B zero, lora_A kaiming-uniform
        assert t.dtype == torch.float32
        assert (not t.any()) if ".lora_B." in name else t.abs().max() <= 1 / t.shape[1] ** 0.5 and t.std() > 0, name
    assert run["num_parameters"][0] == run["num_parameters"][1]  # the policy's count: the adapters merged in
    # the update's weight gradients: the adapters' alone, every parameter's without LoRA
    assert run["num_trained_parameters"] == (sum(t.numel() for t in adapters.values()), run["num_parameters"][1])


def test_an_update_leaves_the_base_bit_for_bit_moves_every_adapter_and_the_reference_is_the_base(run):
    base = run["base_before"]
    assert base and all(torch.equal(t, run["base_after"][n]) for n, t in base.items())
    assert all(not torch.equal(t, run["adapters_after"][n]) for n, t in run["adapters_before"].items())
    assert run["moments"] == []  # AdamW state for the adapters, and nothing else
    assert not torch.allclose(run["updated"], run["plain"])
    assert torch.equal(run["off"], run["plain"])


def test_the_synced_adapters_loaded_by_peft_give_the_engines_log_probs(run):
    synced = run["synced"]
    assert len(synced) == 2 * PROJECTIONS and all(lora.is_adapter(n) for n in synced)
    torch.testing.assert_close(run["peft"], run["updated"], rtol=1e-5, atol=1e-5)
    merged, peft_merged = run["merged"], run["peft_merged"]
    assert set(merged) == set(peft_merged)
    for name, t in merged.items():  # the whole-weight view is the base merged as peft merges
        torch.testing.assert_close(t, peft_merged[name], rtol=0, atol=1e-6, msg=name)


def test_the_megatron_transfer_hands_the_generation_engine_the_adapters_alone(run):
    pushed, synced = run["pushed"], run["synced"]
    assert set(pushed) == set(synced) and all(torch.equal(t, synced[n]) for n, t in pushed.items())
    want, got = run["checksums"]
    assert want == got and want["adapter"] != 0


def test_checkpoints_hold_the_adapters_and_their_moments_and_restore_the_policy(run):
    assert run["checkpoint_model"] == sorted(run["synced"]) == run["checkpoint_optimizer"]
    assert torch.equal(run["restored"], run["updated"]) and torch.equal(run["restored_whole"], run["updated"])
    after, *restored = run["stepped_after_restore"]  # equal moments: the next step lands on the same adapters
    for other in restored:
        assert all(torch.equal(t, other[n]) for n, t in after.items())


def test_a_bf16_lora_engine_keeps_the_base_in_bf16_and_steps_fp32_adapters_without_masters(run):
    got = run["bf16"]
    assert "torch.bfloat16" in got["base"] and got["adapters"] == got["moments"] == ["torch.float32"]
    assert not got["masters"] and got["base_kept"] and got["adapters_moved"]
