"""A LoRA job as a user runs it (issue 54): the tiny GRPO example with `spec.training.lora`, vLLM generating beside an
FSDP2 actor on two ranks, a KL term in the loss, a checkpoint each step (`hybridflow run`'s own load, prepare and
execute, in this process on the suite's shared Ray). What it must show:

- the reference policy is the actor's base (no reference model is loaded), and the KL leaves zero once the
  adapters move;
- each weight sync moves the adapters alone: the step log's sync bytes are the adapter's size;
- a checkpoint holds the adapters alone, and `hybridflow export` writes them as an adapter directory that `peft`
  loads on the base and vLLM serves as a LoRA, or with `--merge` as a model `transformers` loads, all three with the
  training engine's own outputs;
- a resumed job repeats no step."""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.jobs import job_variant, run_cli
from support.paths import ROOT

from hybridflow import checkpoint as ckpt
from hybridflow.checkpoint import dcp
from hybridflow.models.builders import materialize

pytestmark = pytest.mark.slow

STEPS = 3
RANK = 8  # vLLM takes ranks 1, 8, 16...: this one as it is
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [9], [10, 11]]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, model_cache, shared_ray):
    """(job file, checkpointDir, base model directory, what the run printed): the run done, its workers gone."""
    from hybridflow.cli import _load
    from hybridflow.trainer.loop import execute
    from hybridflow.trainer.setup import prepare

    tmp = tmp_path_factory.mktemp("lora")
    root = tmp / "run"
    path = job_variant(tmp, ROOT / "examples" / "tiny-grpo.yaml", trainer__steps=STEPS, trainer__promptsPerStep=8,
                       trainer__eval=False, trainer__saveFreq=1, trainer__checkpointDir=str(root),
                       rollout__responsesPerPrompt=4, data__evalPrompts=8, algorithm__klCoef=0.001,
                       algorithm__klIn="loss", training__lora={"rank": RANK, "alpha": 16},
                       training__microBatchSize=32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRIDFLOW_MODEL_CACHE", str(model_cache))
        rc, printed = _run_in_process(path, {}, tmp, _load, prepare, execute, shared_ray)
    assert rc == 0, printed[-3000:]
    job = _load(str(path), {})
    return path, root, materialize(job.spec.models.actor, model_cache, job.spec.trainer.seed), printed


def _run_in_process(path, overrides, cwd, load, prepare, execute, shared_ray) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out):
        job = load(str(path), {"spec.metrics.port": 0, **overrides})
        prepared = prepare(job)
        try:
            shared_ray.ensure_running()
            shared_ray.check_fits(job)
            rc = execute(job, prepared)
        finally:
            prepared.close()
    return rc, out.getvalue()


def _adapter_bytes(step: Path) -> int:
    state = dcp.read_full(step / "actor", keys={"model"})["model"]
    return sum(t.numel() * t.element_size() for t in state.values())


def test_the_reference_is_the_actors_base_and_each_sync_moves_the_adapter_alone(lora_run):
    _, root, _, printed = lora_run
    assert "pool default: actor, rollout" in printed  # no reference model was loaded
    steps = ckpt.read_step_log(root)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert steps[0]["kl_mean"] == 0.0 < steps[-1]["kl_mean"]  # the adapters start at zero, then move
    adapter = _adapter_bytes(ckpt.list_checkpoints(root)[-1])
    assert all(r["generation_weight_bytes"] == adapter for r in steps), [r["generation_weight_bytes"] for r in steps]


