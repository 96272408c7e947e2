"""The memory model of a GPU job (hybridflow.memory): each term, the phases colocated roles add up in, the fit
verdict and its messages, the device profiles as spec data, and `hybridflow plan` on the 7B example (fits on 2 x 8
H100) and on one L40S (refused, exit 2, naming the role). Pure and fast: nothing starts."""
from __future__ import annotations

import json

import pytest
import yaml

from hybridflow.api import SpecError, load_job, parse_job
from hybridflow.api.devices import GIB, PROFILES, profile
from hybridflow.capacity import SMOLLM2_PARAMS
from hybridflow.cli import main
from hybridflow.memory import memory_problems, pool_plans, read_shapes, shape_from_config
from hybridflow.memory.shapes import SMOLLM2, ShapeError
from hybridflow.memory.terms import (
    CUDA_GRAPH_POOL_BYTES, VLLM_WORKSPACE_BYTES, activation_bytes_per_token, micro_batch_tokens,
)

from support.paths import ROOT

EXAMPLE = ROOT / "examples" / "gpu-grpo-7b.yaml"
QWEN_CONFIG = ROOT / "examples" / "models" / "Qwen2.5-7B-Instruct" / "config.json"


def _spec(**spec):
    base = {"models": {"actor": {"source": "smollm2"}}, "data": {"task": "arithmetic"},
            "rollout": {"maxPromptLength": 48, "maxResponseLength": 16},
            "resourcePools": [{"name": "gpus", "devicesPerNode": 4, "device": "gpu", "accelerator": "h100-80gb"}]}
    return parse_job({"spec": {**base, **spec}}).spec


def _terms(spec, role=None):
    [plan] = pool_plans(spec, read_shapes(spec, ROOT))
    return plan, {t.what.split(" (")[0]: t for t in plan.terms if role is None or t.role == role}


def test_shapes_count_the_known_models():
    assert SMOLLM2.params == SMOLLM2_PARAMS
    qwen = shape_from_config(json.loads(QWEN_CONFIG.read_text()), "qwen")
    assert qwen.params == 7_615_616_512  # Qwen2.5-7B-Instruct's published count: 7.61B
    assert (qwen.kv_width, qwen.tied, qwen.qkv_bias) == (512, False, True)


def test_trained_state_is_fp32_and_sharded_by_the_pools_world_size():
    plan, t = _terms(_spec(), "actor")
    P = SMOLLM2_PARAMS
    assert t["fp32 master weights"].phases["generate"] == P * 4 // 4
    assert t["fp32 AdamW moments"].phases["update"] == P * 8 // 4
    assert t["fp32 gradients"].phases == {"generate": 0, "forward": 0, "update": P, "reshard": 0}
    megatron = _spec(training={"engine": "megatron", "tensorParallel": 2})
    _, m = _terms(megatron, "actor")
    assert m["fp32 master weights"].phases["update"] == P * 4 // 2  # TP x PP shards it, not the pool
    assert "bfloat16 module weights" not in m  # an fp32 megatron module is its own master
    bf16 = _spec(models={"actor": {"source": "smollm2", "dtype": "bfloat16"}},
                 training={"engine": "megatron", "tensorParallel": 2})
    _, m = _terms(bf16, "actor")
    assert m["bfloat16 module weights"].phases["generate"] == P * 2 // 2  # the compute copy beside the masters
    assert m["bfloat16 module gradients"].phases == {"generate": 0, "forward": 0, "update": P, "reshard": 0}


def test_an_actor_and_a_critic_update_one_at_a_time_so_only_the_larger_transients_count():
    """PPO: the critic's update and the actor's run one after the other in the same processes. Their fp32 states
    (masters, moments, gradients) are all held in the update phase; their activations, logits and gathered layers
    are not held at once."""
    ppo = _spec(algorithm={"name": "ppo"})
    [plan] = pool_plans(ppo, read_shapes(ppo, ROOT))
    update = {role: [t for t in plan.terms if t.role == role and t.phases["update"]] for role in ("actor", "critic")}
    assert all(any(t.transient for t in ts) and any(not t.transient for t in ts) for ts in update.values())
    lasting = sum(t.phases["update"] for t in plan.terms if not t.transient)
    largest = max(sum(t.phases["update"] for t in ts if t.transient) for ts in update.values())
    assert plan.total("update") == lasting + largest < sum(t.phases["update"] for t in plan.terms)


