"""Tensor-parallel generation with megatron-core layers, on the 3D-HybridEngine's generation groups.

A second GPTModel, built at t_g-way TP over the generation TP groups (strided ranks, see engines.bridge.layout),
holds exactly the generation shards the micro-DP all-gather produced; nothing else. Its weights exist only
between a train -> generate transition and the next update (`release` frees them: generate -> train moves no
data). Decoding keeps the keys and values of every layer in megatron-core's own static KV cache
(StaticInferenceContext: a prefill of the prompts, then one token per step), so a response of n tokens costs O(n)
forward tokens, not O(n^2). It generates at any t_g and any vocabulary; vLLM at t_g > 1 (engines.rollout.vllm)
needs a vocabulary it does not pad.
"""
from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Iterable, Sequence, cast

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext

from hybridflow.single_controller.context import WorkerContext
from hybridflow.engines.rollout.base import Generation, RolloutSetup, SamplingConfig
from hybridflow.engines.train import megatron_model as mm
from hybridflow.engines.train.base import ModelParallelTrainEngine
from hybridflow.engines.train.megatron import attention_inputs
from hybridflow.engines import collectives


def build(ctx: WorkerContext, setup: RolloutSetup) -> MegatronRollout:
    """Layers of the training engine's shape on the transfer's generation TP group, in the model's dtype (megatron
    computes in its weights' dtype). It starts empty: its weights only ever come from a transition, so the first
    one runs here. Registered as fed by model-parallel trainers only (the spec's rules hold it to that)."""
    if setup.trainer is None or setup.transfer is None:
        raise ValueError("megatron generation runs beside its megatron actor (it is fed training shards): place "
                         "rollout on the actor's pool")
    trainer = cast(ModelParallelTrainEngine, setup.trainer)
    group, ranks = setup.transfer.generation_group
    engine = MegatronRollout(trainer.shape, setup.model_dtype, group, ranks, setup.seed, trainer.device)
    setup.transfer.push(engine)
    return engine


class MegatronRollout:
    def __init__(self, shape: mm.DecoderShape, dtype: str, tp_group: dist.ProcessGroup, tp_ranks: list[int],
                 seed: int, device: torch.device) -> None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection.use_mpu_process_groups()
        pgs.tp = pgs.tp_cp = tp_group
        self.group, self.leader, self.tp = tp_group, tp_ranks[0], len(tp_ranks)
        self.device = device
        cfg = mm.transformer_config(shape, getattr(torch, dtype), tp=self.tp, pp=1)
        self.model = mm.build_gpt(cfg, shape, pg_collection=pgs).to(device).eval()
        self.model.requires_grad_(False)
        # sampling happens on the model's device: the sampled tokens are broadcast over the TP group, whose backend
        # (NCCL on GPU) serves that device (a CPU tensor there failed on every GPU node)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.params = dict(self.model.named_parameters())
        self.shapes = {k: p.shape for k, p in self.params.items()}
        self.instance_id = uuid.uuid4().hex
        self.release()

    @property
    def resident_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def release(self) -> None:
        """Generate -> train: drop the generation shards (training never dropped its own)."""
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Install generation shards (megatron names, this rank's TP part) as the parameters' storage, no copy."""
        seen = set()
        for name, t in weights:
            if name not in self.shapes:
                raise KeyError(f"generation engine has no parameter {name}")
            if t.shape != self.shapes[name]:
                raise ValueError(f"{name}: generation shard {tuple(t.shape)} != expected {tuple(self.shapes[name])}")
            self.params[name].data = t.to(self.device)
            seen.add(name)
        if seen != set(self.shapes):
            raise KeyError(f"generation shards missing: {sorted(set(self.shapes) - seen)[:3]}")

    def load_adapter(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Refused: these layers hold megatron shards with no LoRA modules (and the megatron trainer trains none)."""
        raise NotImplementedError("spec.training.lora: megatron generation takes no LoRA adapters; use "
                                  "spec.rollout.engine vllm or hf (with spec.training.engine fsdp)")

    def weight_checksums(self) -> dict[str, float]:
        """Sums of every whole (TP-gathered) tensor: tests compare them with training's (collective over TP)."""
        return {name: self._checksum(name) for name in sorted(self.shapes)}

    def _checksum(self, name: str) -> float:
        t = self.params[name].detach()
        if mm.split_rule(name) != "replicated" and self.tp > 1:
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            collectives.all_gather(parts, t.contiguous(), group=self.group)
            t = mm.unshard(name, parts)
        return float(t.double().sum())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], cfgs: Sequence[SamplingConfig]) -> list[Generation]:
        """Rows may differ only in `greedy` (ReMax's baseline rows): one decode loop serves them all."""
        if len({replace(c, greedy=False) for c in cfgs}) > 1:
            raise ValueError("megatron generation takes one sampling setting per call (rows may differ in greedy)")
        cfg = cfgs[0]
        dev = self.device
        greedy_rows = torch.tensor([c.greedy for c in cfgs], device=dev)
        B = len(prompts)
        P = max(len(p) for p in prompts)
        ids = torch.zeros(B, P, dtype=torch.long)
        keep = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            keep[i, P - len(p):] = 1
        ids, keep = ids.to(dev), keep.to(dev)
        stops = torch.tensor(list(cfg.stop_token_ids) or [-1], device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        out = [Generation([], []) for _ in range(B)]
        cache = StaticInferenceContext(max_batch_size=B, max_sequence_length=P + cfg.max_tokens)
        x, pos, mask = attention_inputs({"input_ids": ids, "attention_mask": keep})
        for _ in range(cfg.max_tokens):
            # the prompts' keys and values at the first step, then the one new token's (older ones are cached)
            # (megatron gathers the vocabulary's TP shards of the logits itself when it infers)
            logits = self.model(x, pos, attention_mask=mask, inference_context=cache,
                                runtime_gather_output=True)[:, -1, :].float()
            cache.sequence_len_offset += x.shape[1]
            cache.enable_decode_mode()
            nxt = self._sample(logits, cfg).where(~greedy_rows, logits.argmax(-1))
            collectives.broadcast(nxt, src=self.leader, group=self.group)  # one decision per TP group
            logp = (logits / cfg.temperature).log_softmax(-1).gather(-1, nxt[:, None]).squeeze(-1)
            finished = done.tolist()
            for i, (token, lp) in enumerate(zip(nxt.tolist(), logp.tolist())):  # one device -> host copy each
                if not finished[i]:
                    out[i].tokens.append(token)
                    if cfg.log_probs:
                        out[i].log_probs.append(lp)
            done |= torch.isin(nxt, stops)
            if bool(done.all()):
                break
            keep = torch.cat([keep, torch.ones(B, 1, dtype=torch.long, device=dev)], 1)
            x = nxt[:, None]
            pos = torch.full((B, 1), keep.shape[1] - 1, dtype=torch.long, device=dev)  # (RoPE: absolute)
            mask = ~keep.bool()[:, None, None, :]  # the new token sees every real token, no padding
        return out

    def _sample(self, logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
        if cfg.greedy:
            return logits.argmax(-1)
        probs = torch.softmax(logits / cfg.temperature, -1)
        if cfg.top_p < 1:
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > cfg.top_p
            probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
