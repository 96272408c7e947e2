"""Sharded (DCP) checkpoints of the megatron training engine are independent of the model-parallel layout: a run
trained at TP=2 x PP=2 (tied embeddings split over the two stages) and checkpointed resumes at TP=1 x PP=1 x DP=4
(and a TP=1 checkpoint at TP=2 x PP=2) with the losses of the uninterrupted run, optimizer (AdamW) state included;
the checkpoint names whole HF tensors, so the FSDP engine loads it too.

Real megatron-core on CPU gloo: the phases run one after another on one spawn of four local processes (this file is
also their entry point), megatron's process groups made anew for each phase; spawning them (torch and megatron-core
imported in each) costs more than the phases. At TP=1 the four ranks are four data-parallel replicas, each on the
whole batch (as every rank is at TP=2 x PP=2): their averaged gradient is one rank's, so the losses are one
process's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

LR, CLIP = 1e-2, 1.0  # lr large enough that Adam's moments visibly steer the steps; the clip is active (norm > 1)
BEFORE, AFTER = 2, 2  # optimizer steps before the checkpoint, and compared after it
REL = 1e-5  # float32; TP=1 and TP=2 sum in different orders, so losses agree to ~1e-7, not bit for bit


# --- the ranks (run as `python tests/checkpoint/test_megatron_checkpoint.py RANK WORLD INIT CFG`) ---

def _steps(engine, batch, n: int) -> list[float]:
    from support.megatron_launcher import objective  # tests/ is on the ranks' PYTHONPATH (_spawn)

    def loss_fn(module, mb):
        logp, logits = engine.log_probs(module, mb, 1.0)
        loss = objective(logp, engine.entropy(logits))
        return loss, {"loss": loss.detach()}

    return [engine.train_mini_batch(batch, len(batch), loss_fn)["loss"] for _ in range(n)]


def _megatron(cfg: dict):
    from hybridflow.engines.train.megatron import MegatronEngine

    return MegatronEngine(Path(cfg["model_dir"]), "float32", cfg["tp"], lr=LR, grad_clip=CLIP, device="cpu",
                          pp=cfg.get("pp", 1))


def _save(engine, directory: str) -> None:
    from hybridflow.checkpoint import dcp as sc

    sc.save(engine.checkpoint_state(), Path(directory), Path(directory).parent)


def _resume(engine, directory: str, optimizer: bool = True) -> None:
    from hybridflow.checkpoint import dcp as sc

    state = engine.checkpoint_state()
    if not optimizer:
        state = {"model": state["model"]}
    sc.load(state, Path(directory))
    engine.load_checkpoint_state(state)


def run_rank(rank: int, world: int, init: str, phases: list[dict]) -> None:
    from support.megatron_launcher import in_each_layout

    def phase(cfg: dict) -> None:
        out = run_phase(cfg)
        if rank == 0:
            torch.save(out, cfg["out"])

    in_each_layout(rank, world, init, phases, phase)


def run_phase(cfg: dict) -> dict:
    from hybridflow.single_controller.batch import Batch

    batch = Batch(torch.load(cfg["batch"]))  # every rank takes the whole batch (the DP replicas at TP=1 too)
    engine = _megatron(cfg)
    out: dict = {}
    if cfg["phase"] == "train":
        out["before"] = _steps(engine, batch, BEFORE)
        _save(engine, cfg["ckpt"])
        out["after"] = _steps(engine, batch, AFTER)  # the uninterrupted run
    else:
        _resume(engine, cfg["ckpt"])
        if cfg.get("resave"):  # the resumed state, checkpointed again in this layout
            _save(engine, cfg["resave"])
        out["after"] = _steps(engine, batch, AFTER)
        if cfg.get("weights_only"):
            fresh = _megatron(cfg)
            _resume(fresh, cfg["ckpt"], optimizer=False)
            out["weights_only"] = _steps(fresh, batch, AFTER)
        if cfg.get("fsdp"):
            from transformers import AutoModelForCausalLM

            from hybridflow.engines.train.fsdp import FSDPEngine

            hf = AutoModelForCausalLM.from_pretrained(cfg["model_dir"], dtype=torch.float32)
            fsdp = FSDPEngine(hf, LR, CLIP, "cpu")
            _resume(fsdp, cfg["ckpt"])
            out["fsdp"] = _steps(fsdp, batch, AFTER)
    return out


# --- the test process ---

def _spawn(tmp: Path, world: int, phases: list[dict]) -> list[dict]:
    """Run `world` ranks of this file through the phases: rank 0's out of each."""
    from support.megatron_launcher import spawn_ranks

    return spawn_ranks(__file__, tmp, world, phases)


