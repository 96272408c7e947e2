"""The actor role: trains the policy (updates, log-probs, checkpoints); the rollout role (roles.rollout) generates
with it.

The training engine comes from the registry (hybridflow.api.engines: FSDP2, megatron-core tensor x data parallel)
through its kind's factory. The rollout role is built right after it in the same process and reads this engine
through the bridge's weight transfer; before training, the actor frees the memory the generation beside it holds
(the releases it was handed in `before_training`), so both share the devices as one fused worker did.
"""
from __future__ import annotations

import gc
import os
import time
from typing import Callable

import torch
from torch import nn

from hybridflow.algorithms.core import masked_mean
from hybridflow.algorithms.kl import KL_ESTIMATORS
from hybridflow.algorithms.losses import LOSS_AGGREGATIONS, POLICY_LOSSES, ClipConfig
from hybridflow.api import Algorithm
from hybridflow.checkpoint.role import CheckpointMixin
from hybridflow.data.packing import computed_tokens
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.protocol import Dispatch, DPRank, register
from hybridflow.single_controller.context import WorkerContext
from hybridflow.engines.bridge.stream import (
    StreamRendezvous, WeightSender, WeightStreamError, pool_peers, stream_group,
)
from hybridflow.engines.bridge.transfer import full_tensor_checksums, train_dp_rank
from hybridflow.models.lora import LoraSettings
from hybridflow.engines.train.base import InertRows, TrainEngine, TrainEngineFactory, TrainSettings
from hybridflow.flops import matmul_peak_flops, training_flops
from hybridflow.profiling import PROFILE, profiled
from hybridflow.models.builders import local_model_dir
from hybridflow.roles.common import memory_phase, release_free_memory
from hybridflow.roles.config import ActorConfig, off_policy_correction
from hybridflow.roles.reference import reference_log_probs


