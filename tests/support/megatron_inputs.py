"""Inputs of the megatron engine's CPU tests: small HF models of the two architectures the conversion takes (Qwen2:
tied embeddings, QKV bias; Llama: untied, no bias) with every weight randomised, and a four-row left-padded batch.
Shared by tests/engines/test_megatron.py and tests/checkpoint/test_megatron_checkpoint.py (and the processes they start)."""
import torch


def hf_model(arch: str, seed: int = 0):
    """A small Qwen2 (tied, QKV bias) or Llama (untied, no bias) with every weight, bias and norm randomised."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, dtype="float32")
    cfg = Qwen2Config(tie_word_embeddings=True, **common) if arch == "qwen2" else LlamaConfig(
        tie_word_embeddings=False, rope_theta=5000.0, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def tiny_batch() -> dict[str, torch.Tensor]:
    """Four rows: left-padded prompts of different lengths, then 4 response tokens."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 32, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 1, 3)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, -4:].clone()}
