"""The actor role: trains the policy and generates with it on the same devices.

Training runs on FSDP2 or megatron-core (tensor x data parallel). Generation runs on vLLM, plain HF, or megatron
layers at a generation TP size t_g. The train -> generate transition happens in memory with no files and no engine
restart (`sync_rollout_weights`):
* FSDP: gather each parameter whole into the generation engine;
* megatron: the 3D-HybridEngine all-gathers inside micro-DP groups, one layer at a time, into generation shards.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridflow.algorithms.core import masked_mean
from hybridflow.capacity import GIB
from hybridflow.algorithms.kl import KL_ESTIMATORS
from hybridflow.algorithms.losses import LOSS_AGGREGATIONS, POLICY_LOSSES, ClipConfig, truncated_is_weights
from hybridflow.controller.batch import Batch
from hybridflow.controller.protocol import Dispatch, DPRank, register
from hybridflow.controller.worker_group import WorkerContext
from hybridflow.data.packing import pack_rollout, pad_log_probs
from hybridflow.engines import megatron_model as mm
from hybridflow.engines.precision import compute_dtype, dtype_name
from hybridflow.engines.rollout import HFRollout, RolloutEngine, SamplingConfig, VLLMRollout, model_kv_cache_bytes
from hybridflow.flops import matmul_peak_flops, training_flops
from hybridflow.hybrid_engine.reshard import ReshardStats
from hybridflow.models.builders import local_model_dir
from hybridflow.roles.common import CheckpointMixin, load_causal_lm, peak_memory_bytes, release_free_memory
from hybridflow.roles.config import ActorConfig


class ActorRolloutWorker(CheckpointMixin):
    checkpoint_name = "actor"

    def __init__(self, ctx: WorkerContext, config: ActorConfig, model_dir: str, stop_token_ids: list[int]) -> None:
        self.ctx = ctx
        self.config = config
        torch.manual_seed(config.seed)
        t, r = config.training, config.rollout
        dtype = config.model.dtype
        model_dir = str(local_model_dir(model_dir, config.model, config.seed))
        self.model_dir = Path(model_dir)
        self.hybrid: Any = None
        self.rollout: RolloutEngine
        if t.engine == "megatron":
            from hybridflow.engines.megatron import MegatronEngine
            from hybridflow.hybrid_engine.engine import HybridEngine
            from hybridflow.hybrid_engine.layout import Layout

            self.engine: Any = MegatronEngine(Path(model_dir), dtype, t.tensor_parallel, t.actor_lr, t.grad_clip,
                                              ctx.device, config.seed)
            self.engine.dynamic_batch_size = t.dynamic_batch_size
            layout = Layout(p=1, t=t.tensor_parallel, d=ctx.world_size // t.tensor_parallel, p_g=1,
                            t_g=r.tensor_parallel)
            self.hybrid = HybridEngine(layout, ctx.rank)
            replica, replicas = self.hybrid.generation_replica, layout.d * layout.t // layout.t_g
            gen_dtype = dtype  # megatron computes in its weights' dtype
        else:
            from hybridflow.engines.fsdp import FSDPEngine

            self.engine = FSDPEngine(load_causal_lm(Path(model_dir), dtype), t.actor_lr, t.grad_clip, ctx.device,
                                     compute_dtype=compute_dtype(t.compute_dtype, ctx.device),
                                     dynamic_batch_size=t.dynamic_batch_size)
            replica, replicas = ctx.rank, ctx.world_size
            gen_dtype = dtype_name(self.engine.compute_dtype)
        release_free_memory()  # the whole model it loaded before sharding
        self.generation_dtype = getattr(torch, gen_dtype)
        self.parameters = self._count_parameters()
        self.peak_flops = matmul_peak_flops(self.generation_dtype, ctx.device)  # MFU's denominator, per rank
        self.stop_token_ids = tuple(stop_token_ids)
        seed = config.seed + 1000 * replica  # distinct sampling streams per generation replica
        if r.engine == "vllm":
            max_len = r.max_prompt_length + r.max_response_length
            kv_bytes = int(r.kv_cache_gib * GIB) or model_kv_cache_bytes(
                Path(model_dir), self.generation_dtype, -(-config.generation_batch // replicas), max_len)
            self.rollout = VLLMRollout(
                Path(model_dir),
                max_model_len=max_len,
                dtype=gen_dtype,
                seed=seed,
                kv_cache_bytes=kv_bytes,
                gpu_memory_utilization=r.gpu_memory_utilization,
                on_gpu=ctx.device == "gpu",
            )
        elif r.engine == "megatron":
            from hybridflow.engines.megatron_rollout import MegatronRollout

            self.rollout = MegatronRollout(self.engine.shape, dtype, self.hybrid.gen_tp_group,
                                           self.hybrid.gen_tp_ranks, seed, self.engine.device)
            self.sync_rollout_weights()  # it starts empty: its weights only ever come from a transition
        else:
            torch.manual_seed(seed)
            self.rollout = HFRollout(Path(model_dir), dtype, self.engine.device, seed)

    def dp_rank(self, mesh: str) -> DPRank:
        if self.hybrid is not None:
            return self.hybrid.dp_rank(mesh)
        return DPRank(self.ctx.rank, self.ctx.world_size, True)

    @register(Dispatch.DP_COMPUTE, blocking=False, mesh="rollout")
    def generate(self, batch: Batch, greedy: bool = False) -> Batch:
        """Prompts (non-tensor column `prompt_ids`; rows flagged in `greedy` decode greedily) -> packed
        prompt+response tensors and the engine's own log-probs; other columns pass through."""
        r = self.config.rollout
        # Truncated IS compares the engine's log-probs with the trainer's; evaluation (greedy=True) needs none.
        want_log_probs = self.config.algorithm.tis_cap is not None and not greedy
        sampled = SamplingConfig(r.max_response_length, r.temperature, r.top_p, greedy, self.stop_token_ids,
                                 want_log_probs)
        greedy_cfg = replace(sampled, greedy=True)
        flags = batch["greedy"] if "greedy" in batch else [greedy] * len(batch)
        t0 = time.perf_counter()
        prompts = [list(p) for p in batch["prompt_ids"]]
        out = self.rollout.generate(prompts, [greedy_cfg if g else sampled for g in flags]) if prompts else []
        packed = pack_rollout(prompts, [g.tokens for g in out], r.max_prompt_length, r.max_response_length)
        if want_log_probs:
            packed["rollout_log_probs"] = pad_log_probs([g.log_probs for g in out], r.max_response_length)
        result = Batch(packed, batch.non_tensors)
        result.meta["generate_seconds"] = time.perf_counter() - t0
        return result

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_log_prob(self, batch: Batch) -> Batch:
        temp = self.config.rollout.temperature

        def fn(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            logp, logits = self.engine.log_probs(model, mb, temp)
            return logp, self.engine.entropy(logits)

        logp, entropy = self.engine.forward_micro(batch, self.config.training.micro_batch_size, fn)
        return Batch({"old_log_probs": logp.cpu(), "entropy": entropy.cpu()})

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """Epochs over mini-batches of this rank's shard with the algorithm's policy loss and aggregation; returns
        averaged loss statistics. The KL coefficient comes with the batch (an adaptive controller moves it).

        A batch without old log-probs is an on-policy update (`old_log_probs_from_update`): each token's old
        log-prob is its first forward pass's, detached, and the statistics that would have been taken from the
        separate pass (entropy, KL, the rollout gap) come from this one."""
        c, t = self.config, self.config.training
        on_policy = "old_log_probs" not in batch
        if on_policy and not c.old_log_probs_from_update:
            raise ValueError("update_actor got no old_log_probs, and this update is not on-policy (more than one "
                             "epoch or mini-batch): the old_log_prob stage must run first")
        algo, temp = c.algorithm, c.rollout.temperature
        policy_loss, aggregate = POLICY_LOSSES[algo.policy_loss or ""], LOSS_AGGREGATIONS[algo.loss_agg or ""]
        per, max_len = LOSS_AGGREGATIONS.info(algo.loss_agg or "")["per"], c.rollout.max_response_length
        kl_estimate = KL_ESTIMATORS[algo.kl_estimator]
        clip = ClipConfig(algo.clip_ratio_low or t.clip_ratio, algo.clip_ratio_high or t.clip_ratio, algo.dual_clip)
        kl_coef = float(batch.meta.get("kl_coef", algo.kl_coef))
        kl_loss = algo.kl_in == "loss" and kl_coef > 0
        self.rollout.release()  # generate -> train: generation memory goes, training shards never left
        release_free_memory()

        def loss_fn(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            mask = mb["response_mask"]
            logp, logits = self.engine.log_probs(model, mb, temp)
            old = logp.detach() if on_policy else mb["old_log_probs"]
            pl = policy_loss(logp, old, mb["advantages"], mask, clip)
            token_loss = pl.loss
            if algo.tis_cap is not None:
                token_loss = token_loss * truncated_is_weights(old, mb["rollout_log_probs"], algo.tis_cap)
            loss = aggregate(token_loss, mask, max_len)
            stats = {"pg_loss": loss.item(), "clip_frac": masked_mean(pl.clipped.float(), mask).item(),
                     "approx_kl": masked_mean(old - logp, mask).item()}
            if on_policy:
                stats.update(_old_log_prob_stats(self.engine, old, logits, mb, algo.kl_estimator))
            if pl.dual_clipped is not None:
                stats["dual_clip_frac"] = masked_mean(pl.dual_clipped.float(), mask).item()
            if algo.entropy_coef > 0:
                ent = masked_mean(self.engine.entropy(logits), mask)
                loss = loss - algo.entropy_coef * ent
            if kl_loss:
                kl = aggregate(kl_estimate(logp, mb["ref_log_probs"]), mask, max_len)
                loss = loss + kl_coef * kl
                stats["kl_loss"] = kl.item()
            return loss, stats

        out = self.engine.ppo_update(batch, t, c.prompts_per_step, loss_fn, per)
        release_free_memory()  # activations: generation comes next
        out["peak_memory_bytes"] = float(peak_memory_bytes())
        tokens = float(batch["attention_mask"].sum()) * t.ppo_epochs
        out["update_flops_per_s"] = training_flops(self.parameters, tokens) / max(out["update_seconds"], 1e-9)
        out["mfu"] = out["update_flops_per_s"] / self.peak_flops
        return out

    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> dict[str, float]:
        """Train -> generate, in memory. Returns what this rank received, the largest transient buffer it held,
        and the generation weights it now holds (bytes), plus seconds."""
        t0 = time.perf_counter()
        stats = ReshardStats()
        if self.hybrid is not None:
            shards = self.hybrid.transition(self.engine.named_shards(), stats)
            if self.config.rollout.engine == "megatron":  # megatron layers take megatron-named TP shards
                self.rollout.load_weights(shards)
            else:  # t_g = 1 into an engine that speaks HF names: the generation shards are whole tensors
                self.rollout.load_weights(mm.megatron_to_hf_items(shards, self.engine.shape))
        else:
            def whole():
                for name, tensor in self.engine.full_params():
                    n = tensor.numel() * tensor.element_size()
                    stats.generation_bytes += n
                    stats.peak_transient_bytes = max(stats.peak_transient_bytes, n)
                    yield name, tensor

            self.rollout.load_weights(whole())
            world = self.ctx.world_size
            stats.bytes_received = stats.generation_bytes * (world - 1) // world
        return {"seconds": time.perf_counter() - t0, "bytes": float(stats.bytes_received),
                "peak_bytes": float(stats.peak_transient_bytes), "generation_bytes": float(stats.generation_bytes)}

    @register(Dispatch.RANK_ZERO)
    def num_parameters(self) -> int:
        return self.parameters

    @register(Dispatch.RANK_ZERO)
    def generation_dtype_name(self) -> str:
        """The dtype generation computes in, as computeDtype auto resolved on these ranks."""
        return dtype_name(self.generation_dtype)

    def _count_parameters(self) -> int:
        if self.hybrid is not None:  # collective: every rank counts at start
            return int(sum(t.numel() for _, t in self.engine.full_params()))
        return int(sum(p.numel() for p in self.engine.module.parameters()))  # DTensor.numel() is the global size

    @register(Dispatch.ONE_TO_ALL)
    def rollout_checksum(self) -> dict[str, float]:
        """Sums of the generation engine's whole tensors: lets tests see that a transition really landed.
        megatron generation: every parameter; vLLM/HF: the embedding."""
        return self.rollout.weight_checksums()

    @register(Dispatch.ONE_TO_ALL)
    def rollout_instance(self) -> str:
        """This rank's generation engine's id, made when the engine was built: equal ids across calls prove the
        weights were swapped in place, not by building a new engine."""
        return self.rollout.instance_id

    @register(Dispatch.ONE_TO_ALL)
    def train_checksum(self) -> dict[str, float]:
        """The same sums over the training engine's weights as the generation engine holds them, i.e. in its dtype
        (collective under TP)."""
        if self.hybrid is not None:
            sums = {n: float(self.engine.gather_tp(n, t).double().sum()) for n, t in self.engine.named_shards()}
            if self.config.rollout.engine == "megatron":
                return dict(sorted(sums.items()))
            return {"embedding": sums["embedding.word_embeddings.weight"]}
        for name, tensor in self.engine.full_params():
            if "embed_tokens" in name:
                return {"embedding": float(tensor.to(self.generation_dtype).double().sum())}
        raise KeyError("no embedding parameter found")


@torch.no_grad()
def _old_log_prob_stats(engine: Any, old: torch.Tensor, logits: torch.Tensor, mb: Batch,
                        kl_estimator: str) -> dict[str, float]:
    """What the summary reads from old log-probs (step.py), for an update that made them itself."""
    mask = mb["response_mask"]
    # Row by row: the update's activations are all alive here, and a whole-batch entropy would add four fp32
    # (B, R, vocabulary) temporaries on top of them at the step's memory peak.
    entropy = torch.cat([engine.entropy(row) for row in logits.detach().split(1)])
    out = {"entropy_mean": masked_mean(entropy, mask).item()}
    if "ref_log_probs" in mb:
        out["kl_mean"] = masked_mean(KL_ESTIMATORS[kl_estimator](old, mb["ref_log_probs"]), mask).item()
    if "rollout_log_probs" in mb:
        out["rollout_log_prob_gap"] = masked_mean((old - mb["rollout_log_probs"]).abs(), mask).item()
    return out
