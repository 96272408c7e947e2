"""`hybridflow export`: a checkpoint's actor as an HF model directory that transformers and vLLM load, with the
training engine's logits."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from support.jobs import run_cli

from hybridflow import checkpoint as ckpt
from hybridflow.checkpoint import dcp
from hybridflow.single_controller.batch import Batch
from hybridflow.data.packing import pack_rollout
from hybridflow.engines.train.fsdp import FSDPEngine, load_causal_lm, response_logits
from hybridflow.checkpoint.model_files import copy_model_metadata
from hybridflow.export import export
from hybridflow.models.builders import materialize
from hybridflow.api import ModelSource, load_job

# A trained checkpoint (a `hybridflow run` in the module fixture), SmolLM2 conversions and a vLLM engine.
pytestmark = pytest.mark.slow

from support.paths import ROOT

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [9], [10, 11]]
RESPONSES = [[4, 5, 6], [8, 9], [10, 11, 12, 13], [12]]


@pytest.fixture(scope="module")
def trained(tiny_example_run):
    """examples/tiny-grpo.yaml trained by `hybridflow run` (the session's run of it, which test_end_to_end checks
    for learning; these tests only read it): (job, its final checkpoint)."""
    root, out = tiny_example_run
    assert out.returncode == 0, out.stderr[-3000:]
    return load_job(ROOT / "examples" / "tiny-grpo.yaml"), ckpt.list_checkpoints(root)[-1]


def test_the_step_log_records_the_size_of_each_checkpoint(trained):
    """What `hybridflow_checkpoint_size_bytes` exports: the bytes of the sealed directory, weights and all."""
    _, step = trained
    last = ckpt.read_step_log(step.parent)[-1]
    assert last["checkpoint"] == str(step)
    assert last["checkpoint_bytes"] == ckpt.size_bytes(step) > ckpt.size_bytes(step / "actor") > 0


def _logits(model: torch.nn.Module) -> torch.Tensor:
    batch = Batch(pack_rollout(PROMPTS, RESPONSES, 4, 4))
    with torch.no_grad():
        return response_logits(model, batch, 1.0).float()


def test_an_exported_actor_loads_in_transformers_with_the_training_engines_logits(trained, tmp_path, model_cache,
                                                                                  one_rank):
    from transformers import AutoModelForCausalLM

    job, step = trained
    out = run_cli(["export", str(step.parent), "--to", str(tmp_path / "hf")], cwd=tmp_path)  # the newest intact one
    assert out.returncode == 0, out.stderr
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "hf").iterdir()}

    model_dir = materialize(job.spec.models.actor, model_cache, job.spec.trainer.seed)
    engine = FSDPEngine(load_causal_lm(model_dir, "float32"), 1e-3, 1.0, "cpu")
    untrained = _logits(engine.module)
    state = engine.checkpoint_state()  # the resume path: the 2-rank shards re-shard onto this one rank
    dcp.load(state, step / "actor")
    engine.load_checkpoint_state(state)
    trained_logits = _logits(engine.module)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported.dtype == torch.float32  # the fp32 masters, not the bf16 compute copy
    got = _logits(exported)
    assert (got - untrained).abs().max() > 1e-3, "the export holds the untrained weights"
    torch.testing.assert_close(got, trained_logits, rtol=0, atol=1e-5)


_VLLM_GREEDY = """
import json, sys
from pathlib import Path
from hybridflow.engines.rollout.base import SamplingConfig
from hybridflow.engines.rollout.vllm import VLLMRollout
engine = VLLMRollout(Path(sys.argv[1]), max_model_len=16, dtype="float32", seed=0, kv_cache_bytes=16 << 20,
                     gpu_memory_utilization=0.9, on_gpu=False)
prompts = json.loads(sys.argv[2])
out = engine.generate(prompts, [SamplingConfig(max_tokens=6, greedy=True, log_probs=True)] * len(prompts))
print(json.dumps([[g.tokens, g.log_probs] for g in out]))
"""


def test_vllm_serves_an_exported_actor_as_transformers_computes_it(trained, tmp_path):
    """vLLM loads the directory as it is (no conversion), and its greedy tokens and their log-probs are
    transformers' on the same weights. In a child process: vLLM sets up its own torch.distributed state."""
    from transformers import AutoModelForCausalLM

    _, step = trained
    export(step, tmp_path / "hf")
    child = subprocess.run([sys.executable, "-c", _VLLM_GREEDY, str(tmp_path / "hf"), json.dumps(PROMPTS)],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    served = json.loads(child.stdout.strip().splitlines()[-1])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    for prompt, (tokens, log_probs) in zip(PROMPTS, served, strict=True):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(tokens), do_sample=False,
                          min_new_tokens=len(tokens), pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        assert ref.sequences[0, len(prompt):].tolist() == tokens
        ref_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.scores, tokens)]
        assert log_probs == pytest.approx(ref_lp, abs=1e-4)


