"""The rollout role: generates with the policy, and takes the policy's new weights after every update.

Two placements, one generation code:

* `RolloutWorker`, colocated (the default): built right after the actor in the same processes (the worker host
  hands it the actor object: RoleSpec.colocated). The weights move in memory, zero-copy where they can, by the
  bridge's weight transfer for the (train kind, rollout kind) pair (engines.bridge.transfer); generation memory is
  freed before every actor update through the release this role hands the actor.
* `PooledRolloutWorker`, on a resource pool of its own (spec.placement.rollout): one generation replica per device,
  its engine built from the model's files, its weights received after every update over the cross-pool weight
  stream (engines.bridge.stream) that the actor's rank 0 sends, tagged with a policy version. Generation and
  training then run at the same time on different devices (rollout modes one_step_off and async).

Both count the policy version they generate with (0: the initial weights; +1 per sync) and report it with every
generation, so the controller tags each token with the version that produced it.

With spec.training.lora both build their engine with the LoRA settings: it generates with the base from the model's
files (version 0: the trainer's adapters start as a no-op) and every sync, in memory or streamed, brings the
adapters alone (the trainer's `sync_params`) into its `load_adapter`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from hybridflow.data.packing import pack_rollout, pad_log_probs, versions_of
from hybridflow.engines.bridge.stream import (
    WeightReceiver, WeightStreamError, pool_peers, stream_group, stream_store,
)
from hybridflow.engines.bridge.transfer import weight_transfer
from hybridflow.models.lora import LoraSettings
from hybridflow.engines.precision import compute_dtype, dtype_name
from hybridflow.engines.rollout.base import (
    Generation, RolloutEngine, RolloutEngineFactory, RolloutSetup, SamplingConfig,
)
from hybridflow.models.builders import local_model_dir
from hybridflow.profiling import GENERATION_PROFILE, PROFILE, profiled
from hybridflow.roles.actor import ActorWorker
from hybridflow.roles.common import memory_in_use_bytes
from hybridflow.roles.config import ActorConfig, wants_rollout_log_probs
from hybridflow.roles.episodes import NON_TENSOR_COLUMNS, ROW_SOURCE, EpisodeRunner
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.context import WorkerContext
from hybridflow.single_controller.protocol import Dispatch, DPRank, register


@dataclass
class _Generator:
    """What both placements generate with: the engine, the sampling settings, the version it holds."""

    generator: RolloutEngine
    config: ActorConfig
    stop_token_ids: tuple[int, ...]
    version: int = 0
    episodes: EpisodeRunner | None = None  # multi-turn rollouts (spec.rollout.agent)

    @classmethod
    def of(cls, generator: RolloutEngine, config: ActorConfig, stop_token_ids: list[int],
           model_dir: Any) -> "_Generator":
        """The engine's generator, with its episode runner when the job's rollouts are multi-turn."""
        agent = config.rollout.agent
        runner = None if agent is None else EpisodeRunner.build(agent, model_dir, config.chat_template,
                                                                stop_token_ids, config.rollout.max_response_length,
                                                                config.private_paths)
        return cls(generator, config, tuple(stop_token_ids), episodes=runner)

    def sampling(self, greedy: bool, log_probs: bool, max_tokens: int | None = None) -> SamplingConfig:
        r = self.config.rollout
        return SamplingConfig(max_tokens or r.max_response_length, r.temperature, r.top_p, greedy,
                              self.stop_token_ids, log_probs)

    def wants_log_probs(self, greedy: bool) -> bool:
        """The engine's own log-probs: for an off-policy correction, and always when generation runs apart from training
        (the trainer compares its policy with the one that sampled). Evaluation (greedy) needs none."""
        c = self.config
        return not greedy and (wants_rollout_log_probs(c.algorithm) or c.rollout.mode != "sync")

    def packed(self, batch: Batch, greedy: bool) -> Batch:
        """Prompts (non-tensor column `prompt_ids`; rows flagged in `greedy` decode greedily) -> packed
        prompt+response tensors and the engine's own log-probs; other columns pass through."""
        want = self.wants_log_probs(greedy)
        sampled = self.sampling(greedy, want)
        flags = batch["greedy"] if "greedy" in batch else [greedy] * len(batch)
        t0 = time.perf_counter()
        prompts = [list(p) for p in batch["prompt_ids"]]
        with profiled("generate", bool(batch.meta.get(PROFILE))) as profile:
            packed = self._generated(batch, prompts, list(flags), sampled, want)
        # this rank's rows, tagged by the version it holds (ranks of one call may hold different versions)
        packed["token_versions"] = versions_of(packed["response_mask"], self.version)
        apart = {k: packed.pop(k) for k in NON_TENSOR_COLUMNS if k in packed}  # an episode's failure: not a tensor
        source = packed.pop(ROW_SOURCE, None)  # an agent program's episode may be several rows: its columns repeat
        given = batch.non_tensors if source is None else {k: v[source] for k, v in batch.non_tensors.items()}
        result = Batch(packed, {**given, **apart})
        result.meta["generate_seconds"] = time.perf_counter() - t0
        if profile:
            result.meta[GENERATION_PROFILE] = profile
        return result

    def _generated(self, batch: Batch, prompts: list[list[int]], flags: list[bool], sampled: SamplingConfig,
                   want: bool) -> dict[str, Any]:
        """The packed rollout of `prompts` (rows flagged greedy decode greedily): the episode runner's when the
        job's rollouts are multi-turn, one engine call otherwise."""
        r = self.config.rollout
        if self.episodes is not None:
            return self.episodes.run(self.generator, self.sampling, batch, flags, want, r.max_prompt_length)
        greedy_cfg = replace(sampled, greedy=True)
        out = self.generator.generate(prompts, [greedy_cfg if g else sampled for g in flags]) if prompts else []
        packed = pack_rollout(prompts, [g.tokens for g in out], r.max_prompt_length, r.max_response_length)
        if want:
            packed["rollout_log_probs"] = pad_log_probs([g.log_probs for g in out], r.max_response_length)
        return packed

    def continued(self, batch: Batch) -> dict[str, Any]:
        """Partial rollouts: each row's prompt plus the response so far (`prompt_ids`, `response_ids`), at most
        `max_new` more tokens each; returns the new tokens and log-probs per row (unpacked: the controller joins
        the pieces) and the version that made them."""
        t0 = time.perf_counter()
        contexts = [list(p) + list(s) for p, s in zip(batch["prompt_ids"], batch["response_ids"])]
        cfgs = [self.sampling(bool(g), not g, int(n)) for g, n in zip(batch["greedy"], batch["max_new"])]
        out: list[Generation] = self.generator.generate(contexts, cfgs) if contexts else []
        return {"tokens": [g.tokens for g in out], "log_probs": [g.log_probs for g in out],
                "policy_version": self.version, "seconds": time.perf_counter() - t0}


