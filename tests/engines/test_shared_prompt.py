"""Shared-prompt packing (issue 28) changes how a group's rows are computed, never what: the log-probs, entropy, a
policy loss and its gradients of rows that share a prompt run as one sequence equal those of the rows run one by
one, in float64 on a real tiny HF model, including the prompt's last logit that predicts each response's first
token; a mask loosened by one position breaks the equality. Real FSDP2 on a one-rank gloo group for the engine.
Also here: a critic's value head computes the same values in training as when it scored the batch (no dropout)."""
from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch

from hybridflow.api import TinyModel
from hybridflow.data.packing import computed_tokens, micro_batches, pack_rollout, prompt_groups, slots_per_sequence
from hybridflow import logs
from hybridflow.engines.train.fsdp import FSDPEngine, response_outputs
from hybridflow.engines.train.shared_prompt import can_share, packed_outputs, shared_layout
from hybridflow.models.builders import tiny_config
from hybridflow.roles.critic import response_values
from hybridflow.single_controller.batch import Batch
from support.gradients import gradients_at_step

P, R = 6, 5
A, B, C = [3, 4, 5], [6, 7, 8, 9, 10, 11], [12]
# Rows out of group order (sharing finds a prompt's rows wherever they are), groups of 3, 2 and 1 rows; responses of
# 1 to 5 tokens, one multi-turn (tokens 20-21 an environment's answer, out of the loss mask, still attended to).
PROMPTS = [A, B, A, C, B, A]
RESPONSES = [[13, 14, 15, 16, 17], [18], [19, 20, 21, 22], [23, 24], [25, 26, 27], [28, 29]]
LOSS_MASKS = [[1] * 5, [1], [1, 0, 0, 1], [1, 1], [1, 1, 1], [1, 1]]


def _batch() -> Batch:
    b = Batch(pack_rollout(PROMPTS, RESPONSES, P, R, LOSS_MASKS))
    return b.with_columns(advantages=torch.linspace(-1.0, 1.0, len(b), dtype=torch.float64)[:, None]
                          * b["response_mask"])


def _model(attn: str, head: str = "lm", seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    torch.manual_seed(seed)
    config = tiny_config(TinyModel(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2))
    config._attn_implementation = attn
    if head == "value":
        config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(config, dtype=torch.float64)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    for m in model.modules():  # HF's RMSNorm computes in float32; float64 throughout, or its rounding hides 1e-7
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(_rms_norm_float64, m)
    return model.eval()  # no dropout (a token classifier's head has some)


def _rms_norm_float64(self, x: torch.Tensor) -> torch.Tensor:
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def _real(batch: Batch) -> torch.Tensor:
    return batch["attention_mask"][:, P:].bool()  # response positions with a token: the outputs anything reads


def _log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """token_log_probs and entropy_from_logits in float64 (the job's own take the log-softmax in float32, whose
    rounding would hide a difference of 1e-7)."""
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def _loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """A GRPO-style surrogate plus an entropy bonus over the loss mask: every output of every real token counts."""
    mask = batch["response_mask"].double()
    logp = _log_probs(logits, batch["responses"])
    return -(logp * batch["advantages"] * mask).sum() - 0.01 * (_entropy(logits) * mask).sum()


def test_a_group_run_as_one_sequence_gives_the_unshared_log_probs_entropy_loss_and_gradients():
    batch, model = _batch(), _model("sdpa")
    packed = shared_layout(batch)
    assert packed is not None and packed.input_ids.shape == (3, P + 3 * R)  # three prompts, at most three slots
    assert packed.input_ids.numel() < batch["input_ids"].numel()

    outs, grads = {}, {}
    for shared in (False, True):
        model.zero_grad()
        logits = response_outputs(model, batch, shared)
        _loss(logits, batch).backward()
        outs[shared] = logits
        grads[shared] = {n: p.grad.clone() for n, p in model.named_parameters()}
    real = _real(batch)
    unshared, packed_logits = outs[False][real], outs[True][real]
    torch.testing.assert_close(packed_logits, unshared, rtol=0, atol=1e-12)
    first = outs[True][:, 0]  # the prompt's last position, read by each of its responses
    torch.testing.assert_close(first, outs[False][:, 0], rtol=0, atol=1e-12)
    assert torch.equal(first[0], first[2]) and torch.equal(first[0], first[5])  # computed once for prompt A
    lp = {s: _log_probs(o, batch["responses"])[real] for s, o in outs.items()}
    torch.testing.assert_close(lp[True], lp[False], rtol=0, atol=1e-12)
    ent = {s: _entropy(o)[real] for s, o in outs.items()}
    torch.testing.assert_close(ent[True], ent[False], rtol=0, atol=1e-12)
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=0, atol=1e-10, msg=name)
    assert grads[False]["model.embed_tokens.weight"][A].abs().sum() > 0  # the prompt's tokens got gradient


