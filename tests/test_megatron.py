"""megatron-core on CPU (gloo): the fallbacks let GPTModel run, and TP=2 computes what TP=1 computes."""
import pytest
import torch

from hybridflow.engines import megatron_model as mm
from hybridflow.engines.megatron_check import SEQ, VOCAB, loss_and_grads


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


@pytest.mark.slow
def test_tensor_parallel_two_matches_one(tmp_path):
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    ref = str(tmp_path / "reference.pt")
    one = loss_and_grads(1, ref, tokens)
    two = loss_and_grads(2, ref, tokens)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in one["grads"].values())
