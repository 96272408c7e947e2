"""LoRA generation (spec.training.lora, issue 54): a generation engine's base comes from the model's files, never
from the trainer (a CPU vLLM releases it for the update and reads it back), and it takes only the trainer's adapters
after each update (`load_adapter`). vLLM and the HF engine with an
adapter generate greedily exactly what HF + peft generates with the same adapter directory; a second version
replaces the first (vLLM: no KV block of the older adapter is reused); the colocated transfer pushes the FSDP
engine's adapters alone, and the step log's sync bytes are theirs.

The model: the tiny Qwen2 of TinyModel's defaults (head_dim 32), not support.tiny_actor's (head_dim 16, which vLLM's
CPU attention refuses: "Unsupported CPU attention configuration: head_dim=16")."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.api import TinyModel, parse_job
from hybridflow.models import lora
from hybridflow.engines.bridge.transfer import FullTensorTransfer
from hybridflow.models.lora import LoraSettings
from hybridflow.engines.rollout.base import SamplingConfig
from hybridflow.engines.rollout.hf import HFRollout
from hybridflow.models.builders import build_tiny
from hybridflow.single_controller.context import WorkerContext

SETTINGS = LoraSettings(rank=4, alpha=8.0)
NEW = 6  # tokens generated per prompt
LONG = [(7 * i) % 29 + 2 for i in range(40)]  # over one 32-token KV block: vLLM caches its prefix
PROMPTS = [[3, 4], [5, 6, 7, 8, 9, 10, 11], LONG]
GREEDY = SamplingConfig(max_tokens=NEW, greedy=True)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return build_tiny(TinyModel(vocab_size=32), tmp_path / "m", 0)


def adapters(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """Adapter tensors under module names for every default target of the model, drawn from `seed` (lora_B
    nonzero, unlike PEFT's initial adapters: this one changes what the model generates)."""
    from transformers import AutoModelForCausalLM

    hf = lora.inject(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), SETTINGS)
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * 0.5 for n, p in hf.named_parameters() if lora.is_adapter(n)}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def hf_greedy(model_dir: Path, prompts: list[list[int]], adapter_dir: Path | None = None) -> list[list[int]]:
    """Greedy tokens of plain HF, or of HF + peft with the adapter directory (PeftModel.from_pretrained)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                 min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            out.append(seq[0, len(p):].tolist())
    return out


def references(model_dir: Path, tmp_path: Path, versions: dict[str, dict[str, torch.Tensor]]) -> dict[str, list]:
    """HF's greedy tokens on the base and HF + peft's with each version's adapter directory."""
    refs = {"base": hf_greedy(model_dir, PROMPTS)}
    for name, tensors in versions.items():
        lora.write_adapter(tmp_path / f"peft-{name}", tensors.items(), SETTINGS, "qwen2", str(model_dir))
        refs[name] = hf_greedy(model_dir, PROMPTS, tmp_path / f"peft-{name}")
    assert refs["v1"] != refs["base"] and refs["v2"] != refs["v1"], "the adapters must change what is generated"
    return refs


_VLLM = """
import json, sys
from pathlib import Path
import torch
from hybridflow.api import parse_job
from hybridflow.models.lora import LoraSettings
from hybridflow.engines.rollout.base import RolloutSetup, SamplingConfig
from hybridflow.engines.rollout.vllm import build
from hybridflow.single_controller.context import WorkerContext
model_dir, versions, prompts = Path(sys.argv[1]), torch.load(sys.argv[2]), json.loads(sys.argv[3])
rollout = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                     "spec": {"rollout": {"maxPromptLength": 48, "maxResponseLength": 6, "kvCacheGib": 0.02}}})
engine = build(WorkerContext(0, 1, 0, "cpu"), RolloutSetup(
    model_dir, rollout.spec.rollout, "float32", torch.float32, seed=0, sequences=len(prompts),
    device=torch.device("cpu"), trainer=None, transfer=None, lora=LoraSettings(rank=4, alpha=8.0)))
greedy = [SamplingConfig(max_tokens=6, greedy=True)] * len(prompts)
out = {"sums": [engine.weight_checksums()], "base": [g.tokens for g in engine.generate(prompts, greedy)]}
for name in ("v1", "v2"):
    out[f"{name}_bytes"] = engine.load_adapter(iter(versions[name].items()))
    out[name] = [g.tokens for g in engine.generate(prompts, greedy)]
    out["sums"].append(engine.weight_checksums())
engine.release()  # on CPU the LoRA base goes too; the next adapter's load reads it back from the model directory
try:
    engine.generate(prompts, greedy)
    out["released"] = "generated"
except RuntimeError as err:
    out["released"] = str(err)
out["v2_again_bytes"] = engine.load_adapter(iter(versions["v2"].items()))
out["v2_again"] = [g.tokens for g in engine.generate(prompts, greedy)]
out["dirs"] = sorted(p.name for p in engine.adapters_dir.iterdir())
print(json.dumps(out))
"""