def test_activations_follow_the_token_budget_and_logits_the_response_positions():
    one = _spec(training={"microBatchSize": 4, "sharedPrompt": False})
    two = _spec(training={"microBatchSize": 8, "sharedPrompt": False})
    assert micro_batch_tokens(one, 4) == (4 * 64, 4 * 16)
    _, a = _terms(one, "actor")
    _, b = _terms(two, "actor")
    assert b["activations"].peak == 2 * a["activations"].peak == 2 * 4 * 64 * activation_bytes_per_token(SMOLLM2, 2)
    # bf16 logits, fp32 log-softmax and its gradient, the logits' gradient: response positions only
    assert a["logits"].peak == 4 * 16 * SMOLLM2.vocab * (2 + 4 + 4 + 4 + 2)
    assert activation_bytes_per_token(SMOLLM2, 4) > activation_bytes_per_token(SMOLLM2, 2)


def test_vllm_takes_its_share_of_the_device_and_sleeps_through_the_update():
    spec = _spec(rollout={"maxPromptLength": 48, "maxResponseLength": 16, "gpuMemoryUtilization": 0.4})
    plan, t = _terms(spec, "rollout")
    share = sum(x.phases["generate"] for k, x in t.items() if k.startswith("vLLM"))
    assert share == int(0.4 * PROFILES["h100-80gb"].capacity_bytes)
    assert t["vLLM workspace"].phases["generate"] == VLLM_WORKSPACE_BYTES
    assert all(x.phases["update"] == 0 for k, x in t.items() if k.startswith("vLLM"))  # asleep
    assert t["vLLM weights"].phases["reshard"] == SMOLLM2_PARAMS * 2  # woken for the transition
    assert t["CUDA-graph pool"].phases["update"] == CUDA_GRAPH_POOL_BYTES  # kept through sleep
    _, eager = _terms(_spec(rollout={"cudaGraphs": "off"}), "rollout")
    assert "CUDA-graph pool" not in eager


def test_colocated_roles_add_up_by_phase_and_the_peak_is_the_largest_phase():
    plan, _ = _terms(_spec())
    for phase in ("generate", "update"):
        assert plan.total(phase) == sum(t.phases[phase] for t in plan.terms)
    assert plan.peak == max(plan.total(p) for p in ("generate", "forward", "update", "reshard"))
    _, ref = _terms(_spec(), "reference")
    assert ref["float32 weights"].phases["update"] == SMOLLM2_PARAMS * 4 // 4  # frozen: its own dtype, sharded


def test_accelerator_names_a_profile_or_a_size():
    assert profile("96Gi").capacity_bytes == 96 * GIB
    with pytest.raises(SpecError, match=r"spec\.resourcePools\[0\]\.accelerator: 'h100' is not a device profile"):
        parse_job({"spec": {"resourcePools": [{"device": "gpu", "accelerator": "h100"}]}})


def test_a_job_that_cannot_fit_is_refused_naming_the_role_the_numbers_and_the_field():
    spec = _spec(resourcePools=[{"name": "gpus", "devicesPerNode": 1, "device": "gpu", "accelerator": "2Gi"}])
    plans = pool_plans(spec, read_shapes(spec, ROOT))
    assert not plans[0].fits
    kv, fit = memory_problems(spec, plans)
    assert "spec.rollout.gpuMemoryUtilization 0.5 x 2.0 GiB leaves no room for vLLM's KV cache" in kv
    assert fit.startswith("spec.resourcePools[0] ('gpus'): actor does not fit a 2Gi (2.0 GiB per device)"), fit
    assert "fp32 AdamW moments 1.0 GiB" in fit and "spec.resourcePools[0].devicesPerNode" in fit
    assert memory_problems(_spec(), pool_plans(_spec(), read_shapes(_spec(), ROOT))) == []


