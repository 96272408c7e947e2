"""The reward and cost models (roles/reward_model.py) are held in the dtype their spec names
(`spec.models.reward.model.dtype`), as the reference is and as the memory model prices them (memory/terms.py's
frozen_terms): they were loaded in the checkpoint's own dtype, so `dtype: bfloat16` did nothing for them."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridflow.api import ModelSource, TinyModel
from hybridflow.api.engines import TRAIN_ENGINES
from hybridflow.models.builders import build_tiny
from hybridflow.roles.config import SCORING_TRAIN_ENGINE, ScoringConfig
from hybridflow.roles.reward_model import RewardModelWorker
from hybridflow.single_controller.context import WorkerContext


@pytest.mark.parametrize("checkpoint,spec", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_a_scoring_model_is_held_in_the_dtype_its_spec_names_whatever_the_checkpoint(one_rank, tmp_path,
                                                                                     checkpoint, spec):
    built = build_tiny(TinyModel(vocab_size=32, hidden_size=32, intermediate_size=64), tmp_path / "built", 0)
    model_dir = _in_dtype(built, tmp_path / "rm", getattr(torch, checkpoint))
    config = ScoringConfig(model=ModelSource(source="path", path=str(model_dir), dtype=spec), temperature=1.0,
                           micro_batch_size=2, compute_dtype="float32", dynamic_batch_size=False, seed=0,
                           train_engine=TRAIN_ENGINES[SCORING_TRAIN_ENGINE])
    worker = RewardModelWorker(WorkerContext(0, 1, 0, "cpu"), config, str(model_dir))
    held = {p.dtype for p in worker.engine.module.parameters()}
    assert held == {getattr(torch, spec)}, f"checkpoint {checkpoint}, spec {spec}: held {held}"


def _in_dtype(src, dst, dtype: torch.dtype):
    """A copy of the HF directory `src` whose weights (and config's torch_dtype) are `dtype`."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"torch_dtype": str(dtype).removeprefix("torch."),
                                                          "dtype": str(dtype).removeprefix("torch.")}))
    return dst