class RolloutWorker:
    """The generation engine of the policy (vLLM, plain HF, megatron layers at generation TP size t_g), built by its
    kind's factory beside the colocated actor's training engine."""

    def __init__(self, ctx: WorkerContext, config: ActorConfig, stop_token_ids: list[int],
                 actor: ActorWorker) -> None:
        self.ctx, self.config = ctx, config
        t, r = config.training, config.rollout
        self.transfer = weight_transfer(ctx, config.train_engine, config.rollout_engine, actor.engine,
                                        t.tensor_parallel, r.tensor_parallel, t.pipeline_parallel)
        self.generation_dtype = actor.engine.compute_dtype
        seed = config.seed + 1000 * self.transfer.generation_replica  # distinct sampling streams per replica
        build_rollout: RolloutEngineFactory = config.rollout_engine.load()
        generator = build_rollout(ctx, RolloutSetup(
            actor.model_dir, r, config.model.dtype, self.generation_dtype, seed,
            sequences=-(-config.generation_batch // self.transfer.generation_replicas), device=actor.engine.device,
            trainer=actor.engine, transfer=self.transfer, lora=actor.engine.lora))
        self.gen = _Generator.of(generator, config, stop_token_ids, actor.model_dir)
        self.generator = generator
        self.sleep_freed_bytes = 0.0  # what the last release freed (vLLM on GPU: sleep), reported with the sync
        self.released = False  # since the last transition
        actor.before_training(self.release)

    def release(self) -> None:
        """Generate -> train (the actor calls it before every update, a critic on these devices before its own,
        whichever comes first): the engine frees its memory (vLLM on GPU: sleep level 2; with LoRA level 1, its base
        kept in host memory), measured here so the step reports it (`rollout_sleep_freed_bytes`). Once per step:
        the next transition brings the weights back."""
        if self.released:
            return
        before = memory_in_use_bytes()
        self.generator.release()
        self.sleep_freed_bytes = float(before - memory_in_use_bytes())
        self.released = True

    def dp_rank(self, mesh: str) -> DPRank:
        """Generation replicas ("rollout") can outnumber training replicas ("train") under the 3D-HybridEngine."""
        return self.transfer.dp_rank(mesh)

    @register(Dispatch.DP_COMPUTE, blocking=False, mesh="rollout")
    def generate(self, batch: Batch, greedy: bool = False) -> Batch:
        return self.gen.packed(batch, greedy)

    @register(Dispatch.ONE_TO_ALL)
    def sync_weights(self, version: int | None = None, profile: bool = False) -> dict[str, float]:
        """Train -> generate, in memory, through the bridge, as policy `version` (default: the next). Returns what
        this rank received, the largest transient buffer it held, and the generation weights it now holds (bytes),
        plus seconds; and the memory the engine freed before the update and took back now (vLLM on GPU: sleep and
        wake). `profile`: the transition's seconds by kind of op too (hybridflow.profiling)."""
        t0 = time.perf_counter()
        before = memory_in_use_bytes()
        with profiled("reshard", profile) as profile_stats:
            stats = self.transfer.push(self.generator)
        self.released = False
        woken = memory_in_use_bytes() - before  # vLLM on GPU: weights and KV cache mapped back (wake_up)
        self.gen.version = self.gen.version + 1 if version is None else version
        return {"seconds": time.perf_counter() - t0, "bytes": float(stats.bytes_received),
                "peak_bytes": float(stats.peak_transient_bytes), "generation_bytes": float(stats.generation_bytes),
                "version": float(self.gen.version), "sleep_freed_bytes": self.sleep_freed_bytes,
                "wake_bytes": float(woken), **profile_stats}

    @register(Dispatch.RANK_ZERO)
    def generation_dtype_name(self) -> str:
        """The dtype generation computes in, as computeDtype auto resolved on these ranks."""
        return dtype_name(self.generation_dtype)

    @register(Dispatch.ONE_TO_ALL)
    def weight_checksums(self) -> dict[str, float]:
        """Sums of the generation engine's whole tensors: lets tests see that a transition really landed.
        megatron generation: every parameter; vLLM/HF: the embedding (with LoRA: the adapter)."""
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


class PooledRolloutWorker:
    """One generation replica per device of the rollout pool, its engine built from the model's files (the same
    initial weights as the actor's: version 0), its later weights received from the actor's stream."""

    def __init__(self, ctx: WorkerContext, config: ActorConfig, stop_token_ids: list[int], model_dir: str) -> None:
        self.ctx, self.config = ctx, config
        r = config.rollout
        self.generation_dtype = compute_dtype(config.training.compute_dtype, ctx.device,
                                              model_dtype=config.model.dtype)
        device = torch_device(ctx)
        build_rollout: RolloutEngineFactory = config.rollout_engine.load()
        here = local_model_dir(model_dir, config.model, config.seed)
        generator = build_rollout(ctx, RolloutSetup(
            here, r, config.model.dtype, self.generation_dtype,
            seed=config.seed + 1000 * ctx.rank, sequences=-(-config.generation_batch // ctx.world_size),
            device=device, trainer=None, transfer=None, lora=LoraSettings.from_spec(config.training.lora)))
        self.gen = _Generator.of(generator, config, stop_token_ids, here)
        self.generator = generator
        self.receiver: WeightReceiver | None = None

    def dp_rank(self, mesh: str) -> DPRank:
        return DPRank(self.ctx.rank, self.ctx.world_size, True)

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def join_weight_stream(self, host: str, port: int, members: list[int], timeout_s: float) -> int:
        """Join the actor's stream, whose receivers are the rollout ranks `members`, as group rank 1 + this rank's
        place among them (collective with every member: blocks until all joined; a group this rank was in before
        is left). Returns the version held."""
        peers = pool_peers(members)
        size = len(peers)
        self.receiver = None
        store = stream_store(host, port, size, timeout_s)
        device = torch_device(self.ctx)
        group = stream_group(store, 1 + members.index(self.ctx.rank), size, timeout_s, device)
        self.receiver = WeightReceiver(group, 0, device, timeout_s, peers)
        return self.gen.version

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def sync_weights(self, version: int) -> dict[str, float]:
        """Receive policy `version` from the actor's stream into the engine, in place (between generations: a
        Ray actor runs one call at a time, so this is a safe point)."""
        if self.receiver is None:
            raise RuntimeError("sync_weights before join_weight_stream")
        load = self.generator.load_weights if self.config.training.lora is None else self.generator.load_adapter
        try:
            stats = self.receiver.sync(load)
        except WeightStreamError as e:  # the group is unusable now: the controller forms a new one, or recovers
            raise type(e)(f"{e} [waiting for policy version {version}]") from e
        if stats.version != version:
            raise WeightStreamError(f"rollout rank {self.ctx.rank}: received policy version {stats.version}, the "
                                    f"controller announced {version}")
        self.gen.version = version
        return {"seconds": stats.seconds, "bytes": float(stats.bytes), "peak_bytes": float(stats.peak_transient_bytes),
                "generation_bytes": float(stats.bytes), "version": float(version)}

    @register(Dispatch.DP_COMPUTE, blocking=False, mesh="rollout")
    def generate(self, batch: Batch, greedy: bool = False) -> Batch:
        return self.gen.packed(batch, greedy)

    @register(Dispatch.DP_COMPUTE, blocking=False, mesh="rollout")
    def continue_generation(self, batch: Batch) -> dict[str, Any]:
        return self.gen.continued(batch)

    @register(Dispatch.RANK_ZERO)
    def generation_dtype_name(self) -> str:
        return dtype_name(self.generation_dtype)

    @register(Dispatch.ONE_TO_ALL)
    def weight_checksums(self) -> dict[str, float]:
        return self.generator.weight_checksums()

    @register(Dispatch.ONE_TO_ALL)
    def instance_id(self) -> str:
        return self.generator.instance_id

    @register(Dispatch.ONE_TO_ALL)
    def policy_version(self) -> int:
        return self.gen.version


def torch_device(ctx: WorkerContext) -> Any:
    import torch

    return torch.device("cuda", ctx.local_rank) if ctx.device == "gpu" else torch.device("cpu")