# Every test reads `runs`: megatron-core processes training at TP=2 x PP=2, resuming at TP=1 and back.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Train at TP=2 x PP=2 and checkpoint (`ckpt`), continue uninterrupted (the reference); resume `ckpt` at TP=1,
    also weights only and into FSDP, and re-checkpoint the resumed state at TP=1 (`resave`); resume `resave` at
    TP=2 x PP=2."""
    from support.megatron_inputs import hf_model, tiny_batch

    tmp = tmp_path_factory.mktemp("megatron-ckpt")
    hf_model("qwen2").save_pretrained(tmp / "model", safe_serialization=True)  # tied, QKV bias, 4 heads / 2 groups
    torch.save(tiny_batch(), tmp / "batch.pt")
    base = {"model_dir": str(tmp / "model"), "batch": str(tmp / "batch.pt"), "ckpt": str(tmp / "ckpt")}
    ref, tp1, back = _spawn(tmp, 4, [
        {**base, "phase": "train", "tp": 2, "pp": 2},
        {**base, "phase": "resume", "tp": 1, "resave": str(tmp / "resave"), "weights_only": True, "fsdp": True},
        {**base, "phase": "resume", "tp": 2, "pp": 2, "ckpt": str(tmp / "resave")}])
    return {"base": base, "ref": ref, "tp1": tp1, "tp2xpp2": back}


def test_tp2xpp2_checkpoint_resumes_at_tp1_with_optimizer_state(runs):
    ref, got = runs["ref"], runs["tp1"]
    assert ref["before"][0] != pytest.approx(ref["after"][-1], rel=1e-3)  # the steps move the loss
    # the first step after resuming sees the restored weights, the second also the restored Adam moments and step
    assert got["after"] == pytest.approx(ref["after"], rel=REL)


def test_weights_without_optimizer_state_diverge(runs):
    """What the optimizer state is worth: loading the weights alone gives the first loss, not the second (a fresh
    AdamW's first update is lr * sign(g), not lr * m / sqrt(v) with bias-corrected moments)."""
    ref, got = runs["ref"], runs["tp1"]["weights_only"]
    assert got[0] == pytest.approx(ref["after"][0], rel=REL)
    assert abs(got[1] - ref["after"][1]) > 1000 * REL * abs(ref["after"][1])


def test_tp1_checkpoint_resumes_at_tp2xpp2(runs):
    """The TP=1 re-checkpoint of the resumed state, loaded at TP=2 x PP=2, continues as the uninterrupted run does."""
    assert runs["tp2xpp2"]["after"] == pytest.approx(runs["ref"]["after"], rel=REL)


def test_megatron_checkpoint_loads_into_fsdp(runs):
    """HF names and whole-tensor shapes, as the FSDP engine's checkpoint has them: it resumes the megatron run."""
    from transformers import AutoModelForCausalLM

    from hybridflow.checkpoint import dcp as sc

    full = sc.read_full(Path(runs["base"]["ckpt"]))
    hf = AutoModelForCausalLM.from_pretrained(runs["base"]["model_dir"]).state_dict()
    assert {k: tuple(v.shape) for k, v in full["model"].items()} == {k: tuple(v.shape) for k, v in hf.items()}
    params = set(hf) - {"lm_head.weight"}  # tied: the optimizer knows the embedding only
    assert set(full["optimizer"]["state"]) == params
    assert all(full["optimizer"]["state"][k]["exp_avg"].shape == hf[k].shape for k in params)
    assert all(float(v["step"]) == BEFORE for v in full["optimizer"]["state"].values())
    assert runs["tp1"]["fsdp"] == pytest.approx(runs["ref"]["after"], rel=REL)


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))