def test_eager_attention_takes_the_mask_as_an_additive_one():
    """Against the same weights under sdpa: HF's own eager path turns float64's mask minimum into -inf in its float32
    softmax, and left-padded rows come out NaN; the packed mask gives every position itself to attend to."""
    batch, real = _batch(), _real(batch := _batch())
    with torch.no_grad():
        eager = response_outputs(_model("eager"), batch, shared=True)[real]
        reference = response_outputs(_model("sdpa"), batch, shared=False)[real]
    torch.testing.assert_close(eager, reference, rtol=0, atol=1e-6)  # eager's softmax is float32


def test_a_mask_loosened_by_one_position_breaks_the_equality():
    batch, model = _batch(), _model("sdpa")
    packed = shared_layout(batch)
    with torch.no_grad():
        unshared = response_outputs(model, batch, shared=False)
        assert torch.allclose(packed_outputs(model, packed)[_real(batch)], unshared[_real(batch)], atol=1e-12)
        # prompt A's second response (row 2, slot 1) may now see the first token of its first response (slot 0)
        loose = packed.allowed.clone()
        slot0, slot1 = P, P + R
        assert not loose[0, 0, slot1, slot0]
        loose[0, 0, slot1:slot1 + R, slot0] = True
        out = packed_outputs(model, dataclasses.replace(packed, allowed=loose))
    real = _real(batch)
    differs = ((out - unshared).abs().amax(-1) > 1e-6) & real
    assert differs[2, 1:4].all()  # every token of that response after its first changed
    assert not differs[[0, 1, 3, 4, 5]].any()  # the rest did not


def test_a_critics_values_over_packed_groups_equal_the_unshared_ones():
    batch, model = _batch(), _model("sdpa", head="value")
    real = _real(batch)
    torch.testing.assert_close(response_values(model, batch, shared=True)[real],
                               response_values(model, batch, shared=False)[real], rtol=0, atol=1e-12)


def test_a_value_head_has_no_dropout_so_training_sees_the_values_it_computed(tmp_path):
    from hybridflow.engines.train.fsdp import load_hf_model
    from hybridflow.models.builders import build_tiny

    critic = load_hf_model(build_tiny(TinyModel(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                                                num_heads=2, num_kv_heads=1), tmp_path, 0), "float32", "value")
    batch = _batch()
    with torch.no_grad():
        computed = response_values(critic.eval(), batch)
        training = response_values(critic.train(), batch)
    assert torch.equal(training, computed)


def test_shared_micro_batches_keep_a_prompts_rows_together_within_the_token_budget():
    batch = _batch()
    parts = micro_batches(batch, 2, dynamic=True, shared=True)
    assert sorted(i for rows, _ in parts for i in rows) == list(range(len(batch)))
    where = {i: n for n, (rows, _) in enumerate(parts) for i in rows}
    for group in prompt_groups(batch):
        assert len({where[i] for i in group}) == 1, f"rows {group} of one prompt split over micro-batches"
    budget = 2 * (P + R)
    for rows, mb in parts:
        packed = shared_layout(mb)
        tokens = packed.input_ids.numel() if packed is not None else mb["input_ids"].numel()
        assert tokens <= budget or len(prompt_groups(mb)) == 1  # one group alone may exceed it, as one row may
    tokens = sum(p.input_ids.numel() if (p := shared_layout(mb)) is not None else mb["input_ids"].numel()
                 for _, mb in parts)
    assert tokens < sum(mb["input_ids"].numel() for _, mb in micro_batches(batch, 2, dynamic=True, shared=False))