def test_plan_of_the_7b_example_fits_two_nodes_of_h100(capsys):
    assert main(["plan", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "actor: 7.62B parameters" in out and str(QWEN_CONFIG) in out  # the shape shipped beside the example
    assert "pool 'gpus' (spec.resourcePools[0]): 16 x h100-80gb" in out
    assert ": fits" in out and "| actor | fp32 AdamW moments |" in out


def test_plan_refuses_the_7b_example_on_one_l40s(tmp_path, capsys):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["resourcePools"] = [{"name": "gpus", "nodes": 1, "devicesPerNode": 1, "device": "gpu",
                                     "accelerator": "l40s-48gb"}]
    job = tmp_path / "l40s.yaml"
    job.write_text(yaml.safe_dump(doc))
    assert main(["plan", str(job)]) == 2  # no config.json beside this copy: not found, named
    assert "--model-config" in capsys.readouterr().err
    assert main(["plan", str(job), "--model-config", str(QWEN_CONFIG)]) == 2
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    assert "spec.resourcePools[0] ('gpus'): actor does not fit a l40s-48gb (44.4 GiB per device)" in captured.err
    assert "fp32 AdamW moments 56.7 GiB" in captured.err


def test_validate_refuses_a_gpu_job_that_cannot_fit(tmp_path, capsys):
    doc = {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "small"},
           "spec": {"models": {"actor": {"source": "smollm2"}}, "data": {"task": "arithmetic"},
                    "resourcePools": [{"name": "gpus", "devicesPerNode": 1, "device": "gpu", "accelerator": "2Gi"}],
                    "trainer": {"checkpointDir": str(tmp_path / "ck")}}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(job)]) == 2
    assert "actor does not fit a 2Gi" in capsys.readouterr().err
    doc["spec"]["resourcePools"][0]["accelerator"] = "l40s-48gb"
    job.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(job)]) == 0
    assert load_job(EXAMPLE).spec.resource_pools[0].accelerator == "h100-80gb"


# Qwen2.5-7B-Instruct's LoRA at rank 16 on every projection, by hand from its config.json (hidden 3584, 28 heads of
# 128, 4 KV heads: k/v width 512, intermediate 18944, 28 layers): rank x (in + out) per module, per layer
#   q, o 16 x (3584 + 3584) = 114,688 each; k, v 16 x (3584 + 512) = 65,536 each; gate, up, down 16 x (3584 + 18944)
#   = 360,448 each; 1,441,792 per layer; x 28 layers = 40,370,176
QWEN_7B = 7_615_616_512
QWEN_7B_LORA_16 = 40_370_176


def _example_with_lora(**lora):
    doc = yaml.safe_load(EXAMPLE.read_text())
    if lora:
        doc["spec"]["training"]["lora"] = lora
    spec = parse_job(doc).spec
    [plan] = pool_plans(spec, read_shapes(spec, EXAMPLE.parent))
    return plan


def _lasting(plan, role, phase):
    return sum(t.phases[phase] for t in plan.terms if t.role == role and not t.transient)


