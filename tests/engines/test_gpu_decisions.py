"""The GPU path's decisions, tested on the CPU (issue 50): no GPU runs here, so each GPU-only branch is a pure decision
or a code path that runs the same on gloo, and these tests pin it down.

- which local device and visible GPUs a worker of a GPU pool gets, for 1, 2 and 8 GPUs per node (a LOCAL_RANK taken
  from the bundle index crashed every rank but the first of a multi-GPU node);
- the backend of a GPU world (`cpu:gloo,cuda:nccl`, so CPU tensors keep working in collectives) and the device
  check every engine collective goes through (and that engines make no collective call outside it);
- fp32 master weights, gradients and AdamW state under a bf16 compute dtype (pure bf16 lost updates at lr 1e-6);
- meta-device init with sharded loading: the same weights as a whole load, without one.
"""
from __future__ import annotations

import ast

import pytest
import torch

from hybridflow.api import TinyModel
from hybridflow.engines import collectives
from hybridflow.single_controller.local_devices import (
    Placement,
    local_device_env,
    process_group_backend,
)

from support.gradients import gradients_at_step
from support.paths import ROOT

ENGINES = ROOT / "workers" / "hybridflow" / "engines"


def _node(name: str, first_gpu: int, gpus: int) -> list[Placement]:
    return [Placement(name, (str(first_gpu + i),)) for i in range(gpus)]


@pytest.mark.parametrize("per_node", [1, 2, 8])
def test_each_gpu_rank_of_a_node_sees_the_nodes_gpus_and_is_its_own_gpus_position(per_node):
    placements = _node("10.0.0.1", 0, per_node) + _node("10.0.0.2", 0, per_node)
    envs = local_device_env(placements)
    for rank, env in enumerate(envs):
        local = rank % per_node
        assert env["LOCAL_RANK"] == str(local)
        assert env["LOCAL_WORLD_SIZE"] == str(per_node)
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible == [str(i) for i in range(per_node)]
        assert visible[int(env["LOCAL_RANK"])] == placements[rank].gpu_ids[0]  # cuda:LOCAL_RANK is its own GPU
        assert int(env["LOCAL_RANK"]) < len(visible)  # vLLM's external_launcher asserts local_rank < device_count


def test_gpus_given_out_of_order_or_beside_another_job_are_still_each_ranks_own():
    """Ray hands out GPU ids 4..7 (another job holds 0..3), in any order: each rank still finds its own."""
    placements = [Placement("n", ("6",)), Placement("n", ("4",)), Placement("n", ("7",)), Placement("n", ("5",))]
    envs = local_device_env(placements)
    for p, env in zip(placements, envs):
        assert env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])] == p.gpu_ids[0]


def test_independent_replicas_keep_their_one_gpu_and_are_local_rank_zero():
    envs = local_device_env(_node("n", 0, 8), independent=True)
    assert [e["LOCAL_RANK"] for e in envs] == ["0"] * 8
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [str(i) for i in range(8)]


def test_cpu_ranks_are_numbered_within_their_node_and_see_no_gpu_setting():
    envs = local_device_env([Placement("a"), Placement("a"), Placement("b"), Placement("a")])
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["3", "3", "1", "3"]
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in envs)


def test_a_gpu_shared_by_two_ranks_or_two_gpus_for_one_rank_is_refused():
    with pytest.raises(ValueError, match="one GPU for two processes"):
        local_device_env([Placement("n", ("0",)), Placement("n", ("0",))])
    with pytest.raises(ValueError, match="exactly one"):
        local_device_env([Placement("n", ("0", "1"))])


def test_a_gpu_world_serves_cuda_and_cpu_tensors_and_a_cpu_world_cpu_ones():
    assert collectives.served_devices(process_group_backend("gpu")) == {"cpu", "cuda"}
    assert collectives.served_devices(process_group_backend("cpu")) == {"cpu"}
    # the world as it was (NCCL alone) could not carry the CPU tensors megatron generation and object lists use
    with pytest.raises(ValueError, match=r"broadcast: a cpu tensor \(4,\) .*'nccl'"):
        collectives.check_devices("broadcast", "nccl", [torch.zeros(4, dtype=torch.long)])
    collectives.check_devices("broadcast", process_group_backend("gpu"), [torch.zeros(4, dtype=torch.long)])


def test_a_collective_on_a_device_its_group_does_not_serve_fails_first_naming_both(one_rank):
    """On a real gloo group: a tensor on a device gloo does not serve is refused by the helper before torch."""
    t = torch.zeros(3)
    collectives.broadcast(t, src=0)
    collectives.all_reduce(t)
    with pytest.raises(ValueError, match=r"all_reduce: a meta tensor \(3,\) .*'gloo'"):
        collectives.all_reduce(torch.empty(3, device="meta"))


_COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
                "broadcast", "broadcast_object_list", "barrier", "reduce_scatter", "reduce_scatter_tensor",
                "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather",
                "scatter", "reduce", "new_group", "gather_object", "scatter_object_list"}


def test_engines_run_collectives_only_through_the_helper():
    """Every `torch.distributed` collective in engines/ goes through engines/collectives.py, so its device check sees
    every tensor; a direct `dist.all_reduce(...)` (or `torch.distributed.broadcast(...)`) elsewhere fails here."""
    direct = []
    for path in sorted(ENGINES.rglob("*.py")):
        if path.name == "collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _COLLECTIVES:
                owner = ast.unparse(node.func.value)
                if owner in ("dist", "torch.distributed"):
                    direct.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner}.{node.func.attr}")
    assert not direct, direct


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from hybridflow.models.builders import build_tiny

    out = tmp_path_factory.mktemp("tiny")
    shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    return {tie: build_tiny(TinyModel(**shape, tie_embeddings=tie), out / f"tied-{tie}", seed=1) for tie in (True, False)}


