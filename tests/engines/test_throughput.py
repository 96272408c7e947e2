"""The throughput optimisations (issue 14) change how the work is done, never its result: padding-free micro-batches
give the same outputs as fixed-width ones, an on-policy update without the separate old-log-prob pass makes the same
step as one with it, bf16 compute keeps fp32 master weights and optimizer state. Real FSDP2 on a one-rank gloo group,
real tiny HF models; the speed itself is measured by bench/throughput.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.capacity import kv_cache_bytes
from hybridflow.single_controller.context import WorkerContext
from hybridflow.data.packing import (
    merge_rows,
    micro_batches,
    to_count,
    token_budget_groups,
    trim_padding,
)
from hybridflow.engines.train.fsdp import FSDPEngine, load_causal_lm, response_logits, token_log_probs
from hybridflow.engines.precision import compute_dtype
from hybridflow.flops import forward_flops, matmul_peak_flops, training_flops
from hybridflow.roles.config import actor_config, old_log_probs_from_update
from hybridflow.api import Algorithm, Training, parse_job
from support.paths import TESTS
from support.tiny_actor import PROMPTS, RESPONSES, P, R, masked_log_probs, ragged_batch

def test_trim_padding_keeps_every_real_token_and_drops_only_padding():
    b = ragged_batch().index(torch.tensor([2, 4, 6]))  # prompts of 1, 4, 1 tokens; responses of 2, 1, 2
    t = trim_padding(b)
    assert t["prompts"].shape[1] == 4 and t["responses"].shape[1] == 2
    assert t["input_ids"].shape[1] == 6 and t["advantages"].shape == (3, 2)
    assert t["attention_mask"].sum() == b["attention_mask"].sum()  # no real token lost
    assert t["input_ids"][t["attention_mask"].bool()].tolist() == b["input_ids"][b["attention_mask"].bool()].tolist()


def test_token_budget_groups_cover_every_row_once_within_the_budget():
    p_lens = [len(p) for p in PROMPTS]
    r_lens = [len(r) for r in RESPONSES]
    budget = 3 * (P + R)
    groups = token_budget_groups(p_lens, r_lens, max_rows=8, budget=budget)
    assert sorted(i for g in groups for i in g) == list(range(8))
    for g in groups:
        assert len(g) * (max(p_lens[i] for i in g) + max(r_lens[i] for i in g)) <= budget
    assert max(len(g) for g in groups) > 3  # short rows travel in larger micro-batches than fixed 3-row ones


def test_micro_batches_pad_less_and_merge_rows_restores_order():
    b = ragged_batch()
    fixed = micro_batches(b, 3, dynamic=False)
    dyn = micro_batches(b, 3, dynamic=True)
    padded = lambda parts: sum(mb["input_ids"].numel() for _, mb in parts)  # noqa: E731
    assert padded(dyn) < 0.75 * padded(fixed)  # 78 of 112 token slots
    rows = [idx for idx, _ in dyn]
    out = merge_rows([mb["responses"] for _, mb in dyn], rows, R)
    assert torch.equal(out, b["responses"])


def test_dynamic_micro_batches_give_the_same_log_probs_as_fixed_ones(one_rank, tiny_dir):
    engine = FSDPEngine(load_causal_lm(tiny_dir, "float32"), 1e-3, 1.0, "cpu", compute_dtype=torch.float32)
    fixed = masked_log_probs(engine, ragged_batch(), 3)
    engine.dynamic_batch_size = True
    torch.testing.assert_close(masked_log_probs(engine, ragged_batch(), 3), fixed, atol=1e-5, rtol=1e-5)


def test_bf16_compute_keeps_fp32_master_weights_and_optimizer_state(one_rank, tiny_dir):
    fp32 = FSDPEngine(load_causal_lm(tiny_dir, "float32"), 1e-3, 1.0, "cpu", compute_dtype=torch.float32)
    bf16 = FSDPEngine(load_causal_lm(tiny_dir, "float32"), 1e-3, 1.0, "cpu", compute_dtype=torch.bfloat16)
    seen = []
    bf16.module.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ref, low = masked_log_probs(fp32, ragged_batch(), 8), masked_log_probs(bf16, ragged_batch(), 8)
    assert seen == [torch.bfloat16]
    assert 0 < (ref - low).abs().max() < 0.1  # computed in bf16: close to fp32, not equal

    def loss_fn(model, mb):
        lp = token_log_probs(response_logits(model, mb, 1.0), mb["responses"])
        return -(lp * mb["advantages"]).sum() / mb["response_mask"].sum(), {}

    before = {n: p.clone() for n, p in bf16.full_params()}
    assert all(p.dtype == torch.float32 for p in before.values())  # FSDP kept the root gathered in bf16 after a forward
    bf16.train_mini_batch(ragged_batch(), 8, loss_fn)
    assert all(p.dtype == torch.float32 for p in bf16.module.parameters())
    assert all(p.dtype == torch.float32 for _, p in bf16.full_params())  # what generation and checkpoints get
    state = [s for s in bf16.optimizer.state.values()]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state)
    moved = [n for n, p in bf16.full_params() if not torch.equal(p, before[n])]
    assert moved, "the fp32 masters took no step"


def test_on_policy_is_one_epoch_one_mini_batch_and_no_kl_in_the_reward():
    t, a = Training(), Algorithm()
    assert old_log_probs_from_update(t, a, 16)
    assert not old_log_probs_from_update(t.model_copy(update={"ppo_epochs": 2}), a, 16)
    assert not old_log_probs_from_update(t.model_copy(update={"mini_batch_size": 8}), a, 16)
    assert old_log_probs_from_update(t.model_copy(update={"mini_batch_size": 16}), a, 16)
    assert not old_log_probs_from_update(t, a.model_copy(update={"kl_in": "reward", "kl_coef": 0.1}), 16)
    assert old_log_probs_from_update(t, a.model_copy(update={"kl_in": "loss", "kl_coef": 0.1}), 16)
    assert not old_log_probs_from_update(t.model_copy(update={"on_policy_old_log_probs": False}), a, 16)


def _actor(model_dir, **training):
    from hybridflow.roles.actor import ActorWorker

    job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                         "spec": {"rollout": {"engine": "hf", "maxPromptLength": P, "maxResponseLength": R},
                                  "training": {"microBatchSize": 3, "computeDtype": "float32", **training},
                                  "trainer": {"promptsPerStep": 8}}})
    return ActorWorker(WorkerContext(0, 1, 0, "cpu"), actor_config(job.spec), str(model_dir))


def test_an_on_policy_update_takes_the_same_step_as_one_after_a_separate_pass(one_rank, tiny_dir):
    batch = ragged_batch()
    batch.non_tensors["uid"] = np.arange(len(batch))
    two_pass = _actor(tiny_dir, onPolicyOldLogProbs=False)
    with_old = batch.union(two_pass.compute_log_prob(batch))
    stats_a = two_pass.update_actor(with_old)
    one_pass = _actor(tiny_dir)
    stats_b = one_pass.update_actor(batch)
    assert stats_b["pg_loss"] == pytest.approx(stats_a["pg_loss"], abs=1e-6)
    assert stats_b["entropy_mean"] == pytest.approx(float((with_old["entropy"] * batch["response_mask"]).sum()
                                                          / batch["response_mask"].sum()), rel=0.05)
    for (name, a), (_, b) in zip(two_pass.engine.full_params(), one_pass.engine.full_params()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="old_log_prob stage must run first"):
        _actor(tiny_dir, ppoEpochs=2).update_actor(batch)
    assert stats_b["mfu"] > 0 and stats_b["update_flops_per_s"] > 0


def test_compute_dtype_settings_and_flops():
    assert compute_dtype("float32", "cpu") is torch.float32
    assert compute_dtype("bfloat16", "cpu") is torch.bfloat16
    assert compute_dtype("auto", "cpu") in (torch.float32, torch.bfloat16)
    assert training_flops(10, 7) == 3 * forward_flops(10, 7) == 420
    assert training_flops(10, 7, trained=1) == (4 * 10 + 2 * 1) * 7  # LoRA: no weight gradients for the base
    # FLOP/s, not GFLOP/s: billions on any CPU, yet a 10 ms sample measured 8e7 on 2 cores at load 14
    assert matmul_peak_flops(torch.float32, size=128, seconds=0.01) > 1e6


def test_the_kv_cache_is_sized_from_the_job():
    """SmolLM2 (30 layers, 3 KV heads of 64) in bf16, 32 sequences of 80 tokens: three blocks of 32 each (vLLM's CPU
    block, set to the smallest its attention takes, so that prefix caching shares a short prompt)."""
    assert kv_cache_bytes(30, 3, 64, 2, sequences=32, max_len=80) == 32 * 96 * 2 * 30 * 3 * 64 * 2 == 70_778_880
    assert kv_cache_bytes(30, 3, 64, 2, sequences=32, max_len=97) == 32 * 128 * 2 * 30 * 3 * 64 * 2
    assert kv_cache_bytes(30, 3, 64, 2, sequences=32, max_len=80) < (1 << 30) / 5  # was a fixed 1 GiB


def test_micro_batches_weigh_by_what_the_loss_averages_over(one_rank, tiny_dir):
    """A token mean over the mini-batch, accumulated over length-sorted micro-batches of different token counts,
    is the same step as one micro-batch holding every row; weighed by rows it is not."""
    def token_mean_loss(model, mb):
        lp = token_log_probs(response_logits(model, mb, 1.0), mb["responses"])
        return -(lp * mb["advantages"] * mb["response_mask"]).sum() / mb["response_mask"].sum(), {}

    def step(micro: int, per: str) -> dict[str, torch.Tensor]:
        engine = FSDPEngine(load_causal_lm(tiny_dir, "float32"), 1e-2, 1e9, "cpu", compute_dtype=torch.float32,
                            dynamic_batch_size=True)
        engine.optimizer = torch.optim.SGD(engine.module.parameters(), lr=1.0)  # the step is the gradient
        engine.train_mini_batch(ragged_batch(), micro, token_mean_loss, per)
        return dict(engine.full_params())

    whole = step(8, "tokens")
    by_tokens, by_rows = step(3, "tokens"), step(3, "rows")
    for name, p in whole.items():
        torch.testing.assert_close(by_tokens[name], p, atol=1e-5, rtol=1e-4, msg=name)
    assert any(not torch.allclose(by_rows[n], p, atol=1e-5, rtol=1e-4) for n, p in whole.items())


def test_to_count_halves_the_largest_micro_batch_and_pads_with_rows_that_weigh_nothing():
    b = ragged_batch()
    split = micro_batches(b, 3, dynamic=True)
    more = to_count(split, len(split) + 2)
    assert len(more) == len(split) + 2
    assert sorted(i for idx, _ in more for i in idx) == list(range(len(b)))  # every row once, none padded yet
    for idx, mb in more:
        assert torch.equal(mb["responses"][:, :1], b["responses"][idx][:, :1])
    singles = [(idx, mb) for idx, mb in micro_batches(b, 1, dynamic=False)]
    padded = to_count(singles, len(singles) + 3)
    assert [idx for idx, _ in padded[-3:]] == [[], [], []] and all(len(mb) == 1 for _, mb in padded[-3:])
    with pytest.raises(ValueError, match="fewer"):
        to_count(split, len(split) - 1)


def test_extra_micro_batches_change_neither_the_outputs_nor_the_step(one_rank, tiny_dir, monkeypatch):
    """What a rank that cut fewer micro-batches than another does (FSDPEngine.micro_batch_count): the same
    log-probs and the same gradient step with its largest micro-batches halved and padding ones run."""
    def token_mean_loss(model, mb):
        lp = token_log_probs(response_logits(model, mb, 1.0), mb["responses"])
        return -(lp * mb["advantages"] * mb["response_mask"]).sum() / mb["response_mask"].sum(), {}

    def run(extra: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        engine = FSDPEngine(load_causal_lm(tiny_dir, "float32"), 1e-2, 1e9, "cpu", compute_dtype=torch.float32,
                            dynamic_batch_size=True)
        monkeypatch.setattr(engine, "micro_batch_count", lambda own: own + extra)
        engine.optimizer = torch.optim.SGD(engine.module.parameters(), lr=1.0)  # the step is the gradient
        logp = masked_log_probs(engine, ragged_batch(), 3)
        engine.train_mini_batch(ragged_batch(), 3, token_mean_loss, "tokens")
        return logp, dict(engine.full_params())

    (logp, params), (logp_more, params_more) = run(0), run(9)  # 9 more: every row alone, then padding
    torch.testing.assert_close(logp_more, logp, atol=1e-5, rtol=1e-5)
    for name, p in params.items():
        torch.testing.assert_close(params_more[name], p, atol=1e-5, rtol=1e-4, msg=name)


_UNEVEN_RANKS = """
import sys, torch, torch.distributed as dist
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from support.tiny_actor import masked_log_probs, ragged_batch
from hybridflow.engines.train.fsdp import FSDPEngine, load_causal_lm

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=2)
engine = FSDPEngine(load_causal_lm(Path(sys.argv[3]), "float32"), 1e-3, 1.0, "cpu", compute_dtype=torch.float32,
                    dynamic_batch_size=True)
