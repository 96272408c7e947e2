"""LoRA training on the FSDP engine (spec.training.lora, models.lora): adapters injected before sharding into the
tiny model built on the meta device, trained alone on a frozen base; the reference policy is the same model with
its adapters off; checkpoints hold the adapters alone; a weight sync moves the adapters alone, and the whole-weight
view is the base merged with them, as PEFT merges. One gloo rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.rank_process import run_rank
from support.tiny_actor import P, R, masked_log_probs, ragged_batch, ragged_batch_with_uids

from hybridflow.api import parse_job
from hybridflow.models import lora
from hybridflow.models.lora import LoraSettings
from hybridflow.engines.train.base import TrainSettings
from hybridflow.engines.train.fsdp import FSDPEngine, build, token_log_probs, response_logits
from hybridflow.single_controller.context import WorkerContext

CPU = WorkerContext(0, 1, 0, "cpu")
SETTINGS = LoraSettings(rank=4, alpha=8.0)
ADAPTED = 2 * 7  # the tiny model's 2 layers x every attention and MLP projection (the family's default targets)


def _engine(model_dir, adapters: LoraSettings | None = SETTINGS, trainable: bool = True) -> FSDPEngine:
    return build(CPU, TrainSettings(model_dir, "float32", lr=1e-2, compute_dtype="float32", trainable=trainable,
                                    lora=adapters))


def _loss(model, mb):
    """A policy-gradient-like loss over the ragged batch's advantages: moves every adapter."""
    logp = token_log_probs(response_logits(model, mb, 1.0), mb["responses"])
    return -(logp * mb["advantages"]).sum() / mb["response_mask"].sum(), {}


def _update(engine: FSDPEngine) -> None:
    engine.train_mini_batch(ragged_batch(), 3, _loss)


def _base(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.gathered() if not lora.is_adapter(n)}


def _adapters(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.gathered(adapters_only=True)}


@pytest.mark.parametrize("load", ["meta", "whole"])
def test_a_fresh_lora_engine_scores_exactly_as_its_base_with_peft_initialised_adapters(one_rank, tiny_dir, load,
                                                                                       monkeypatch):
    """Built on the meta device and filled from the safetensors shards, or (a .bin checkpoint) loaded whole and
    adapted by PEFT itself: the same base, adapters that start at zero."""
    from hybridflow.engines.train import fsdp

    plain = _engine(tiny_dir, None, trainable=False)
    if load == "whole":
        monkeypatch.setattr(fsdp, "safetensors_keys", lambda model_dir: None)
    adapted = _engine(tiny_dir)
    batch = ragged_batch()
    assert torch.equal(masked_log_probs(adapted, batch, 3), masked_log_probs(plain, batch, 3))
    adapters = _adapters(adapted)
    assert len(adapters) == 2 * ADAPTED
    for name, t in adapters.items():  # lora_B zero: the adapted model starts as the base; lora_A kaiming-uniform
        assert t.dtype == torch.float32
        if ".lora_B." in name:
            assert not t.any(), name
        else:
            bound = 1 / t.shape[1] ** 0.5  # kaiming_uniform(a=sqrt(5)) over fan_in
            assert t.abs().max() <= bound and t.std() > bound / 4, name
    base = {lora.hf_name(n): t for n, t in _base(adapted).items()}
    whole = dict(plain.full_params())
    assert set(base) == set(whole) and all(torch.equal(base[n], t) for n, t in whole.items())  # the files', all