def test_a_smollm2_checkpoint_exports_with_its_tokenizer_and_tied_head_in_bf16(tmp_path, model_cache):
    """The checkpoint carries the model directory's config and tokenizer files (sealed by its manifest);
    `--dtype bfloat16` halves the file; the tied LM head stays tied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = materialize(ModelSource(source="smollm2"), model_cache, 0)
    model = load_causal_lm(src, "float32")
    root = tmp_path / "ckpt"
    with ckpt.writing(root, 3) as staging:
        torch.save({"model": model.state_dict()}, staging / "actor.pt")
        copied = copy_model_metadata(src, staging, "actor")
        step = ckpt.seal(root, staging, 3, {}, keep=2)
    assert {p.name for p in copied} >= {"actor.hf.config.json", "actor.hf.tokenizer.json"}
    assert "actor.hf.tokenizer.json" in json.loads((step / ckpt.MANIFEST).read_text())["files"]

    export(step, tmp_path / "hf", dtype="bfloat16")
    size = (tmp_path / "hf" / "model.safetensors").stat().st_size
    assert size < 0.55 * (src / "model.safetensors").stat().st_size
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.decode(tok("2 + 3 =")["input_ids"]) == "2 + 3 ="
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())

    with ckpt.writing(root, 4) as staging:  # as checkpoints were written before they carried the model's files
        torch.save({"model": model.state_dict()}, staging / "actor.pt")
        older = ckpt.seal(root, staging, 4, {}, keep=2)
    with pytest.raises(ckpt.CheckpointError, match="pass --model-dir"):
        export(older, tmp_path / "older")
    export(older, tmp_path / "older", model_dir=src)
    assert AutoTokenizer.from_pretrained(tmp_path / "older").vocab_size == tok.vocab_size


def test_export_refuses_what_it_cannot_export_and_says_what_to_do(trained, tmp_path):
    _, step = trained
    out = run_cli(["export", str(step), "--to", str(tmp_path / "a"), "--role", "critic"], cwd=tmp_path)
    assert out.returncode == 2 and "holds no critic (it holds: actor" in out.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    out = run_cli(["export", str(step), "--to", str(tmp_path / "full")], cwd=tmp_path)
    assert out.returncode == 2 and "is not empty" in out.stderr and (tmp_path / "full" / "x").read_text() == "mine"

    torn = tmp_path / "step_00000009"  # a copy with a changed weight file: the manifest no longer matches
    import shutil

    shutil.copytree(step, torn)
    with open(torn / "actor" / "__1_0.distcp", "ab") as f:  # rank 1's shard
        f.write(b"x")
    out = run_cli(["export", str(torn), "--to", str(tmp_path / "b")], cwd=tmp_path)
    assert out.returncode == 2 and "is not a complete checkpoint (file actor/__1_0.distcp does not" in out.stderr
    assert not (tmp_path / "b").exists()


def test_a_critic_exports_as_a_one_label_token_classifier_with_its_values(tmp_path):
    """A critic is the backbone with a value head (AutoModelForTokenClassification, one label), as CriticWorker
    builds it; the export loads back with the same values."""
    from transformers import AutoModelForTokenClassification

    from hybridflow.models.builders import build_tiny
    from hybridflow.api import TinyModel

    src = build_tiny(TinyModel(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2), tmp_path / "m", 0)
    critic = AutoModelForTokenClassification.from_pretrained(src, num_labels=1)
    torch.nn.init.normal_(critic.score.weight)  # a head the export must carry, not re-initialise
    root = tmp_path / "ckpt"
    with ckpt.writing(root, 1) as staging:
        torch.save({"model": critic.state_dict()}, staging / "critic.pt")
        copy_model_metadata(src, staging, "critic")
        step = ckpt.seal(root, staging, 1, {}, keep=1)
    export(step, tmp_path / "hf", role="critic")
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, critic(ids).logits)
    assert loaded.config.num_labels == 1


def test_a_model_file_linked_into_proc_is_never_copied_into_a_checkpoint(tmp_path):
    """A `tokenizer.json -> /proc/self/environ` planted on a model claim would copy the pod's environment (its Ray
    token, storage keys) into the checkpoint; a link to a regular file of the model's own (an HF cache's blob) is
    copied as before."""
    src, staging = tmp_path / "model", tmp_path / "ckpt"
    src.mkdir()
    staging.mkdir()
    (src / "config.json").write_text("{}")
    (tmp_path / "blob").write_text('{"chat_template": "x"}')
    (src / "tokenizer_config.json").symlink_to(tmp_path / "blob")
    (src / "tokenizer.json").symlink_to("/proc/self/environ")
    copied = sorted(p.name for p in copy_model_metadata(src, staging, "actor"))
    assert copied == ["actor.hf.config.json", "actor.hf.tokenizer_config.json"]