rows = [0, 1, 2, 3, 4, 5, 6, 7] if rank == 0 else [2, 6, 2, 6, 2, 6, 2, 6]  # rank 1: short rows, fewer micro-batches
print(float(masked_log_probs(engine, ragged_batch().index(torch.tensor(rows)), 3).sum()), flush=True)
dist.destroy_process_group()
"""


def test_ranks_whose_rows_cut_into_different_micro_batch_counts_run_as_many_forwards(tmp_path, tiny_dir):
    """Two FSDP ranks: one's long rows cut into more dynamic micro-batches than the other's short ones. Each forward
    gathers every layer over both, so the rank with fewer used to leave the other waiting in a gather forever."""
    import subprocess
    import sys

    b = ragged_batch()
    assert len(micro_batches(b, 3, dynamic=True)) != len(micro_batches(b.index(torch.tensor([2, 6] * 4)), 3, True))
    tests = str(TESTS)
    procs = [subprocess.Popen([sys.executable, "-c", _UNEVEN_RANKS, str(r), str(tmp_path / "store"), str(tiny_dir),
                               tests], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert float(out.strip().splitlines()[-1]) < 0


_RELEASE_AND_RELOAD = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file
from hybridflow.engines.rollout.base import SamplingConfig
from hybridflow.engines.rollout.vllm import VLLMRollout
from hybridflow.roles.common import release_free_memory

def rss():
    release_free_memory()
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024

model_dir = Path(sys.argv[1])
engine = VLLMRollout(model_dir, max_model_len=64, dtype="bfloat16", seed=0, kv_cache_bytes=32 << 20,
                     gpu_memory_utilization=0.9, on_gpu=False)
cfg = SamplingConfig(max_tokens=12, greedy=True)
prompts = [[1, 9, 42, 7, 300], [5, 6, 7], [1000, 2000, 3000, 4000]] * 2
first = [g.tokens for g in engine.generate(prompts, [cfg] * len(prompts))]
rpc, calls = engine.llm.collective_rpc, []
def spy(method, *args, **kwargs):  # what goes through vLLM's public RPC (recorded, then let through)
    calls.append([method if isinstance(method, str) else method.__name__, sorted(kwargs.get("kwargs") or {})])
    return rpc(method, *args, **kwargs)
engine.llm.collective_rpc = spy
embed = engine.model.model.embed_tokens.weight
where = embed.data_ptr()
engine.load_weights((k, v.to(torch.bfloat16)) for k, v in load_file(str(model_dir / "model.safetensors")).items())
same_storage = embed.data_ptr() == where and engine.model.model.embed_tokens.weight is embed
weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
before = rss()
engine.release()
released = rss()
kv_left = sum(t.untyped_storage().nbytes() for t in rpc(lambda w: w.model_runner.kv_caches)[0])  # not spied
try:
    engine.generate(prompts, [cfg] * len(prompts))
    error = ""
except RuntimeError as e:
    error = str(e)

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

def cached(prompt, copies):  # prompt tokens each copy found in vLLM's prefix cache (one call: a GRPO group)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)] * copies,
                               SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
    return [o.num_cached_tokens for o in outs]

group = list(range(100, 140))  # 40 tokens: one whole block of 32 to share
engine.load_weights((k, v.to(torch.bfloat16)) for k, v in load_file(str(model_dir / "model.safetensors")).items())
in_group = cached(group, 4)
later = cached(group, 1)
again = [g.tokens for g in engine.generate(prompts, [cfg] * len(prompts))]
engine.release()
engine.load_weights((k, v.to(torch.bfloat16)) for k, v in load_file(str(model_dir / "model.safetensors")).items())
after_sync = cached(group, 1)
print(json.dumps({"freed": before - released, "weights": weights, "kv_left": kv_left, "error": error, "same": again == first, "in_group": in_group,
                  "later": later, "after_sync": after_sync, "calls": calls, "same_storage": same_storage}))
"""


