"""One process (one gloo rank, megatron's parallel state its own) that runs the megatron engine with LoRA
(engines.train.megatron_lora) on a small HF model and saves what tests/engines/test_megatron_lora.py asserts:
log-probs fresh, after updates and with the adapters off against the plain engine's, the base and the adapters
before and after, the synced adapters' log-probs under HF + peft, the merged weights against peft's merge, a sharded
and a single-file checkpoint round trip, and a bf16 engine's dtypes.

    python -m support.megatron_lora <model_dir> <out.pt> <workdir>   (cwd tests/, as the generation one runs)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hybridflow.engines.train.base import TrainSettings
from hybridflow.engines.train.fsdp import response_logits, token_log_probs
from hybridflow.engines.train.megatron import MegatronEngine
from hybridflow.engines.train.megatron_build import build
from hybridflow.models import lora
from hybridflow.models.lora import LoraSettings
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.context import WorkerContext

from support.megatron_inputs import tiny_batch
from support.megatron_launcher import objective

SETTINGS = LoraSettings(rank=4, alpha=8.0)


def engine(model_dir: Path, dtype: str = "float32", settings: LoraSettings | None = SETTINGS) -> MegatronEngine:
    return build(WorkerContext(0, 1, 0, "cpu"), TrainSettings(model_dir, dtype, lr=1e-2, grad_clip=1e9,
                                                              lora=settings))


def log_probs(e: MegatronEngine, batch: Batch) -> torch.Tensor:
    return e.forward_micro(batch, 2, lambda model, mb: e.log_probs(model, mb, 1.0)[0])


def update(e: MegatronEngine, batch: Batch) -> None:
    def loss_fn(model, mb):
        lp, logits = e.log_probs(model, mb, 1.0)
        loss = objective(lp, e.entropy(logits))
        return loss, {"loss": loss.detach()}

    e.train_mini_batch(batch, 2, loss_fn)


def split(e: MegatronEngine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, adapters), megatron names, copies."""
    named = {n: p.detach().clone() for n, p in e.named_parameters()}
    return ({n: t for n, t in named.items() if not lora.is_adapter(n)},
            {n: t for n, t in named.items() if lora.is_adapter(n)})


def peft_log_probs(model_dir: Path, adapters: dict[str, torch.Tensor], directory: Path, batch: Batch,
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The synced adapters written as a PEFT directory and loaded by peft onto the HF model: its log-probs, and its
    weights merged by peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora.write_adapter(directory, adapters.items(), SETTINGS, lora.model_type(model_dir), str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, str(directory)).eval()
    with torch.no_grad():
        logp = token_log_probs(response_logits(model, batch, 1.0), batch["responses"])
    merged = model.merge_and_unload()
    return logp, {n: t.detach().clone() for n, t in merged.state_dict().items()}


class AdapterRecorder:
    """A generation engine double that keeps what a weight sync hands it (whole weights are refused)."""

    def __init__(self) -> None:
        self.adapters: dict[str, torch.Tensor] = {}

    def load_adapter(self, tensors) -> int:
        self.adapters = {n: t.clone() for n, t in tensors}
        return sum(t.numel() * t.element_size() for t in self.adapters.values())

    def load_weights(self, weights) -> None:
        raise AssertionError("a LoRA sync sent whole weights")


def push(e: MegatronEngine) -> tuple[dict[str, torch.Tensor], tuple[dict, dict]]:
    """The megatron trainer's transfer (the 3D-HybridEngine's, at TP 1) into an HF-named generation engine: what it
    delivered, and the checksums the trainer expects against the adapters' own."""
    from hybridflow.api.engines import ROLLOUT_ENGINES, TRAIN_ENGINES
    from hybridflow.engines.bridge.transfer import weight_transfer

    transfer = weight_transfer(WorkerContext(0, 1, 0, "cpu"), TRAIN_ENGINES["megatron"], ROLLOUT_ENGINES["hf"], e,
                               1, 1)
    rollout = AdapterRecorder()
    transfer.push(rollout)
    return rollout.adapters, (transfer.train_checksums(torch.float32),
                              {"adapter": lora.adapter_checksum(rollout.adapters.items(), torch.float32)})


def main(model_dir: Path, out: Path, work: Path) -> None:
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=0, world_size=1)
    batch = Batch(tiny_batch())
    plain = engine(model_dir, settings=None)
    e = engine(model_dir)
    got: dict = {"plain": log_probs(plain, batch), "fresh": log_probs(e, batch)}
    got["base_before"], got["adapters_before"] = split(e)
    got["requires_grad"] = sorted(n for n, p in e.named_parameters() if p.requires_grad)
    got["stepped"] = sorted(n for n, p in e.trained_parameters())
    got["masters"] = e.masters is not None
    update(e, batch)
    update(e, batch)  # lora_B starts at zero, so lora_A moves from the second step on
    got["base_after"], got["adapters_after"] = split(e)
    got["moments"] = sorted({id(p) for p in e.optimizer.state} ^ {id(p) for _, p in e.trained_parameters()})
    got["updated"] = log_probs(e, batch)
    with e.adapters_off():
        got["off"] = log_probs(e, batch)
    got["synced"] = dict(e.sync_params())
    got["peft"], peft_merged = peft_log_probs(model_dir, got["synced"], work / "adapter", batch)
    got["merged"], got["peft_merged"] = dict(e.full_params()), peft_merged
    got["num_parameters"] = (e.num_parameters(), plain.num_parameters())
    got["num_trained_parameters"] = (e.num_trained_parameters(), plain.num_trained_parameters())
    got["pushed"], got["checksums"] = push(e)

    state = e.checkpoint_state()
    got["checkpoint_model"] = sorted(state["model"])
    got["checkpoint_optimizer"] = sorted(state["optimizer"]["state"])
    dcp.save(state, checkpoint_id=str(work / "sharded"))
    whole = e.state_dict()
    fresh = engine(model_dir)
    template = fresh.checkpoint_state()
    dcp.load(template, checkpoint_id=str(work / "sharded"))
    fresh.load_checkpoint_state(template)
    other = engine(model_dir)
    other.load_state_dict(whole)
    got["restored"], got["restored_whole"] = log_probs(fresh, batch), log_probs(other, batch)
    for x in (e, fresh, other):  # one more step each: equal moments give equal adapters
        update(x, batch)
    got["stepped_after_restore"] = [split(x)[1] for x in (e, fresh, other)]

    bf16 = engine(model_dir, "bfloat16")
    base, adapters = split(bf16)
    update(bf16, batch)
    update(bf16, batch)
    got["bf16"] = {"base": sorted({str(t.dtype) for t in base.values()}),
                   "adapters": sorted({str(t.dtype) for t in adapters.values()}), "masters": bf16.masters is not None,
                   "moments": sorted({str(s[k].dtype) for s in bf16.optimizer.state.values()
                                      for k in ("exp_avg", "exp_avg_sq")}),
                   "base_kept": all(torch.equal(t, split(bf16)[0][n]) for n, t in base.items()),
                   "adapters_moved": all(not torch.equal(t, split(bf16)[1][n]) for n, t in adapters.items())}
    torch.save(got, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
