"""The CPU attention a trained model runs in bf16 (engines.train.cpu_attention, spec.training.fp32AttentionBackward;
issue 57): torch's flash kernel forward in the compute dtype, its backward in fp32. It changes how precisely the
gradients are computed, never what: in float64 on a real tiny HF model (grouped-query heads, left padding, the
shared-prompt mask, and plain causal rows without a mask) the log-probs, loss and gradients equal sdpa's; in bf16 the
forward is sdpa's to the bit and every gradient is closer to float64's than sdpa's own bf16 backward; without a
gradient wanted it is sdpa. The switch's rule, the engine that applies it, and the spec rule for megatron."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from hybridflow.api import SpecError, TinyModel, parse_job
from hybridflow.api.training import fp32_attention_backward_on
from hybridflow.data.packing import pack_rollout
from hybridflow.engines.train import cpu_attention
from hybridflow.engines.train.base import TrainSettings
from hybridflow.engines.train.fsdp import build, response_outputs
from hybridflow.engines.train.shared_prompt import attention_allowed
from hybridflow.models.builders import tiny_config
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.context import WorkerContext

P, R = 6, 5
PADDED = ([[3, 4, 5], [6, 7, 8, 9, 10, 11], [3, 4, 5], [12]], [[13, 14, 15, 16, 17], [18], [19, 20], [23, 24]])
FULL = ([[3, 4, 5, 6, 7, 8]] * 2 + [[9, 10, 11, 12, 13, 14]], [[13, 14, 15, 16, 17]] * 3)  # no padding: no mask


def _model(attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(TinyModel(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    model.set_attn_implementation(attn)
    return model


def _step(attn: str, rows: tuple, shared: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _model(cpu_attention.register() if attn == "ours" else attn)
    batch = Batch(pack_rollout(*rows, P, R))
    logits = response_outputs(model, batch, shared)
    logp = torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].double()
    loss = -(logp * torch.linspace(-1, 1, len(batch), dtype=torch.float64)[:, None] * mask).sum()
    assert ("FlashWithWideBackwardBackward" in _graph(loss.grad_fn)) == (attn == "ours")  # the model ran it
    loss.backward()
    return logp * mask, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("rows,shared", [(PADDED, True), (PADDED, False), (FULL, False)],
                         ids=["shared-prompt mask", "left padding", "causal, no mask"])
def test_in_float64_a_step_computes_what_sdpa_computes(rows, shared):
    logp, grads = _step("ours", rows, shared)
    ref_logp, ref_grads = _step("sdpa", rows, shared)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-10, msg=name)


def _attention_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(query, key, value) of 2 sequences x 4 heads (2 key/value heads) x 40 positions x 16, and the shared-prompt
    mask of a 10-token prompt with three 10-token slots, the second sequence's last slot padding."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64) for _ in range(2))
    real = torch.ones(2, 40, dtype=torch.bool)
    real[1, 30:] = False
    allowed = attention_allowed(real, torch.arange(40) // 10)
    return (*(t.to(dtype).requires_grad_() for t in (q, k, v)), allowed)


class _Heads(torch.nn.Module):
    num_key_value_groups, is_causal = 2, True


def _run(fn, dtype: torch.dtype) -> list[torch.Tensor]:
    q, k, v, allowed = _attention_inputs(dtype)
    out = fn(q, k, v, allowed)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def _ours(q, k, v, allowed):
    return cpu_attention.attention(_Heads(), q, k, v, allowed, scaling=0.25)[0]


def _sdpa(q, k, v, allowed):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.25, enable_gqa=True).transpose(1, 2)


def test_in_bf16_the_forward_is_sdpas_and_every_gradient_is_closer_to_float64s():
    ours, sdpa, exact = _run(_ours, torch.bfloat16), _run(_sdpa, torch.bfloat16), _run(_sdpa, torch.float64)
    assert torch.equal(ours[0], sdpa[0])  # the same kernel, the same mask: the same bf16 output
    for name, o, s, e in zip(("query", "key", "value"), ours[1:], sdpa[1:], exact[1:]):
        err_ours, err_sdpa = (o.double() - e).abs().max(), (s.double() - e).abs().max()
        assert err_ours < err_sdpa, f"{name}: {err_ours:.3g} against sdpa's bf16 {err_sdpa:.3g}"


def test_without_a_gradient_wanted_it_is_sdpa():
    q, k, v, allowed = _attention_inputs(torch.bfloat16)
    with torch.no_grad():
        out = _ours(q, k, v, allowed)
        assert torch.equal(out, _sdpa(q, k, v, allowed))
    assert out.grad_fn is None
    assert "FlashWithWideBackwardBackward" in _graph(_ours(q, k, v, allowed).grad_fn)
    narrow_v = v[..., :8].detach().requires_grad_()  # latent attention's shapes: the flash kernel refuses them
    assert "FlashWithWideBackwardBackward" not in _graph(_ours(q, k, narrow_v, allowed).grad_fn)


def _graph(fn) -> set[str]:
    """The names of the autograd nodes behind `fn`."""
    seen, todo = {}, [fn]
    while todo:
        node = todo.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = type(node).__name__
            todo += [n for n, _ in node.next_functions]
    return set(seen.values())


def test_auto_is_on_for_cpus_computing_in_bf16():
    assert fp32_attention_backward_on("auto", "cpu", "bfloat16")
    assert not fp32_attention_backward_on("auto", "cpu", "float32")  # the kernel's fp32 backward already
    assert not fp32_attention_backward_on("auto", "gpu", "bfloat16")  # GPU kernels are native
    assert fp32_attention_backward_on("on", "cpu", "float32")
    assert not fp32_attention_backward_on("off", "cpu", "bfloat16")


@pytest.mark.parametrize("compute,trainable,switch,expected", [
    ("bfloat16", True, "auto", cpu_attention.ATTENTION), ("float32", True, "auto", "sdpa"),
    ("bfloat16", False, "auto", "sdpa"), ("bfloat16", True, "off", "sdpa")])
def test_the_fsdp_engine_trains_with_it_where_the_switch_is_on(one_rank, tiny_dir, compute, trainable, switch,
                                                              expected):
    engine = build(WorkerContext(0, 1, 0, "cpu"), TrainSettings(
        tiny_dir, "float32", lr=1e-3, trainable=trainable, compute_dtype=compute, fp32_attention_backward=switch))
    assert engine.module.config._attn_implementation == expected


def test_only_a_model_running_sdpa_through_hfs_registry_is_switched():
    own_code = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="sdpa", model_type="llama"))
    assert not cpu_attention.adopt(own_code) and own_code.config._attn_implementation == "sdpa"  # no registry flag
    other = _model("sdpa")
    other.config.model_type = "deepseek_v3"  # latent attention: value heads narrower than the query's
    assert not cpu_attention.adopt(other) and other.config._attn_implementation == "sdpa"
    eager = _model("eager")
    assert not cpu_attention.adopt(eager) and eager.config._attn_implementation == "eager"
    sdpa = _model("sdpa")
    assert cpu_attention.adopt(sdpa) and sdpa.config._attn_implementation == cpu_attention.ATTENTION


def test_on_with_the_megatron_engine_is_refused():
    doc = {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
           "spec": {"training": {"engine": "megatron", "fp32AttentionBackward": "on"}}}
    with pytest.raises(SpecError, match=r'spec.training.fp32AttentionBackward: "on" does nothing with the megatron '
                                        r'engine, which runs an attention of its own, not HF\'s'):
        parse_job(doc)
    doc["spec"]["training"]["fp32AttentionBackward"] = "auto"
    parse_job(doc)