def _build(model_dir, dtype="bfloat16", head="lm", trainable=True, lr=1e-3, compute="auto"):
    from hybridflow.engines.train import fsdp
    from hybridflow.engines.train.base import TrainSettings
    from hybridflow.single_controller.context import WorkerContext

    return fsdp.build(WorkerContext(0, 1, 0, "cpu"), TrainSettings(model_dir, dtype, head, lr=lr, trainable=trainable,
                                                                   compute_dtype=compute))


def _loss(engine):
    def loss_fn(model, mb):
        logits = model(input_ids=mb["input_ids"]).logits
        loss = torch.log_softmax(logits.float(), -1)[..., 0].mean()
        return loss, {"loss": float(loss)}
    return loss_fn


def test_a_bf16_model_trains_with_fp32_master_weights_gradients_and_adam_state(one_rank, tiny_dirs):
    """models.actor.dtype bfloat16 is the compute dtype; the weights, gradients and AdamW moments are fp32, so an
    update at lr 1e-6 (below half a bf16 ulp of these weights) still moves the weights."""
    from hybridflow.single_controller.batch import Batch

    engine = _build(tiny_dirs[False], "bfloat16", lr=1e-6)
    assert engine.compute_dtype == torch.bfloat16
    before = {n: p.full_tensor().clone() for n, p in engine.resharded().named_parameters()}
    assert {t.dtype for t in before.values()} == {torch.float32}
    batch = Batch({"input_ids": torch.randint(0, 64, (4, 6)), "responses": torch.zeros(4, 2, dtype=torch.long)})
    with gradients_at_step(engine.optimizer, engine.resharded().named_parameters, lambda g: g) as grads:
        engine.train_mini_batch(batch, 4, _loss(engine))
    params = dict(engine.resharded().named_parameters())
    assert {g.dtype for g in grads.values() if g is not None} == {torch.float32}
    assert all(p.grad is None for p in params.values())  # freed once stepped: they live in the update only
    state = [s for s in engine.optimizer.state.values()]
    assert state and {s["exp_avg"].dtype for s in state} | {s["exp_avg_sq"].dtype for s in state} == {torch.float32}
    moved = [n for n, p in params.items() if not torch.equal(p.full_tensor(), before[n])]
    assert len(moved) == len(params), f"weights an lr 1e-6 step left unchanged: {set(params) - set(moved)}"


def test_a_frozen_model_is_held_in_its_own_dtype(one_rank, tiny_dirs):
    engine = _build(tiny_dirs[True], "bfloat16", trainable=False)
    assert {p.dtype for p in engine.resharded().parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [True, False])
def test_meta_init_loads_the_same_weights_as_a_whole_load_without_one(one_rank, tiny_dirs, monkeypatch, tied, compute):
    """Sharded before any weight exists, then filled from the safetensors shards: every parameter equals the
    whole-model load's (a tied head stays tied), and the whole-model loader is never called. Computing in fp32 the
    one rank's module is a plain one (nothing to shard or cast), in bf16 an FSDP2 one: both load the same."""
    from hybridflow.engines.train import fsdp

    whole = fsdp.load_hf_model(tiny_dirs[tied], "float32")
    monkeypatch.setattr(fsdp, "load_hf_model", lambda *a, **k: pytest.fail("the whole model was loaded"))
    engine = _build(tiny_dirs[tied], "float32", compute=compute)
    assert engine.sharded == (compute == "bfloat16")
    got = dict(engine.full_params())
    assert set(got) == {n for n, _ in whole.named_parameters()}
    for name, p in whole.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=0, msg=name)
    rotary = [b for n, b in engine.module.named_buffers() if "inv_freq" in n]
    assert rotary and all(torch.equal(b, dict(whole.named_buffers())[n]) for n, b in
                          engine.module.named_buffers() if "inv_freq" in n)
    module = engine.module
    assert (module.lm_head.weight is module.model.embed_tokens.weight) == tied


def test_a_scorer_without_a_dtype_is_held_in_the_dtype_its_whole_load_had(one_rank, tiny_dirs):
    """A reward model (dtype None: the checkpoint's own) loads sharded, in the dtype from_pretrained gives it."""
    from hybridflow.engines.train import fsdp

    whole = fsdp.load_hf_model(tiny_dirs[False], None, "value")
    engine = _build(tiny_dirs[False], None, head="value", trainable=False)
    assert {p.dtype for p in engine.resharded().parameters()} == {next(whole.parameters()).dtype}


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])  # a plain module, an FSDP2 one
def test_a_value_head_the_checkpoint_lacks_is_initialised_and_the_body_loaded(one_rank, tiny_dirs, compute):
    from hybridflow.engines.train import fsdp

    whole = dict(fsdp.load_hf_model(tiny_dirs[False], "float32").named_parameters())
    got = dict(_build(tiny_dirs[False], "float32", head="value", compute=compute).full_params())
    assert got["score.weight"].abs().sum() > 0 and got["score.weight"].std() < 0.1
    for name, t in got.items():
        if not name.startswith("score"):
            torch.testing.assert_close(t, whole[name].detach(), rtol=0, atol=0, msg=name)