def test_flops_count_a_shared_prompt_once():
    batch = _batch()
    responses = sum(len(r) for r in RESPONSES)
    assert computed_tokens(batch, shared=False) == sum(len(p) for p in PROMPTS) + responses
    assert computed_tokens(batch, shared=True) == len(A) + len(B) + len(C) + responses


def test_a_prompt_with_many_long_responses_is_cut_into_sequences_whose_attention_stays_bounded():
    assert slots_per_sequence(44, 32) >= 4  # the bench's GRPO job: a whole group of four shares its prompt
    k = slots_per_sequence(512, 2048)
    assert 1 <= k <= 2 and (512 + k * 2048) ** 2 <= 2 * k * (512 + 2048) ** 2
    many = Batch(pack_rollout([A] * 40, [[13, 14, 15, 16, 17]] * 40, P, R))
    groups = prompt_groups(many)
    assert sum(len(g) for g in groups) == 40 and max(len(g) for g in groups) == slots_per_sequence(P, R) < 40


def test_an_attention_backend_without_custom_masks_runs_unshared_and_says_why_once(caplog):
    gpu_only = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    logs._said.clear()
    with caplog.at_level(logging.WARNING, logger="hybridflow.engines.train.shared_prompt"):
        assert not can_share(gpu_only) and not can_share(gpu_only)
    assert [r.getMessage() for r in caplog.records if "flash_attention_2" in r.getMessage()] == [
        "shared-prompt packing is off: the model's attention implementation 'flash_attention_2' takes no custom mask "
        "(it works with sdpa or hybridflow_cpu_sdpa or eager); rows of a group run unshared"]
    assert can_share(_model("sdpa"))


def test_the_fsdp_engine_takes_the_same_step_with_shared_prompts(one_rank, monkeypatch):
    """The wiring: micro-batches of whole groups, packed in the engine's log-probs (float32 log-softmax, as the job
    computes it; the float64 equality is the model-level test's)."""
    from hybridflow.engines.train import fsdp

    batch = _batch()
    packed_calls = []
    monkeypatch.setattr(fsdp, "packed_outputs", lambda *a, **k: packed_calls.append(1) or packed_outputs(*a, **k))

    def loss_fn(model, mb):
        logp, _ = engine.log_probs(model, mb, 1.0)
        loss = -(logp.double() * mb["advantages"] * mb["response_mask"]).sum() / mb["response_mask"].sum()
        return loss, {"loss": loss.item()}

    after, stats = {}, {}
    for shared in (False, True):
        engine = FSDPEngine(_model("sdpa"), 1e-2, 1e9, "cpu", compute_dtype=torch.float64, dynamic_batch_size=True,
                            shared_prompt=shared)
        with gradients_at_step(engine.optimizer, engine.module.named_parameters) as after[shared]:  # Adam's first step
            stats[shared] = engine.train_mini_batch(batch, 2, loss_fn, per="tokens")
        assert not engine.sharded  # one rank computing in its weights' dtype: a plain module, its gradients whole
        # is lr x sign(g): a float32-rounding-sized gradient would flip it, so the gradients are what is compared
        assert bool(packed_calls) == shared
    assert stats[True]["loss"] == pytest.approx(stats[False]["loss"], rel=1e-6)
    assert stats[True]["grad_norm"] == pytest.approx(stats[False]["grad_norm"], rel=1e-6)
    for name, p in after[False].items():
        torch.testing.assert_close(after[True][name], p, rtol=1e-5, atol=1e-8, msg=name)