def test_an_update_moves_the_adapters_alone_and_the_reference_stays_the_base(one_rank, tiny_dir):
    plain, engine = _engine(tiny_dir, None, trainable=False), _engine(tiny_dir)
    batch = ragged_batch()
    base_logp = masked_log_probs(plain, batch, 3)
    with lora.adapters_disabled(engine.module):  # the first forward, adapters off (PEFT clears their requires_grad)
        assert torch.equal(masked_log_probs(engine, batch, 3), base_logp)
    base, adapters = _base(engine), _adapters(engine)

    _update(engine)

    assert all(torch.equal(t, base[n]) for n, t in _base(engine).items())  # bit for bit
    moved = _adapters(engine)
    assert all(not torch.equal(t, adapters[n]) for n, t in moved.items() if ".lora_B." in n)
    assert not torch.allclose(masked_log_probs(engine, batch, 3), base_logp)
    with lora.adapters_disabled(engine.module):
        assert torch.equal(masked_log_probs(engine, batch, 3), base_logp)
    trained = {id(p) for p in engine.optimizer.state}
    names = {n for n, p in engine.module.named_parameters() if id(p) in trained}
    assert names == set(adapters)  # moments for the adapters alone
    # the update's weight gradients are the adapters' alone (training_flops' `trained`); full fine-tuning: all of them
    assert engine.num_trained_parameters() == sum(t.numel() for t in adapters.values()) < engine.num_parameters()
    assert plain.num_trained_parameters() == plain.num_parameters()


def test_checkpoints_hold_the_adapters_and_their_moments_and_restore_the_policy(one_rank, tiny_dir, tmp_path):
    engine = _engine(tiny_dir)
    _update(engine)
    batch = ragged_batch()
    want = masked_log_probs(engine, batch, 3)
    state = engine.checkpoint_state()
    assert set(state["model"]) == set(_adapters(engine))
    assert set(state["optimizer"]["state"]) == set(state["model"])
    dcp.save(state, checkpoint_id=str(tmp_path / "sharded"))
    full = engine.state_dict()
    assert set(full["model"]) == set(state["model"])

    fresh = _engine(tiny_dir)
    template = fresh.checkpoint_state()
    dcp.load(template, checkpoint_id=str(tmp_path / "sharded"))
    fresh.load_checkpoint_state(template)
    assert torch.equal(masked_log_probs(fresh, batch, 3), want)
    assert torch.equal(fresh.optimizer.state_dict()["state"][0]["exp_avg"],
                       engine.optimizer.state_dict()["state"][0]["exp_avg"])

    other = _engine(tiny_dir)
    other.load_state_dict(full)
    assert torch.equal(masked_log_probs(other, batch, 3), want)


def test_a_sync_moves_the_adapters_alone_and_full_params_is_the_base_merged_as_peft_merges(one_rank, tiny_dir):
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_dir)
    _update(engine)
    synced = dict(engine.sync_params())
    assert set(synced) == set(_adapters(engine))
    assert sum(t.numel() * t.element_size() for t in synced.values()) == 4 * sum(
        p.numel() for n, p in engine.module.named_parameters() if lora.is_adapter(n))

    hf = lora.inject(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), SETTINGS)
    assert not hf.load_state_dict(synced, strict=False).unexpected_keys
    for layer in lora.adapter_layers(hf):
        layer.merge()
    merged = {lora.hf_name(n): t.detach() for n, t in hf.named_parameters() if not lora.is_adapter(n)}
    whole = dict(engine.full_params())
    assert set(whole) == set(merged) and not any(".base_layer." in n for n in whole)
    for name, t in whole.items():
        torch.testing.assert_close(t, merged[name], rtol=0, atol=1e-7, msg=name)
    adapted = {n: t for n, t in _base(engine).items() if ".base_layer.weight" in n}
    assert len(adapted) == ADAPTED and all(not torch.equal(whole[lora.hf_name(n)], t) for n, t in adapted.items())


def _lora_actor(model_dir):
    """The actor worker with spec.training.lora on one rank (support.tiny_actor.one_rank_actor's job, plus LoRA)."""
    from hybridflow.roles.actor import ActorWorker
    from hybridflow.roles.config import actor_config

    job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                     "spec": {"algorithm": {"lossAgg": "token-mean"},
                              "rollout": {"engine": "hf", "maxPromptLength": P, "maxResponseLength": R},
                              "training": {"microBatchSize": 3, "computeDtype": "float32", "actorLr": 1e-2,
                                           "lora": {"rank": 4, "alpha": 8}},
                              "trainer": {"promptsPerStep": 8}}})
    return ActorWorker(CPU, actor_config(job.spec), str(model_dir))