@pytest.mark.slow  # vLLM in a child process (12-16 s)
def test_vllm_generates_with_each_adapter_version_as_hf_with_peft_does(model_dir, tmp_path):
    """vLLM (CPU, in a child process: it sets up torch.distributed state of its own), built by its factory from a
    RolloutSetup with the LoRA settings (rank 4, served at vLLM's rank 8): the base alone
    before any adapter; each version's greedy tokens are HF + peft's with that version's directory, the second
    version's on a long prompt whose KV blocks the first version cached (no stale prefix cache); only the current
    version's directory is kept; release frees the base (generation refuses until the next adapter comes), and the
    next adapter's load brings the base back from the model directory: the same tokens again."""
    versions = {"v1": adapters(model_dir, 1), "v2": adapters(model_dir, 2)}
    torch.save(versions, tmp_path / "versions.pt")
    child = subprocess.run([sys.executable, "-c", _VLLM, str(model_dir), str(tmp_path / "versions.pt"),
                            json.dumps(PROMPTS)], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    refs = references(model_dir, tmp_path, versions)
    assert got["base"] == refs["base"]
    assert got["v1"] == refs["v1"]
    assert got["v2"] == refs["v2"]
    assert "released for training" in got["released"]
    assert got["v2_again"] == refs["v2"]
    assert got["v1_bytes"] == nbytes(versions["v1"]) and got["v2_bytes"] == nbytes(versions["v2"])
    assert got["sums"] == [{"adapter": 0.0}] + [{"adapter": lora.adapter_checksum(versions[v].items(), torch.float32)}
                                                for v in ("v1", "v2")]
    assert got["dirs"] == ["v3"]  # the reload's version has a directory of its own, the older ones removed


def test_vllm_lora_ranks_round_up_to_the_next_it_accepts():
    from hybridflow.engines.rollout.vllm import vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 4, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="spec.training.lora.rank = 600"):
        vllm_lora_rank(600)
    from hybridflow.api.engines import ROLLOUT_ENGINES

    assert vllm_lora_rank(ROLLOUT_ENGINES["vllm"].max_lora_rank) == ROLLOUT_ENGINES["vllm"].max_lora_rank  # the
    with pytest.raises(ValueError):  # spec's rule (api.rules) refuses exactly the ranks this vLLM cannot serve
        vllm_lora_rank(ROLLOUT_ENGINES["vllm"].max_lora_rank + 1)


def test_the_hf_engine_takes_each_adapter_version_as_peft_computes_it(model_dir, tmp_path):
    versions = {"v1": adapters(model_dir, 1), "v2": adapters(model_dir, 2)}
    refs = references(model_dir, tmp_path, versions)
    engine = HFRollout(model_dir, "float32", torch.device("cpu"), 0, SETTINGS)
    greedy = [GREEDY] * len(PROMPTS)
    assert [g.tokens for g in engine.generate(PROMPTS, greedy)] == refs["base"]
    assert engine.weight_checksums() == {"adapter": 0.0}
    for name in ("v1", "v2"):
        assert engine.load_adapter(iter(versions[name].items())) == nbytes(versions[name])
        assert [g.tokens for g in engine.generate(PROMPTS, greedy)] == refs[name]
    assert engine.weight_checksums() == {"adapter": lora.adapter_checksum(versions["v2"].items())}
    with pytest.raises(KeyError, match="no adapter"):
        engine.load_adapter(iter([("model.layers.0.mlp.gate_proj.weight", torch.zeros(128, 64))]))


def test_an_engine_without_lora_refuses_an_adapter(model_dir):
    engine = HFRollout(model_dir, "float32", torch.device("cpu"), 0)
    with pytest.raises(RuntimeError, match="spec.training.lora"):
        engine.load_adapter(iter(adapters(model_dir, 1).items()))


def _lora_job(model_dir: Path):
    return parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                      "spec": {"models": {"actor": {"source": "path", "path": str(model_dir)}},
                               "rollout": {"engine": "hf", "maxPromptLength": 48, "maxResponseLength": NEW},
                               "training": {"microBatchSize": 3, "computeDtype": "float32",
                                            "lora": {"rank": SETTINGS.rank, "alpha": SETTINGS.alpha}},
                               "trainer": {"promptsPerStep": 4}}})


