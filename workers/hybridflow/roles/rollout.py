"""The rollout role: generates with the policy, and takes the policy's new weights after every update.

It is its own role so that the controller addresses generation and training apart (the seam asynchronous training
needs), while it runs exactly where it did: colocated with the actor, built right after it in the same process
(the worker host hands it the actor object: RoleSpec.colocated). The weights move in memory, zero-copy where they
did, by the bridge's weight transfer for the (train kind, rollout kind) pair (engines.bridge.transfer), which reads
the actor's training engine and writes this role's generation engine; and generation memory is freed before every
actor update through the release this role hands the actor. A rollout on a pool of its own needs a transfer across
processes: that would be a transfer the bridge picks, not a change here (the spec still refuses that placement).
"""
from __future__ import annotations

import time
from dataclasses import replace

from hybridflow.data.packing import pack_rollout, pad_log_probs
from hybridflow.engines.bridge.transfer import weight_transfer
from hybridflow.engines.precision import dtype_name
from hybridflow.engines.rollout.base import RolloutEngine, RolloutEngineFactory, RolloutSetup, SamplingConfig
from hybridflow.roles.actor import ActorWorker
from hybridflow.roles.config import ActorConfig
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.context import WorkerContext
from hybridflow.single_controller.protocol import Dispatch, DPRank, register


class RolloutWorker:
    """The generation engine of the policy (vLLM, plain HF, megatron layers at generation TP size t_g), built by its
    kind's factory beside the colocated actor's training engine."""

    def __init__(self, ctx: WorkerContext, config: ActorConfig, stop_token_ids: list[int],
                 actor: ActorWorker) -> None:
        self.ctx, self.config = ctx, config
        t, r = config.training, config.rollout
        self.transfer = weight_transfer(ctx, config.train_engine, config.rollout_engine, actor.engine,
                                        t.tensor_parallel, r.tensor_parallel)
        self.generation_dtype = actor.engine.compute_dtype
        self.stop_token_ids = tuple(stop_token_ids)
        seed = config.seed + 1000 * self.transfer.generation_replica  # distinct sampling streams per replica
        build_rollout: RolloutEngineFactory = config.rollout_engine.load()
        self.generator: RolloutEngine = build_rollout(ctx, RolloutSetup(
            actor.model_dir, r, config.model.dtype, self.generation_dtype, seed,
            sequences=-(-config.generation_batch // self.transfer.generation_replicas), trainer=actor.engine,
            transfer=self.transfer))
        actor.before_training(self.generator.release)

    def dp_rank(self, mesh: str) -> DPRank:
        """Generation replicas ("rollout") can outnumber training replicas ("train") under the 3D-HybridEngine."""
        return self.transfer.dp_rank(mesh)

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
        out = self.generator.generate(prompts, [greedy_cfg if g else sampled for g in flags]) if prompts else []
        packed = pack_rollout(prompts, [g.tokens for g in out], r.max_prompt_length, r.max_response_length)
        if want_log_probs:
            packed["rollout_log_probs"] = pad_log_probs([g.log_probs for g in out], r.max_response_length)
        result = Batch(packed, batch.non_tensors)
        result.meta["generate_seconds"] = time.perf_counter() - t0
        return result

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict[str, float]:
        """Train -> generate, in memory, through the bridge. Returns what this rank received, the largest transient
        buffer it held, and the generation weights it now holds (bytes), plus seconds."""
        t0 = time.perf_counter()
        stats = self.transfer.push(self.generator)
        return {"seconds": time.perf_counter() - t0, "bytes": float(stats.bytes_received),
                "peak_bytes": float(stats.peak_transient_bytes), "generation_bytes": float(stats.generation_bytes)}

    @register(Dispatch.RANK_ZERO)
    def generation_dtype_name(self) -> str:
        """The dtype generation computes in, as computeDtype auto resolved on these ranks."""
        return dtype_name(self.generation_dtype)

    @register(Dispatch.ONE_TO_ALL)
    def weight_checksums(self) -> dict[str, float]:
        """Sums of the generation engine's whole tensors: lets tests see that a transition really landed.
        megatron generation: every parameter; vLLM/HF: the embedding."""
        return self.generator.weight_checksums()

    @register(Dispatch.ONE_TO_ALL)
    def instance_id(self) -> str:
        """This rank's generation engine's id, made when the engine was built: equal ids across calls prove the
        weights were swapped in place, not by building a new engine."""
        return self.generator.instance_id

    @register(Dispatch.ONE_TO_ALL)
    def train_checksum(self) -> dict[str, float]:
        """The same sums over the training engine's weights as the generation engine holds them, i.e. in its dtype
        (collective under TP): the bridge's view of what a push delivers."""
        return self.transfer.train_checksums(self.generation_dtype)