def test_a_lora_actor_answers_the_reference_stage_with_its_base(one_rank, tiny_dir):
    actor = _lora_actor(tiny_dir)
    assert actor.engine.lora == SETTINGS
    plain = _engine(tiny_dir, None, trainable=False)
    batch = ragged_batch_with_uids()
    ref = actor.compute_ref_log_prob(batch)["ref_log_probs"] * batch["response_mask"]
    torch.testing.assert_close(ref, masked_log_probs(plain, batch, 3))  # the actor cuts micro-batches by length
    old = actor.compute_log_prob(batch)["old_log_probs"]
    stats = actor.update_actor(batch.with_columns(old_log_probs=old))
    assert stats["grad_norm"] > 0
    after = actor.compute_ref_log_prob(batch)["ref_log_probs"] * batch["response_mask"]
    assert torch.equal(after, ref)
    assert not torch.allclose(actor.compute_log_prob(batch)["old_log_probs"] * batch["response_mask"], ref)


def test_the_actor_without_lora_refuses_the_reference_stage(one_rank, tiny_dir):
    from support.tiny_actor import one_rank_actor

    with pytest.raises(ValueError, match="spec.training.lora"):
        one_rank_actor(tiny_dir, {}).compute_ref_log_prob(ragged_batch_with_uids())


@pytest.mark.parametrize("reference_first", [False, True])
def test_computing_in_bf16_the_frozen_base_is_held_in_bf16_and_the_adapters_train_in_fp32(one_rank, tiny_dir,
                                                                                          reference_first):
    """No fp32 master of a weight nothing steps; FSDP2 gathers the fp32 adapters and the bf16 base alike in bf16.
    `reference_first`: the engine's first forward is the reference's, adapters off (a default GRPO step's order:
    the update makes its own old log-probs), and the update after it still trains the fp32 adapters."""
    engine = build(CPU, TrainSettings(tiny_dir, "float32", lr=1e-2, compute_dtype="bfloat16", lora=SETTINGS))
    assert engine.compute_dtype == torch.bfloat16
    if reference_first:
        with lora.adapters_disabled(engine.module):
            masked_log_probs(engine, ragged_batch(), 3)
    dtypes = {n: p.dtype for n, p in engine.module.named_parameters()}
    assert {d for n, d in dtypes.items() if lora.is_adapter(n)} == {torch.float32}
    assert {d for n, d in dtypes.items() if not lora.is_adapter(n)} == {torch.bfloat16}
    base, adapters = _base(engine), _adapters(engine)
    _update(engine)
    assert all(torch.equal(t, base[n]) for n, t in _base(engine).items())
    assert all(not torch.equal(t, adapters[n]) for n, t in _adapters(engine).items() if ".lora_B." in n)
    assert {s["exp_avg"].dtype for s in engine.optimizer.state.values()} == {torch.float32}


def _critic(model_dir, adapters: LoraSettings | None) -> FSDPEngine:
    return build(CPU, TrainSettings(model_dir, "float32", head="value", lr=1e-2, compute_dtype="float32",
                                    lora=adapters))


def test_a_lora_critic_trains_its_adapter_and_its_whole_value_head_on_a_frozen_base(one_rank, tiny_dir):
    from hybridflow.roles.critic import response_values

    plain, critic = _critic(tiny_dir, None), _critic(tiny_dir, SETTINGS)
    batch = ragged_batch()

    def values(engine):
        return engine.forward_micro(batch, 3, lambda model, mb: response_values(model, mb)) * batch["response_mask"]

    assert torch.equal(values(critic), values(plain))  # the same fresh head, and the adapters start at zero
    head = {n for n in critic.trained_names if not lora.is_adapter(n)}
    assert head == {"score.weight", "score.bias"}
    base, adapters = _base(critic), _adapters(critic)

    def loss(model, mb):
        return ((response_values(model, mb) - 1.0) ** 2 * mb["response_mask"]).sum() / mb["response_mask"].sum(), {}

    critic.train_mini_batch(batch, 3, loss)
    after = _base(critic)
    assert all(torch.equal(after[n], t) for n, t in base.items() if n not in head)
    assert not torch.equal(after["score.weight"], base["score.weight"])
    assert all(not torch.equal(t, adapters[n]) for n, t in _adapters(critic).items() if ".lora_B." in n)
    state = critic.checkpoint_state()
    assert set(state["model"]) == set(adapters) | head == set(state["optimizer"]["state"])