def test_a_checkpoint_holds_the_adapter_alone(lora_run):
    _, root, base, _ = lora_run
    step = ckpt.list_checkpoints(root)[-1]
    saved = dcp.read_full(step / "actor", keys={"model", "optimizer"})
    adapters = set(saved["model"])
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters), sorted(adapters)[:4]
    assert len(adapters) == 2 * 7 * 2  # A and B of every projection (the family's default) of both layers
    assert set(saved["optimizer"]["state"]) == adapters  # AdamW's moments: the adapters' alone
    config = json.loads((step / "actor.lora.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, 16, str(base))
    assert "actor.lora.json" in json.loads((step / ckpt.MANIFEST).read_text())["files"]  # sealed with the rest


def _trained_logits(base: Path, step: Path) -> torch.Tensor:
    """The training engine's own outputs at the checkpoint: a LoRA FSDP engine on one rank, its shards loaded."""
    import torch.distributed as dist

    from hybridflow.engines.train.fsdp import FSDPEngine, load_causal_lm, with_adapters
    from hybridflow.models.lora import LoraSettings

    settings = LoraSettings(rank=RANK, alpha=16.0)
    dist.init_process_group("gloo", init_method=f"file://{step.parent.parent / 'one-rank-store'}", rank=0,
                            world_size=1)
    try:
        engine = FSDPEngine(with_adapters(load_causal_lm(base, "float32"), settings), 1e-3, 1.0, "cpu",
                            lora=settings)
        state = engine.checkpoint_state()
        dcp.load(state, step / "actor")
        engine.load_checkpoint_state(state)
        return _logits(engine.module)
    finally:
        dist.destroy_process_group()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p + [0] * (4 - len(p))])).logits[0].float() for p in PROMPTS])


_VLLM_WITH_ADAPTER = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its output is ours alone
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=16,
          kv_cache_memory_bytes=16 << 20, enable_lora=True, max_lora_rank=8, max_loras=1, seed=0)
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[3])]
out = llm.generate(prompts, params, lora_request=LoRARequest("exported", 1, sys.argv[2]), use_tqdm=False)
print(json.dumps([list(o.outputs[0].token_ids) for o in out]))
"""


def test_the_export_loads_in_peft_and_vllm_as_an_adapter_and_merged_in_transformers(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, root, base, _ = lora_run
    step = ckpt.list_checkpoints(root)[-1]
    trained = _trained_logits(base, step)
    untrained = _logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval())
    assert (trained - untrained).abs().max() > 1e-4, "the checkpoint holds the untrained adapter"

    out = run_cli(["export", str(root), "--to", str(tmp_path / "adapter")], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert not (tmp_path / "adapter" / "config.json").exists()  # an adapter directory, not a model's
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(with_peft), trained, rtol=0, atol=1e-5)

    out = run_cli(["export", str(root), "--merge", "--to", str(tmp_path / "merged")], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged), trained, rtol=0, atol=1e-5)

    child = subprocess.run([sys.executable, "-c", _VLLM_WITH_ADAPTER, str(base), str(tmp_path / "adapter"),
                            json.dumps(PROMPTS)], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    served = json.loads([line for line in child.stdout.splitlines() if line.startswith("[[")][-1])
    with torch.no_grad():
        for prompt, tokens in zip(PROMPTS, served, strict=True):
            ids = torch.tensor([prompt])
            ref = merged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(tokens),
                                  min_new_tokens=len(tokens), do_sample=False, pad_token_id=0)
            assert ref[0, len(prompt):].tolist() == tokens, prompt


def test_a_merge_without_the_base_here_names_the_flag_that_gives_it(lora_run, tmp_path):
    _, root, base, _ = lora_run
    out = run_cli(["export", str(root), "--merge", "--model-dir", str(tmp_path / "nowhere"), "--to",
                   str(tmp_path / "m")], cwd=tmp_path)
    assert out.returncode == 2 and "pass --model-dir with the base model's directory" in out.stderr, out.stderr


def test_a_resumed_lora_job_repeats_no_step(lora_run, model_cache, shared_ray):
    from hybridflow.cli import _load
    from hybridflow.trainer.loop import execute
    from hybridflow.trainer.setup import prepare

    path, root, _, _ = lora_run
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRIDFLOW_MODEL_CACHE", str(model_cache))
        rc, printed = _run_in_process(path, {"spec.trainer.steps": STEPS + 1}, path.parent, _load, prepare, execute,
                                      shared_ray)
    assert rc == 0, printed[-3000:]
    assert [r["step"] for r in ckpt.read_step_log(root)] == list(range(1, STEPS + 2))
