"""The real HF generation engine over a random one-layer Qwen2 with SmolLM2's vocabulary (its ids are the
tokenizer's, so that decoding and tokenizing again would not give them back), and a loop.Model over it that records
every engine call: what the endpoint tests (tests/agents/test_endpoint.py, test_program_pool.py) compare the trained
ids with."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def tiny_qwen2_engine(vocab_size: int, directory: Path) -> Any:
    """HFRollout over a random one-layer Qwen2 of `vocab_size` written to `directory` (seed 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hybridflow.engines.rollout.hf import HFRollout

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True, pad_token_id=0)
    Qwen2ForCausalLM(cfg).save_pretrained(directory)
    return HFRollout(directory, "float32", torch.device("cpu"), 0)


class RecordingEngine:
    """loop.Model over the real engine (sampled, with log-probs), recording each engine call: a list of its rows'
    (row, context, written ids)."""

    def __init__(self, engine: Any, eos: int) -> None:
        self.engine, self.eos, self.calls = engine, eos, []

    def generate(self, rows, contexts, max_tokens):
        from hybridflow.engines.rollout.base import SamplingConfig

        cfgs = [SamplingConfig(m, 1.0, 1.0, False, (self.eos,), True) for m in max_tokens]
        out = [(list(g.tokens), list(g.log_probs)) for g in self.engine.generate([list(c) for c in contexts], cfgs)]
        self.calls.append([(r, list(c), t) for r, c, (t, _) in zip(rows, contexts, out)])
        return out

    def rows(self) -> list[tuple[int, list[int], list[int]]]:
        """Every recorded row, call after call."""
        return [row for call in self.calls for row in call]