def test_the_critic_gets_an_adapter_of_its_own_only_when_the_spec_asks():
    from hybridflow.roles.config import critic_config
    from hybridflow.roles.critic import critic_lora

    def spec(critic: bool):
        return parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                          "spec": {"algorithm": {"name": "ppo"},
                                   "training": {"lora": {"rank": 4, "alpha": 8, "critic": critic}}}}).spec

    assert critic_lora(critic_config(spec(True))) == SETTINGS
    assert critic_lora(critic_config(spec(False))) is None


def _two_ranks(rank: int, store: str, model_dir: str, out: str) -> None:
    """One of two gloo ranks (`_rank_work`), ended by support.rank_process."""
    run_rank(_rank_work, rank, store, model_dir, out)


def _rank_work(rank: int, store: str, model_dir: str, out: str) -> None:
    """A LoRA engine (built on the meta device, its adapters initialised on each rank), one update on the whole
    batch, a sharded checkpoint; rank 0 writes what the ranks gathered."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    from datetime import timedelta

    # bounded: a rank whose peer died fails in a minute instead of outliving the test run
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        engine = build(WorkerContext(rank, 2, rank, "cpu"), TrainSettings(
            model_dir, "float32", lr=1e-2, compute_dtype="float32", lora=SETTINGS))
        initial = dict(engine.sync_params())
        _update(engine)
        dcp.save(engine.checkpoint_state(), checkpoint_id=f"{out}/sharded")
        gathered = {"initial": initial, "synced": dict(engine.sync_params()), "full": dict(engine.full_params()),
                    "log_probs": masked_log_probs(engine, ragged_batch(), 3)}
        if rank == 0:
            torch.save(gathered, f"{out}/gathered.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_train_the_same_adapters_and_their_checkpoint_loads_on_one(one_rank, tiny_dir, tmp_path):
    import torch.multiprocessing as mp

    # a store of their own: the one_rank fixture's group (this process) has tmp_path / "store"
    mp.start_processes(_two_ranks, args=(str(tmp_path / "two-rank-store"), str(tiny_dir), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    two = torch.load(tmp_path / "gathered.pt")
    one = _engine(tiny_dir)
    assert all(torch.equal(t, two["initial"][n]) for n, t in one.sync_params())  # the same adapters on any world
    _update(one)
    for key, params in (("synced", one.sync_params()), ("full", one.full_params())):
        mine = dict(params)
        assert set(mine) == set(two[key])
        for name, t in mine.items():  # the ranks sum their gradients in another order
            torch.testing.assert_close(t, two[key][name], rtol=1e-4, atol=1e-6, msg=name)

    resumed = _engine(tiny_dir)
    template = resumed.checkpoint_state()
    dcp.load(template, checkpoint_id=str(tmp_path / "sharded"))
    resumed.load_checkpoint_state(template)
    assert all(torch.equal(t, two["synced"][n]) for n, t in resumed.sync_params())
    torch.testing.assert_close(masked_log_probs(resumed, ragged_batch(), 3), two["log_probs"])


def test_the_reference_stage_of_a_lora_job_runs_on_the_actors_pool():
    """trainer.setup builds no reference worker: the "reference" handle is the actor's, and the step's timings find
    the stage on the actor's pool."""
    from types import SimpleNamespace

    from hybridflow.api.training import actor_is_reference
    from hybridflow.trainer.setup import Workers

    def workers(training: dict) -> Workers:
        spec = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                          "spec": {"algorithm": {"klCoef": 0.001}, "training": training}}).spec
        group = SimpleNamespace(pool=SimpleNamespace(name="default"), roles=["actor", "rollout"])
        actor = object()
        return Workers({"actor": actor, "rollout": object(), "reference": actor}, [group], 1, None, spec)

    lora_job = workers({"lora": {"rank": 4, "alpha": 8}})
    assert actor_is_reference(lora_job.spec.training) and lora_job.pools["reference"] == "default"
    assert not actor_is_reference(workers({}).spec.training)
