"""The judge role: a generative model that answers the reward's questions (spec.models.reward.judge), one engine
replica per rank of its pool, built from the judge's own files and never synced (its weights do not train).

It only generates: the controller fills the template, renders it with the judge's tokenizer, caches verdicts and
parses answers (hybridflow.rewards.judge), so what a worker does is one greedy engine call per shard of requests.
On its own pool it runs beside nothing; on a pool with other roles it shares their processes (a second vLLM in a
process runs beside the rollout's: both join the process's torch.distributed world as vLLM's external launcher).
"""
from __future__ import annotations

from hybridflow.engines.precision import compute_dtype
from hybridflow.engines.rollout.base import RolloutEngine, RolloutEngineFactory, RolloutSetup, SamplingConfig
from hybridflow.models.builders import local_model_dir
from hybridflow.roles.config import JudgeConfig
from hybridflow.roles.rollout import torch_device
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.context import WorkerContext
from hybridflow.single_controller.protocol import Dispatch, DPRank, register


class JudgeWorker:
    def __init__(self, ctx: WorkerContext, config: JudgeConfig, model_dir: str, stop_token_ids: list[int]) -> None:
        self.ctx, self.config = ctx, config
        here = local_model_dir(model_dir, config.model, config.seed)
        dtype = compute_dtype(config.compute_dtype, ctx.device, model_dtype=config.model.dtype)
        build: RolloutEngineFactory = config.rollout_engine.load()
        self.generator: RolloutEngine = build(ctx, RolloutSetup(
            here, config.rollout, config.model.dtype, dtype, seed=config.seed + 1000 * ctx.rank,
            sequences=config.sequences, device=torch_device(ctx), trainer=None, transfer=None))
        self.sampling = SamplingConfig(config.rollout.max_response_length, greedy=True,
                                       stop_token_ids=tuple(stop_token_ids))

    def dp_rank(self, mesh: str) -> DPRank:
        return DPRank(self.ctx.rank, self.ctx.world_size, True)

    @register(Dispatch.DP_COMPUTE)
    def judge(self, batch: Batch) -> Batch:
        """Greedy answers to this rank's share of the questions, `sequences` at a time."""
        prompts = [list(p) for p in batch["judge_prompt_ids"]]
        answers: list[list[int]] = []
        step = self.config.sequences
        for i in range(0, len(prompts), step):
            part = prompts[i:i + step]
            answers += [g.tokens for g in self.generator.generate(part, [self.sampling] * len(part))]
        return Batch(non_tensors={"verdict_ids": answers})