class ActorWorker(CheckpointMixin):
    checkpoint_name = "actor"

    def __init__(self, ctx: WorkerContext, config: ActorConfig, model_dir: str) -> None:
        self.ctx = ctx
        self.config = config
        torch.manual_seed(config.seed)
        t = config.training
        self.model_dir = local_model_dir(model_dir, config.model, config.seed)
        build_trainer: TrainEngineFactory = config.train_engine.load()
        self.engine: TrainEngine = build_trainer(ctx, TrainSettings(
            self.model_dir, config.model.dtype, lr=t.actor_lr, grad_clip=t.grad_clip, compute_dtype=t.compute_dtype,
            dynamic_batch_size=t.dynamic_batch_size, shared_prompt=t.shared_prompt, tensor_parallel=t.tensor_parallel,
            pipeline_parallel=t.pipeline_parallel, seed=config.seed, lora=LoraSettings.from_spec(t.lora),
            keep_gathered_for_backward=t.keep_gathered_for_backward,
            reduce_gradients_per_step=t.reduce_gradients_per_step, fp32_attention_backward=t.fp32_attention_backward))
        self._dp_rank = train_dp_rank(ctx, config.train_engine, t.tensor_parallel, t.pipeline_parallel)
        release_free_memory()  # the whole model it loaded before sharding
        self.parameters = self.engine.num_parameters()  # collective where the engine gathers to count
        self.trained = self.engine.num_trained_parameters()  # with LoRA the adapters: the update's weight gradients
        self.peak_flops = 0.0  # MFU's denominator, this rank's: measured at its first update (update_actor)
        self._releases: list[Callable[[], None]] = []
        self._log_prob_peak = 0  # the peak of this step's log-prob passes, reported with the update
        self.stream = WeightSending(ctx, self.engine)

    def dp_rank(self, mesh: str) -> DPRank:
        """The training layout's coordinate (the actor's methods are all split by "train")."""
        return self._dp_rank

    def before_training(self, release: Callable[[], None]) -> None:
        """A role on these devices (the colocated rollout) hands over how to free its memory: every update calls it
        first, so generation memory goes before training needs it."""
        self._releases.append(release)

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_log_prob(self, batch: Batch) -> Batch:
        temp = self.config.rollout.temperature

        def fn(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            logp, logits = self.engine.log_probs(model, mb, temp)
            return logp, self.engine.entropy(logits)

        with memory_phase() as phase:  # its own peak: not generation's, nor vLLM's start-up profiling
            logp, entropy = self.engine.forward_micro(batch, self.config.training.micro_batch_size, fn)
        self._log_prob_peak = max(self._log_prob_peak, phase.bytes)
        return Batch({"old_log_probs": logp.cpu(), "entropy": entropy.cpu()})

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """The reference stage of a LoRA actor (trainer.setup routes "reference" here): the base policy is this
        model with its adapters switched off, so no second copy of it is held."""
        if self.engine.lora is None:
            raise ValueError("compute_ref_log_prob on the actor needs spec.training.lora (the reference policy is "
                             "then the actor's base); without it the reference role runs its own model")
        with self.engine.adapters_off():
            return reference_log_probs(self.engine, batch, self.config.training.micro_batch_size,
                                       self.config.rollout.temperature)

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
        skipped = zero_gradient_rows(batch, algo, kl_loss) if t.skip_zero_advantage_rows else None
        inert = None if skipped is None else InertRows(skipped, ADVANTAGE_WEIGHTED_STATS)
        for release in self._releases:  # generate -> train: generation memory goes, training shards never left
            release()
        if not self.peak_flops:  # here, not at start: every rank has loaded and started generation, and measures
            # beside the others as the update runs beside them, on the threads the update computes on
            self.peak_flops = matmul_peak_flops(self.engine.compute_dtype, self.ctx.device)
        release_free_memory()
        correction = off_policy_correction(algo)

        def loss_fn(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            mask = mb["response_mask"]
            logp, logits = self.engine.log_probs(model, mb, temp)
            old = logp.detach() if on_policy else mb["old_log_probs"]  # the proximal policy: the PPO ratio's base
            pl = policy_loss(logp, old, mb["advantages"], mask, clip)
            token_loss, stats = pl.loss, dict[str, float]()
            if correction is not None:  # the behaviour policy's log-probs enter only through the weights
                corrected = correction(old, mb["rollout_log_probs"], mask)
                token_loss, stats = token_loss * corrected.weights, dict(corrected.stats)
            loss = aggregate(token_loss, mask, max_len)
            stats.update(pg_loss=loss.item(), clip_frac=masked_mean(pl.clipped.float(), mask).item(),
                         approx_kl=masked_mean(old - logp, mask).item())
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

        # the profiler outside the memory phase: its event buffers are not the update's memory
        with profiled("update", bool(batch.meta.get(PROFILE))) as profile, memory_phase() as phase:
            out = self.engine.ppo_update(batch, t, c.prompts_per_step, loss_fn, per, inert)
        out.update(profile)
        release_free_memory()  # activations: generation comes next
        out["peak_memory_bytes"] = float(phase.bytes)
        if self._log_prob_peak:
            out["log_prob_peak_memory_bytes"], self._log_prob_peak = float(self._log_prob_peak), 0
        computed = batch if skipped is None else batch.index(torch.nonzero(~skipped).flatten())
        out["update_rows_skipped"] = 1.0 - len(computed) / max(len(batch), 1)
        tokens = float(computed_tokens(computed, self.engine.shared_prompt)) * t.ppo_epochs
        out["update_flops_per_s"] = training_flops(self.parameters, tokens, self.trained) / max(out["update_seconds"], 1e-9)
        # the job's MFU sums these (flops.pooled_mfu), not the ranks' ratios. The statistics come from one rank of
        # each model-parallel replica (its TP x PP ranks computed the replica's FLOPs together): its peak is theirs
        out["peak_flops"] = self.peak_flops * (self.ctx.world_size // self._dp_rank.dp_size)
        out["mfu"] = out["update_flops_per_s"] / out["peak_flops"]
        return out

    @register(Dispatch.RANK_ZERO)
    def num_parameters(self) -> int:
        return self.parameters

    @register(Dispatch.RANK_ZERO)
    def open_weight_stream(self, size: int, timeout_s: float) -> tuple[str, int]:
        """A rollout pool of its own: rank 0 serves the stream's rendezvous for `size` members (itself and every
        rollout replica in the group); returns where. Again for every new group (a replica lost or replaced)."""
        return self.stream.open(size, timeout_s)

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def join_weight_stream(self, members: list[int], timeout_s: float) -> None:
        """Rank 0 joins as the sender to the rollout ranks `members` (blocks until every one of them joined)."""
        self.stream.join(members, timeout_s)

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self, version: int, dtype: str) -> dict[str, float]:
        """The current weights as policy `version`, in generation dtype `dtype`, to every rollout rank."""
        return self.stream.send(version, getattr(torch, dtype))

    @register(Dispatch.ONE_TO_ALL)
    def weight_checksums_as(self, dtype: str) -> dict[str, float]:
        """The sums a rollout engine fed whole tensors reports once these weights landed (collective)."""
        return full_tensor_checksums(self.engine, getattr(torch, dtype))


# The update's statistics that are 0 on a row of zero advantage (the policy loss is a multiple of it, and neither
# clip branch is taken there): their whole-batch value needs no row that skipZeroAdvantageRows leaves out.
ADVANTAGE_WEIGHTED_STATS = frozenset({"pg_loss", "clip_frac", "dual_clip_frac"})


def zero_gradient_rows(batch: Batch, algo: Algorithm, kl_loss: bool) -> torch.Tensor | None:
    """The rows whose policy loss has no gradient (training.skipZeroAdvantageRows): every advantage on their
    response tokens exactly zero (a GRPO group whose samples all scored the same), under a loss that is a multiple
    of the advantage with nothing else per token (no entropy bonus, no KL term). None where the loss is not such."""
    if algo.entropy_coef > 0 or kl_loss or not POLICY_LOSSES.info(algo.policy_loss or "").get("advantage_weighted"):
        return None
    return ((batch["advantages"] == 0) | (batch["response_mask"] == 0)).all(dim=1)


@torch.no_grad()
def _old_log_prob_stats(engine: TrainEngine, old: torch.Tensor, logits: torch.Tensor, mb: Batch,
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


class WeightSending:
    """The actor's side of the cross-pool weight stream (a rollout pool of its own): every rank gathers whole
    tensors (sync_params is collective: every weight, or with LoRA the adapters alone, the replicas holding the
    base from the model's files), rank 0 streams them, cast to the generation dtype, to every rollout rank."""

    def __init__(self, ctx: WorkerContext, engine: TrainEngine) -> None:
        self.ctx, self.engine = ctx, engine
        self.rendezvous: StreamRendezvous | None = None
        self.sender: WeightSender | None = None

    def open(self, size: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0 serves the stream's rendezvous at its pool's address (where the pool's own rendezvous is)."""
        if self.ctx.rank != 0:
            return "", 0
        self.rendezvous = StreamRendezvous(os.environ.get("MASTER_ADDR", "127.0.0.1"), size, timeout_s)
        return self.rendezvous.host, self.rendezvous.port

    def join(self, members: list[int], timeout_s: float) -> None:
        if self.ctx.rank == 0:
            assert self.rendezvous is not None, "open the stream first"
            peers = pool_peers(members)
            device = self.engine.device
            self.sender = None  # a group formed before (other members) is left
            group = stream_group(self.rendezvous.store, 0, len(peers), timeout_s, device)
            self.sender = WeightSender(group, device, timeout_s=timeout_s, peers=peers)

    def send(self, version: int, dtype: torch.dtype) -> dict[str, float]:
        t0 = time.perf_counter()
        whole = ((name, t.to(dtype)) for name, t in self.engine.sync_params())
        if self.ctx.rank != 0:
            for _ in whole:  # the gathers are collective: every rank takes part, rank 0 alone sends
                pass
            return {"seconds": time.perf_counter() - t0, "bytes": 0.0, "peak_bytes": 0.0}
        assert self.sender is not None, "join the stream first"
        failed: tuple[type[WeightStreamError], str] | None = None
        try:
            stats = self.sender.send(version, whole)
        except WeightStreamError as e:
            failed = (type(e), str(e))  # its kind kept: WeightStreamBroken is a worker loss, the others not
        if failed is not None:  # out of the except block: nothing holds the broken group any more but the sender
            for _ in whole:  # the other ranks' gathers run to the end: the actor's own world stays usable
                pass
            self.sender = None  # its group closes its connections: receivers still waiting fail now, not at the
            gc.collect()        # stream's timeout (gloo's abort and shutdown leave them waiting)
            raise failed[0](failed[1])
        return {"seconds": stats.seconds, "bytes": float(stats.bytes), "peak_bytes": float(stats.peak_transient_bytes)}
