"""The megatron training engine on CPU (gloo): HF weights convert both ways, and one engine step at TP=2 x DP=2,
TP=2 x PP=2 and PP=2 x DP=2 (Llama and Qwen2) computes the log-probs, loss, gradients and gradient norm that plain
HF autograd computes."""
import pytest
import torch
from support.megatron_inputs import hf_model, tiny_batch
from support.megatron_launcher import engine_steps, objective
from support.paths import TESTS

from hybridflow.algorithms.core import entropy_from_logits
from hybridflow.engines.train import megatron_model as mm
from hybridflow.engines.train.fsdp import response_logits, token_log_probs


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_hf_megatron_round_trip_is_exact(arch):
    model = hf_model(arch)
    hf = dict(model.state_dict())
    shape = mm.shape_from_hf(model.config)
    assert shape.qkv_bias == (arch == "qwen2") and shape.tied == (arch == "qwen2")
    mg = mm.hf_to_megatron(hf, shape)
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    back = mm.megatron_to_hf(mg, shape)
    assert back.keys() >= {k for k in hf if not (shape.tied and k == "lm_head.weight")}
    for k, v in back.items():
        assert torch.equal(v, hf[k]), k


def test_conversion_refuses_other_architectures():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="Llama and Qwen2.*engine: fsdp"):
        mm.shape_from_hf(GPT2Config())


def _hf_reference(model, batch):
    from hybridflow.single_controller.batch import Batch

    logits = response_logits(model, Batch(batch), 1.0)
    logp = token_log_probs(logits, batch["responses"])
    loss = objective(logp, entropy_from_logits(logits))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values()))
    return {"loss": loss.item(), "log_probs": logp.detach(), "grads": grads, "grad_norm": float(norm)}


# Four layouts on four ranks cover TP, DP and PP combined, with tied (qwen2: the embedding's two copies on the first
# and last stage) and untied (llama) embeddings. Spawning the ranks (torch and megatron-core imported in each, ~25
# CPU-s) costs far more than a step of these models: one spawn runs every layout, megatron's groups made anew for each.
LAYOUTS = {"llama-tp2xdp2": ("llama", 2, 1), "llama-pp2xdp2": ("llama", 1, 2), "qwen2-tp2xpp2": ("qwen2", 2, 2),
           "qwen2-pp2xdp2": ("qwen2", 1, 2)}


@pytest.fixture(scope="module")
def engine_steps_and_references(tmp_path_factory):
    """{layout: (the engine's step on 4 ranks, HF autograd's on one process)}."""
    batch, refs, dirs = tiny_batch(), {}, {}
    for arch in ("llama", "qwen2"):
        model = hf_model(arch)
        dirs[arch] = tmp_path_factory.mktemp(arch) / "model"
        model.save_pretrained(dirs[arch], safe_serialization=True)
        refs[arch] = _hf_reference(model, batch)
    got = engine_steps([(str(dirs[arch]), tp, pp) for arch, tp, pp in LAYOUTS.values()], batch, world=4)
    return {name: (step, refs[arch]) for (name, (arch, _, _)), step in zip(LAYOUTS.items(), got)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_step_matches_hf_autograd(engine_steps_and_references, layout):
    got, ref = engine_steps_and_references[layout]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    torch.testing.assert_close(got["log_probs"], ref["log_probs"], rtol=1e-5, atol=1e-5)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("name,shape", [
    ("decoder.layers.0.self_attention.linear_qkv.weight", (128, 64)),
    ("decoder.layers.0.self_attention.linear_proj.weight", (64, 64)),
    ("decoder.layers.0.mlp.linear_fc1.weight", (256, 64)),
    ("decoder.layers.0.mlp.linear_fc2.weight", (64, 128)),
    ("embedding.word_embeddings.weight", (32, 64)),
    ("decoder.final_layernorm.weight", (64,)),
])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_unshard_round_trip(name, shape, tp):
    full = torch.randn(shape)
    parts = [mm.shard(name, full, tp, r) for r in range(tp)]
    assert torch.equal(mm.unshard(name, parts), full)
    if mm.split_rule(name) == "gated":  # each rank holds [gate_r; up_r], not a contiguous chunk of [gate; up]
        gate, up = full.chunk(2)
        assert torch.equal(parts[0], torch.cat([gate.chunk(tp)[0], up.chunk(tp)[0]]))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1), (2, 2)])