def test_the_colocated_sync_moves_the_fsdp_engines_adapters_alone(one_rank, model_dir, tmp_path):
    """The actor (FSDP, LoRA) and the HF rollout beside it, as the worker host builds them: the first generation
    runs on the model directory's base with no sync; after the adapters moved, a sync pushes `sync_params` (the
    adapters, not the base) into load_adapter, the step log's sync bytes are the adapters' bytes, the checksums
    agree, and generation is HF + peft's with the trainer's adapters."""
    from hybridflow.roles.actor import ActorWorker
    from hybridflow.roles.config import actor_config
    from hybridflow.roles.rollout import RolloutWorker
    from hybridflow.trainer.generation.weight_sync import ColocatedWeightSync

    config = actor_config(_lora_job(model_dir).spec)
    ctx = WorkerContext(0, 1, 0, "cpu")
    actor = ActorWorker(ctx, config, str(model_dir))
    rollout = RolloutWorker(ctx, config, [], actor)
    assert isinstance(rollout.transfer, FullTensorTransfer)
    greedy = [GREEDY] * len(PROMPTS)
    assert [g.tokens for g in rollout.generator.generate(PROMPTS, greedy)] == hf_greedy(model_dir, PROMPTS)
    with torch.no_grad():  # an update's worth of change: lora_B away from zero
        for name, p in actor.engine.module.named_parameters():
            if ".lora_B." in name:
                p.add_(0.3)
    trained = {n: t.clone() for n, t in actor.engine.sync_params()}
    assert trained and all(lora.is_adapter(n) for n in trained)

    class OneRank:  # test double of the rollout role's handle: the call on its one rank, as a list per rank
        def sync_weights(self, version: int, profile: bool = False) -> list[dict[str, float]]:
            return [rollout.sync_weights(version, profile)]

    rollout.release()  # generate -> train, as before every update: the base must survive it
    stats = ColocatedWeightSync(OneRank()).sync(1)
    assert stats["generation_weight_bytes"] == nbytes(trained)
    assert stats["reshard_bytes"] == 0  # one rank: nothing gathered from another
    assert rollout.weight_checksums() == rollout.train_checksum() == {"adapter": lora.adapter_checksum(
        trained.items(), torch.float32)}
    lora.write_adapter(tmp_path / "peft", trained.items(), SETTINGS, "qwen2", str(model_dir))
    want = hf_greedy(model_dir, PROMPTS, tmp_path / "peft")
    assert want != hf_greedy(model_dir, PROMPTS)
    assert [g.tokens for g in rollout.generator.generate(PROMPTS, greedy)] == want


def test_the_stream_to_a_rollout_pool_sends_the_adapters_alone(one_rank, model_dir, tmp_path):
    """A rollout pool of its own: the actor's WeightSending streams `sync_params` (the adapters) and the replica
    (PooledRolloutWorker, HF engine built from the model's files) loads them with load_adapter; the bytes are the
    adapters', and the replica's checksum is the trainer's (what StreamedWeightSync compares to admit a rebuilt
    replica). Both ends in this process: the receiver on a thread, over the stream's own gloo group."""
    import threading

    from hybridflow.roles.actor import ActorWorker
    from hybridflow.roles.config import actor_config
    from hybridflow.roles.rollout import PooledRolloutWorker

    config = actor_config(_lora_job(model_dir).spec)
    ctx = WorkerContext(0, 1, 0, "cpu")
    actor = ActorWorker(ctx, config, str(model_dir))
    replica = PooledRolloutWorker(ctx, config, [], str(model_dir))
    with torch.no_grad():
        for name, p in actor.engine.module.named_parameters():
            if ".lora_B." in name:
                p.add_(0.3)
    trained = {n: t.clone() for n, t in actor.engine.sync_params()}
    got: dict[str, dict[str, float]] = {}

    def receive() -> None:
        replica.join_weight_stream(host, port, [0], 10.0)
        got["stats"] = replica.sync_weights(1)

    host, port = actor.open_weight_stream(2, 10.0)
    thread = threading.Thread(target=receive)
    thread.start()
    actor.join_weight_stream([0], 10.0)
    sent = actor.send_weights(1, "float32")
    thread.join(60)
    assert sent["bytes"] == got["stats"]["bytes"] == got["stats"]["generation_bytes"] == nbytes(trained)
    assert replica.weight_checksums() == actor.weight_checksums_as("float32") == {
        "adapter": lora.adapter_checksum(trained.items(), torch.float32)}
    lora.write_adapter(tmp_path / "peft", trained.items(), SETTINGS, "qwen2", str(model_dir))
    want = hf_greedy(model_dir, PROMPTS, tmp_path / "peft")
    assert [g.tokens for g in replica.generator.generate(PROMPTS, [GREEDY] * len(PROMPTS))] == want