@pytest.mark.slow  # a vLLM engine in a subprocess
def test_vllm_on_cpu_frees_its_weights_for_training_and_gets_them_back_with_the_next_sync_and_a_clear_cache(
        model_cache):
    """vLLM on CPU holds its weights as packed GEMMs (AVX-512) or as plain parameters its `linear` calls use (AVX2):
    release() drops either (SmolLM2 in bf16 is 0.27 GB of weights) and the KV cache, generation before the next
    load_weights is a clear error rather than stale output, and load_weights brings them back, so greedy output is
    what it was (after a release, generating in a KV cache that was freed and zeroed again). (On
    an AVX2 machine release() used to free nothing.) Every reload is vLLM's public collective_rpc("reload_weights")
    and, awake, writes into the storage vLLM allocated. In a child process: vLLM sets up its own torch.distributed
    state."""
    import json
    import subprocess
    import sys

    from hybridflow.models.builders import materialize
    from hybridflow.api import ModelSource

    model_dir = materialize(ModelSource(source="smollm2"), model_cache, 0)
    out = subprocess.run([sys.executable, "-c", _RELEASE_AND_RELOAD, str(model_dir)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # the weights and the KV cache (32 MiB here; the views vLLM's layers hold stay bound to its emptied storage)
    assert result["kv_left"] == 0, result
    assert result["freed"] > result["weights"] * 0.9 + (24 << 20), result
    assert "released for training" in result["error"]
    assert result["same"]
    # prefix caching (rollout.prefixCaching) in 32-token blocks: a group's samples share the prompt's whole block,
    # a later call finds it too, and a weight sync clears it (no KV of the old weights is reused)
    assert sorted(result["in_group"]) == [0, 32, 32, 32], result
    assert result["later"] == [32] and result["after_sync"] == [0], result
    # every reload went through vLLM's public RPC, the worker's reload_weights (in its config context; issue 50),
    # and wrote into the storage vLLM allocated (on a GPU: sleep mode's, and what CUDA graphs read)
    # (and each release reached the KV cache the same way)
    reload, kv = ["reload_weights", ["weights_iterator"]], ["_kv_caches_in_worker", []]
    assert result["calls"] == [reload, kv, reload, kv, reload], result["calls"]
    assert result["same_storage"]
