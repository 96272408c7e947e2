"""The actor role: trains the policy (FSDP2) and generates with it (vLLM or HF) on the same devices.

Training and generation share a process, so the train -> generate transition is a gather of the FSDP shards
straight into the running generation engine (`sync_rollout_weights`), with no files and no engine restart.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridflow.algorithms.core import (
    entropy_from_logits,
    kl_estimate,
    masked_mean,
    ppo_policy_loss,
)
from hybridflow.controller.batch import Batch
from hybridflow.controller.protocol import Dispatch, register
from hybridflow.controller.worker_group import WorkerContext
from hybridflow.data.packing import pack_rollout
from hybridflow.engines.fsdp import FSDPEngine, response_logits, token_log_probs
from hybridflow.engines.rollout import HFRollout, SamplingConfig, VLLMRollout
from hybridflow.roles.common import CheckpointMixin, load_causal_lm, peak_memory_bytes
from hybridflow.spec import JobSpec


class ActorRolloutWorker(CheckpointMixin):
    checkpoint_name = "actor"

    def __init__(self, ctx: WorkerContext, spec: dict[str, Any], model_dir: str, stop_token_ids: list[int]) -> None:
        self.ctx = ctx
        self.spec = JobSpec.model_validate(spec)
        torch.manual_seed(self.spec.trainer.seed)
        t, r = self.spec.training, self.spec.rollout
        model = load_causal_lm(Path(model_dir), self.spec.models.actor.dtype)
        self.engine = FSDPEngine(model, t.actor_lr, t.grad_clip, ctx.device)
        self.stop_token_ids = tuple(stop_token_ids)
        seed = self.spec.trainer.seed + 1000 * ctx.rank  # distinct sampling streams per data-parallel rank
        if r.engine == "vllm":
            self.rollout: Any = VLLMRollout(
                Path(model_dir),
                max_model_len=r.max_prompt_length + r.max_response_length,
                dtype=self.spec.models.actor.dtype,
                seed=seed,
                kv_cache_gib=r.kv_cache_gib,
                gpu_memory_utilization=r.gpu_memory_utilization,
                on_gpu=ctx.device == "gpu",
            )
        else:
            torch.manual_seed(seed)
            self.rollout = HFRollout(Path(model_dir), self.spec.models.actor.dtype, self.engine.device, seed)

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def generate(self, batch: Batch, greedy: bool = False) -> Batch:
        """Prompts (non-tensor column `prompt_ids`) -> packed prompt+response tensors; other columns pass through."""
        r = self.spec.rollout
        cfg = SamplingConfig(r.max_response_length, r.temperature, r.top_p, greedy, self.stop_token_ids)
        t0 = time.perf_counter()
        prompts = [list(p) for p in batch["prompt_ids"]]
        responses = self.rollout.generate(prompts, cfg) if prompts else []
        out = Batch(pack_rollout(prompts, responses, r.max_prompt_length, r.max_response_length), batch.non_tensors)
        out.meta["generate_seconds"] = time.perf_counter() - t0
        return out

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_log_prob(self, batch: Batch) -> Batch:
        temp = self.spec.rollout.temperature

        def fn(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            logits = response_logits(model, mb, temp)
            return token_log_probs(logits, mb["responses"]), entropy_from_logits(logits)

        outs = self.engine.forward_micro(batch, self.spec.training.micro_batch_size, fn)
        return Batch({"old_log_probs": torch.cat([o[0] for o in outs]).cpu(), "entropy": torch.cat([o[1] for o in outs]).cpu()})

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's shard; returns averaged loss statistics."""
        spec, t = self.spec, self.spec.training
        algo, temp = spec.algorithm, spec.rollout.temperature
        kl_loss = algo.kl_in == "loss" and algo.kl_coef > 0

        def loss_fn(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            mask = mb["response_mask"]
            logits = response_logits(model, mb, temp)
            logp = token_log_probs(logits, mb["responses"])
            pl = ppo_policy_loss(logp, mb["old_log_probs"], mb["advantages"], mask, t.clip_ratio)
            loss = pl.loss
            stats = {"pg_loss": pl.loss.item(), "clip_frac": pl.clip_frac.item(), "approx_kl": pl.approx_kl.item()}
            if algo.entropy_coef > 0:
                ent = masked_mean(entropy_from_logits(logits), mask)
                loss = loss - algo.entropy_coef * ent
            if kl_loss:
                kl = masked_mean(kl_estimate(logp, mb["ref_log_probs"], algo.kl_estimator), mask)
                loss = loss + algo.kl_coef * kl
                stats["kl_loss"] = kl.item()
            return loss, stats

        out = self.engine.ppo_update(batch, spec, loss_fn)
        out["peak_memory_bytes"] = float(peak_memory_bytes())
        return out

    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> dict[str, float]:
        """Train -> generate: gather the FSDP shards into the generation engine, in memory."""
        t0 = time.perf_counter()
        nbytes = 0

        def weights():
            nonlocal nbytes
            for name, tensor in self.engine.full_params():
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.rollout.load_weights(weights())
        return {"seconds": time.perf_counter() - t0, "bytes": float(nbytes)}

    @register(Dispatch.RANK_ZERO)
    def num_parameters(self) -> int:
        return int(sum(p.numel() for p in self.engine.module.parameters()))  # DTensor.numel() is the global size

    @register(Dispatch.ONE_TO_ALL)
    def rollout_checksum(self) -> float:
        """Sum of the generation engine's copy of the embedding: lets tests see that a sync really landed."""
        if isinstance(self.rollout, HFRollout):
            emb = self.rollout.model.get_input_embeddings().weight
        else:
            emb = self.rollout.model.model.embed_tokens.weight
        return float(emb.detach().double().sum())

    @register(Dispatch.ONE_TO_ALL)
    def train_checksum(self) -> float:
        for name, tensor in self.engine.full_params():
            if "embed_tokens" in name:
                return float(tensor.double().sum())
        raise KeyError("no embedding parameter found")
