"""A sharded FSDP checkpoint resumes on another number of ranks (2 -> 1, 1 -> 2), optimizer state included: the
steps after the resume have the losses of a run that never stopped. Real FSDP2 and torch.distributed.checkpoint on
spawned gloo processes, through the engine and the checkpoint module the roles use."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.checkpoint import dcp
from hybridflow.single_controller.batch import Batch
from hybridflow.data.packing import pack_rollout

BEFORE, AFTER = 3, 3  # optimizer steps before the checkpoint, and after it
LR = 0.02  # large enough that Adam's moments visibly steer the steps after a resume
# fp32 on CPU: the runs differ only in how gradients are summed over ranks (reduction order), ~1e-7 relative
REL_TOL = 1e-4
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [9], [10, 11], [3, 3], [7, 1, 2], [5], [6, 8]]
RESPONSES = [[4, 5, 6], [8, 9], [10, 11, 12, 13], [12], [1, 2], [9, 9, 9], [4, 4], [2]]


def _engine():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.engines.train.fsdp import FSDPEngine

    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return FSDPEngine(LlamaForCausalLM(cfg), lr=LR, grad_clip=1.0, device="cpu")


def _loss(engine):
    def fn(model, mb):
        logp, _ = engine.log_probs(model, mb, 1.0)
        mask = mb["response_mask"].float()  # a mean of per-row means: the same whatever rows a rank holds
        return -((logp * mask).sum(-1) / mask.sum(-1)).mean(), {}
    return fn


def _steps(engine, n: int) -> list[float]:
    """n optimizer steps on this rank's rows of the global batch; the global mean loss before each step."""
    full = Batch(pack_rollout(PROMPTS, RESPONSES, 4, 4))
    mine = full.split(len(full) // dist.get_world_size())[dist.get_rank()]
    losses = []
    for _ in range(n):
        with torch.no_grad():
            here = _loss(engine)(engine.module, mine)[0].detach()
        dist.all_reduce(here)
        losses.append(float(here) / dist.get_world_size())
        engine.train_mini_batch(mine, 4, _loss(engine))
    return losses


def _resumed(checkpoint: Path, optimizer: bool) -> list[float]:
    """A fresh engine on this world size takes the checkpoint (weights only: its optimizer starts afresh, since DCP
    loads into the tensors it is given), then the AFTER steps."""
    engine = _engine()
    state = engine.checkpoint_state()
    if not optimizer:
        state = {"model": state["model"]}
    dcp.load(state, checkpoint / "actor")
    engine.load_checkpoint_state(state)
    return _steps(engine, AFTER)


def _rank(rank: int, world: int, store: str, mode: str, ckpt: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        checkpoint = Path(ckpt)
        if mode == "train":  # BEFORE steps, a checkpoint, AFTER steps: the uninterrupted reference
            engine = _engine()
            losses = _steps(engine, BEFORE)
            dcp.save(engine.checkpoint_state(), checkpoint / "actor", checkpoint)
            result = {"train": losses + _steps(engine, AFTER)}
        else:  # both resumes in the same processes: one round of process starts less
            result = {"resume": _resumed(checkpoint, optimizer=True),
                      "resume-weights-only": _resumed(checkpoint, optimizer=False)}
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()  # every rank is past its last collective before any tears its group down
    finally:
        dist.destroy_process_group()
    _leave()


def _leave() -> None:
    """End this rank's process once its work is done and its result written, skipping the interpreter's shutdown.
    FSDP2's DTensors keep the gloo group alive after destroy_process_group (its two worker threads and its socket
    thread still run, and its connections stay open), so a normal exit tears them down during interpreter and
    C++ static teardown, beside the other rank's exit; a rank once died there of SIGABRT ("terminate called without
    an active exception", not reproduced since)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(world: int, mode: str, ckpt: Path, tmp: Path) -> dict[str, list[float]]:
    out = tmp / f"{mode}-{world}.json"
    store = tmp / f"store-{mode}-{world}"
    mp.start_processes(_rank, args=(world, str(store), mode, str(ckpt), str(out)), nprocs=world, join=True,
                       start_method="spawn")  # join: every rank ends (or the error is raised) before this returns
    return json.loads(out.read_text())


@pytest.mark.slow  # two spawns of gloo ranks training FSDP2
@pytest.mark.parametrize("saved_on, resumed_on", [(2, 1), (1, 2)], ids=["2->1", "1->2"])
def test_a_sharded_checkpoint_resumes_on_another_world_size_with_the_same_losses(tmp_path, saved_on, resumed_on):
    ckpt = tmp_path / "ckpt"
    reference = _run(saved_on, "train", ckpt, tmp_path)["train"]
    files = sorted(p.name for p in (ckpt / "actor").iterdir())
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(saved_on)]  # each rank wrote its own shards
    assert reference[-1] < reference[0]  # it trains

    runs = _run(resumed_on, "resume", ckpt, tmp_path)
    resumed = runs["resume"]
    assert resumed == pytest.approx(reference[BEFORE:], rel=REL_TOL)

    # The optimizer's state is part of what makes the next steps the same: without it the second step differs.
    weights_only = runs["resume-weights-only"]
    assert weights_only[0] == pytest.approx(reference[BEFORE], rel=REL_TOL)
    assert abs(weights_only[1] - reference[BEFORE + 1]) > 20 * REL_TOL * abs(reference[BEFORE + 1])


def test_a_resumed_engine_keeps_its_own_learning_rate_and_takes_the_checkpoints_moments(tmp_path, one_rank):
    """A new job that resumes another's checkpoint (trainer.resumeFrom) may have changed training.actorLr: the spec
    is what runs; the checkpoint brings the weights and Adam's moments and step count."""
    saved = _engine()
    _steps(saved, 2)
    dcp.save(saved.checkpoint_state(), tmp_path / "actor", tmp_path)
    import hybridflow.engines.train.fsdp as fsdp

    torch.manual_seed(1)
    resumed = fsdp.FSDPEngine(type(saved.module)(saved.module.config), lr=LR / 10, grad_clip=1.0, device="cpu")
    state = resumed.checkpoint_state()
    dcp.load(state, tmp_path / "actor")
    resumed.load_checkpoint_state(state)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [LR / 10]
    (p_saved, s_saved), (p_res, s_res) = [next(iter(e.optimizer.state.items())) for e in (saved, resumed)]
    assert float(s_res["step"]) == float(s_saved["step"]) == 2
    assert not resumed.sharded  # one rank computing in its weights' dtype: a plain module, its moments whole
    assert torch.equal(s_res["exp_avg"], s_saved["exp_avg"])