def test_lora_trains_the_adapters_only_and_the_reference_is_the_actors_base():
    """The 7B example on 16 H100s, with and without LoRA (rank 16, default targets): fp32 masters, moments and
    gradients of the adapters alone, the base frozen in bf16, no reference weights; so the update phase keeps
    exactly the base's fp32 state less the adapters' (P - A bytes per device: 16 bytes a parameter over 16 devices),
    and the peak (generate) the base's masters and moments less the adapters'."""
    full, lora = _example_with_lora(), _example_with_lora(rank=16)
    P, A = QWEN_7B, QWEN_7B_LORA_16
    t = {x.what.split(" (")[0]: x for x in lora.terms if x.role == "actor"}
    assert t["fp32 master weights of the LoRA adapters, rank 16"].phases["generate"] == A * 4 // 16
    assert t["fp32 AdamW moments"].phases["generate"] == A * 8 // 16
    assert t["fp32 gradients"].phases["update"] == A * 4 // 16
    assert t["frozen base weights"].phases == dict.fromkeys(("generate", "forward", "update", "reshard"), P * 2 // 16)
    assert _lasting(full, "reference", "generate") == P * 2 // 16
    assert _lasting(lora, "reference", "generate") == 0  # the actor with its adapters off
    assert any(x.role == "reference" and x.transient for x in lora.terms)  # its forward pass still runs
    update = sum(_lasting(full, r, "update") - _lasting(lora, r, "update") for r in ("actor", "reference"))
    assert update == P - A
    assert full.total("generate") - lora.total("generate") == 12 * (P - A) // 16  # masters + moments; vLLM's share
    assert lora.peak < full.peak and lora.peak_phase == "generate"


def test_lora_moves_only_the_adapters_into_vllm():
    full, lora = _example_with_lora(), _example_with_lora(rank=16)
    r = {x.what.split(" (")[0]: x for x in lora.terms if x.role == "rollout"}
    f = {x.what.split(" (")[0]: x for x in full.terms if x.role == "rollout"}
    assert r["weight sync transient"].phases["reshard"] == QWEN_7B_LORA_16 * 2  # bf16, gathered whole
    assert "3D-HybridEngine transient" not in r and "weight sync transient" not in f
    assert r["vLLM LoRA slot"].phases["generate"] == QWEN_7B_LORA_16 * 2
    # the slot comes out of vLLM's gpuMemoryUtilization share: its KV cache is smaller by it, its share the same
    assert f["vLLM KV cache"].phases["generate"] - r["vLLM KV cache"].phases["generate"] == QWEN_7B_LORA_16 * 2


def test_lora_target_modules_pick_the_adapted_linears_and_a_critic_adapts_on_request():
    qv = _spec(training={"lora": {"rank": 8, "targetModules": ["q_proj", "self_attn.v_proj"]}})
    _, t = _terms(qv, "actor")
    h, q, kv = SMOLLM2.hidden, SMOLLM2.heads * SMOLLM2.head_dim, SMOLLM2.kv_width
    adapters = SMOLLM2.layers * 8 * ((h + q) + (h + kv))  # 30 x 8 x (1152 + 768) = 460,800
    assert adapters == 460_800
    assert t["fp32 master weights of the LoRA adapters, rank 8"].phases["update"] == adapters * 4 // 4
    ppo = _spec(algorithm={"name": "ppo"}, training={"lora": {"rank": 8}})
    _, critic = _terms(ppo, "critic")
    assert critic["fp32 master weights"].phases["update"] == SMOLLM2.params * 4 // 4  # full unless lora.critic
    # a LoRA critic is refused by the spec until the critic engine builds it; the memory model already counts it
    training = ppo.training.model_copy(update={"lora": ppo.training.lora.model_copy(update={"critic": True})})
    both = ppo.model_copy(update={"training": training})
    _, critic = _terms(both, "critic")
    _, actor = _terms(both, "actor")
    adapted = actor["fp32 master weights of the LoRA adapters, rank 8"].phases["update"]
    head = SMOLLM2.hidden + 1  # the value head, trained whole
    assert critic["fp32 master weights of the LoRA adapters, rank 8"].phases["update"] == adapted + head * 4 // 4
    with pytest.raises(ShapeError, match=r"spec\.training\.lora\.targetModules: \['lm_heads'\] name no linear"):
        _terms(_spec(training={"lora": {"targetModules": ["lm_heads"]}}))


def test_plan_of_the_7b_example_shows_what_lora_buys(tmp_path, capsys):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["training"]["lora"] = {"rank": 16, "alpha": 32}
    job = tmp_path / "lora.yaml"
    job.write_text(yaml.safe_dump(doc))
    assert main(["plan", str(job), "--model-config", str(QWEN_CONFIG)]) == 0
    out = capsys.readouterr().out
    assert ("actor: LoRA rank 16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: 40.4M trained "
            "parameters (0.53% of the base") in out
    assert "| reference | no weights of its own: the actor's base, adapters switched off | - | - | - | - |" in out
    assert "peak 42.5 GiB of 79.1 GiB per device (generate phase): fits" in out  # 47.8 GiB without (above)


def test_a_cpu_vllm_releases_its_base_in_a_lora_update_as_in_full_fine_tuning():
    """A CPU vLLM empties its weights for the update: without LoRA the transition brings new ones; with LoRA it
    brings adapters alone and the base is read back from the model directory (engines.rollout.vllm._reload_base),
    so the base is counted outside the update either way."""
    cpu = [{"name": "cpus", "devicesPerNode": 2}]
    _, full = _terms(_spec(resourcePools=cpu), "rollout")
    _, lora = _terms(_spec(resourcePools=cpu, training={"lora": {"rank": 8}}), "rollout")
    assert full["vLLM weights"].phases["update"] == 0 < full["vLLM weights"].phases["generate"]
    assert lora["vLLM weights"].phases["update"] == 0 < lora["vLLM weights"].phases["generate"]
    assert lora["vLLM weights"].phases["generate"] == full["vLLM weights"].phases["generate"]


def test_one_cpu_rank_computing_in_fp32_holds_no_fsdp_copies():
    """The engine's rule (api.training.fsdp_unsharded): one rank whose weights are in the compute dtype trains a
    plain module, so the model counts no gathered layers or unsharded gradients for it; two ranks, or a narrower
    compute dtype, do."""
    def fsdp_term(ranks: int, dtype: str):
        spec = _spec(training={"computeDtype": dtype},
                     resourcePools=[{"name": "cpus", "devicesPerNode": ranks, "device": "cpu"}])
        return _terms(spec, "actor")[1].get("FSDP gathered layers + root, fp32 unsharded grads")

    assert fsdp_term(1, "float32") is None
    assert fsdp_term(2, "float32") is not None and fsdp_term(1, "bfloat16") is not None


def test_a_lora_reference_is_priced_on_the_actors_engine():
    """With LoRA the reference is the actor's engine with its adapters off: fp32 adapters beside a bf16 base keep
    FSDP2 on one rank computing in bf16, so its forward gathers layers, where a reference of its own in bf16 (the
    compute dtype) is a plain module that gathers nothing."""
    def reference_forward(**training) -> int:
        spec = _spec(algorithm={"name": "grpo", "klCoef": 0.01},
                     models={"actor": {"source": "smollm2", "dtype": "bfloat16"}},
                     training={"computeDtype": "bfloat16", **training},
                     resourcePools=[{"name": "cpus", "devicesPerNode": 1, "device": "cpu"}])
        [plan] = pool_plans(spec, read_shapes(spec, ROOT))
        return next(t for t in plan.terms if t.role == "reference" and t.transient).phases["forward"]

    assert reference_forward(lora={"rank": 8}) > reference_forward()


def test_vllm_on_cpu_holds_its_kv_cache_and_weights_outside_the_update_only_beside_the_actor():
    """On CPU release() frees vLLM's weights and its KV cache for the updates (engines/rollout/vllm.py; a critic on
    the same devices releases them first), so neither adds to the update's phase, where the trainer's gradients and
    activations are. On a pool of its own nothing releases them: they count in every phase."""
    spec = _spec(resourcePools=[{"name": "cpus", "devicesPerNode": 2, "device": "cpu"}])
    _, t = _terms(spec, "rollout")
    for what in ("vLLM weights", "vLLM KV cache"):
        assert t[what].phases["update"] == 0, what
        assert t[what].phases["generate"] == t[what].phases["reshard"] > 0, what
    apart = _spec(algorithm={"name": "grpo"}, rollout={"mode": "async", "maxPromptLength": 48, "maxResponseLength": 16},
                  resourcePools=[{"name": "cpus", "devicesPerNode": 2, "device": "cpu"},
                                 {"name": "gen", "devicesPerNode": 1, "device": "cpu"}],
                  placement={"rollout": "gen"})
    plans = pool_plans(apart, read_shapes(apart, ROOT))
    gen = next(p for p in plans if any(t.role == "rollout" for t in p.terms))
    for t in gen.terms:
        if t.what.startswith(("vLLM weights", "vLLM KV cache")):
            assert t.phases["update"] == t.phases["generate"] > 0, t.what
