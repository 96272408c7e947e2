"""Model materialisation on a worker that is not rank 0 (a pod on Kubernetes builds its own copy)."""

import pytest
import torch

from hybridflow.models.builders import build_tiny, local_model_dir
from hybridflow.api import ModelSource, TinyModel

from support.paths import ROOT


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_model_is_written_on_ranks_other_than_zero_as_save_pretrained_would(tmp_path, monkeypatch, tied):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.distributed import mixin

    from hybridflow.models.builders import tiny_config

    t = TinyModel(tie_embeddings=tied)
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)  # where save_pretrained writes nothing
    out = build_tiny(t, tmp_path / "rank1", seed=3)
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    monkeypatch.undo()
    torch.manual_seed(3)  # what build_tiny does, saved the stock way on a non-distributed process
    AutoModelForCausalLM.from_config(tiny_config(t), dtype=torch.float32).save_pretrained(tmp_path / "stock")
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "stock" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same names: vLLM loads both


def test_local_model_dir_rebuilds_what_the_driver_built_elsewhere(tmp_path, monkeypatch):
    src = ModelSource(source="tiny")
    driver = build_tiny(src.tiny, tmp_path / "driver-cache", seed=0)
    monkeypatch.setenv("HYBRIDFLOW_MODEL_CACHE", str(tmp_path / "pod-cache"))
    here = local_model_dir(tmp_path / "driver-cache-not-mounted" / driver.name, src, seed=0)
    assert here.parent == tmp_path / "pod-cache" and here.name == driver.name
    assert local_model_dir(driver, src, seed=0) == driver  # visible: used as is
    with pytest.raises(FileNotFoundError):
        local_model_dir(tmp_path / "nowhere", ModelSource(source="path", path=str(tmp_path / "nowhere")), 0)


def test_smollm2_comes_from_the_image_when_the_image_converted_it(tmp_path, monkeypatch):
    """The CPU worker image converts SmolLM2 once at build time (images/worker-cpu/Dockerfile): a pod reads that
    copy and converts nothing into its own cache (without it, every other SmolLM2 test converts into its cache)."""
    from hybridflow.models import builders

    image = tmp_path / "image-models"
    monkeypatch.setattr(builders, "IMAGE_MODELS", image)
    (image / builders.SMOLLM2_DIR).mkdir(parents=True)
    (image / builders.SMOLLM2_DIR / "config.json").write_text("{}")
    assert builders.build_smollm2(tmp_path / "cache") == image / builders.SMOLLM2_DIR
    assert not (tmp_path / "cache").exists(), "converted again although the image has it"
    dockerfile = (ROOT / "images" / "worker-cpu" / "Dockerfile").read_text()
    assert "build_smollm2(IMAGE_MODELS)" in dockerfile, "the CPU image no longer converts SmolLM2 when it is built"