def test_each_rank_reads_exactly_its_own_shards_of_its_stage(tmp_path, arch, tp, pp):
    """What a rank reads from the safetensors files (its stage's tensors, its TP block of each) is what sharding
    the whole model gives it: the whole model is never loaded, nor a whole tensor that is split."""
    from safetensors.torch import save_file

    model = hf_model(arch)
    hf = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        hf.pop("lm_head.weight")  # saved once, as HF writes a tied head
    save_file(hf, str(tmp_path / "model.safetensors"))
    shape = mm.shape_from_hf(model.config)
    full = mm.hf_to_megatron(hf, shape)
    per = shape.layers // pp
    for stage in range(pp):
        first, last, layers = stage == 0, stage == pp - 1, range(stage * per, (stage + 1) * per)
        for r in range(tp):
            got = mm.read_rank_shards(tmp_path, shape, tp, r, first, last, layers)
            own = {n for n in full if not n.startswith("decoder.layers.") or int(n.split(".")[2]) in layers}
            own = {n for n in own if (n != "embedding.word_embeddings.weight" or first or (last and shape.tied))
                   and (n != "decoder.final_layernorm.weight" or last) and (n != "output_layer.weight" or last)}
            assert set(got) == own
            for name in own:
                assert torch.equal(got[name], mm.shard(name, full[name], tp, r)), (stage, r, name)


_BF16_ENGINE = """
import json, sys, torch, torch.distributed as dist
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from support.megatron_inputs import tiny_batch
from support.megatron_launcher import objective
from hybridflow.engines.train.megatron import MegatronEngine
from hybridflow.single_controller.batch import Batch

dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
engine = MegatronEngine(Path(sys.argv[1]), "bfloat16", 1, lr=1e-6, grad_clip=1e9, device="cpu")
before = {n: p.detach().clone() for n, p in engine.trained_parameters()}

def loss_fn(model, mb):
    lp, logits = engine.log_probs(model, mb, 1.0)
    loss = objective(lp, engine.entropy(logits))
    return loss, {"loss": loss.detach()}

engine.train_mini_batch(Batch(tiny_batch()), 4, loss_fn)
state = engine.checkpoint_state()
print(json.dumps({
    "module": sorted({str(p.dtype) for p in engine.module.parameters()}),
    "masters": sorted({str(t.dtype) for _, t in engine.trained_parameters()}),
    "moments": sorted({str(s[k].dtype) for s in engine.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")}),
    "moved": sum(not torch.equal(t, before[n]) for n, t in engine.trained_parameters()),
    "params": len(before),
    "published": all(torch.equal(p, engine.masters.master_of(p).to(p.dtype)) for p in engine.module.parameters()),
    "checkpoint": sorted({str(t.dtype) for t in state["model"].values()}),
}))
dist.destroy_process_group()
"""


def test_a_bf16_megatron_actor_steps_fp32_masters_and_checkpoints_them(tmp_path):
    """models.actor.dtype bfloat16 on megatron: the module computes in bf16, the optimizer steps fp32 masters with
    fp32 moments (an lr 1e-6 step moves every one of them; bf16 weights would mostly not move), the module takes
    the masters cast back, and checkpoints keep the fp32 masters."""
    import json
    import subprocess
    import sys

    hf_model("qwen2").save_pretrained(tmp_path / "model", safe_serialization=True)
    run = subprocess.run([sys.executable, "-c", _BF16_ENGINE, str(tmp_path / "model"), str(tmp_path / "store"),
                          str(TESTS)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert "torch.bfloat16" in got["module"]  # (its norms' weights may stay fp32, as megatron builds them)
    assert got["masters"] == got["moments"] == got["checkpoint"] == ["torch.float32"]
    assert got["moved"] == got["params"] and got["published"]


def test_megatron_generation_keeps_a_kv_cache_and_chooses_what_a_full_forward_chooses():
    """The megatron generation engine (t_g > 1's fallback) decodes with megatron-core's static KV cache: greedy
    responses (one prompt left-padded) are exactly the argmax of a plain full forward over prompt + response at
    every position, and the model is fed the padded prompts once and then one token per row per step (n forward
    tokens per row for n new ones, not O(n^2): what the cache is for; timing it instead flaked on a busy machine
    and cost 100 s). One process of its own (support/megatron_generation.py): gloo and
    megatron's state stay out of this runner."""
    import json
    import os
    import subprocess
    import sys

    spec = {"shape": {"vocab": 64, "hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "ffn": 256,
                      "max_len": 128},
            "prompts": [[1, 2, 3, 4, 5], [7, 8, 9]], "check_tokens": 24, "weight_scale": 20.0}
    tests = TESTS
    out = subprocess.run([sys.executable, "-m", "support.megatron_generation", json.dumps(spec)], cwd=tests,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["responses"] == got["forced"]
    assert len({t for r in got["responses"] for t in r}) > 8, "a model that repeats one token proves little"
    assert got["fed"] == [max(map(len, spec["prompts"]))] + [1] * (spec["check_tokens"] - 1), got["fed"]
