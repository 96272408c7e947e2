"""Plain torch generation with a private copy of the policy: the fallback when vLLM is not available. With
spec.training.lora it keeps the base it loaded and takes the trainer's adapters (models.lora.inject, once)."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterable, Sequence

import torch

from hybridflow.single_controller.context import WorkerContext
from hybridflow.models import lora
from hybridflow.models.lora import LoraSettings
from hybridflow.engines.rollout.base import Generation, RolloutSetup, SamplingConfig


def build(ctx: WorkerContext, setup: RolloutSetup) -> HFRollout:
    """Its own copy of the weights in the model's dtype, on the replica's device; the process's torch seed
    is the replica's (HF samples from the global generator)."""
    torch.manual_seed(setup.seed)
    return HFRollout(setup.model_dir, setup.model_dtype, setup.device, setup.seed, setup.lora)


class HFRollout:
    """Plain torch generation with a private copy of the policy: the fallback when vLLM is not available."""

    def __init__(self, model_dir: Path, dtype: str, device: torch.device, seed: int,
                 lora_settings: LoraSettings | None = None) -> None:
        """`lora_settings`: the adapters `load_adapter` injects on first use (not here: injecting draws their
        initial values from the global generator, which is this replica's sampling stream)."""
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
        self.model.eval()
        self.device = device
        self.generator_seed = seed
        self.instance_id = uuid.uuid4().hex
        self.lora = lora_settings
        self.injected = False

    def release(self) -> None:
        """The private copy is what generation runs on; nothing to give back."""

    def weight_checksums(self) -> dict[str, float]:
        if self.lora is not None:  # the base is the model directory's: the adapter is what a sync moves
            return {"adapter": lora.adapter_checksum(self.model.named_parameters())}
        return {"embedding": float(self.model.get_input_embeddings().weight.detach().double().sum())}

    def generate(self, prompts: list[list[int]], cfgs: Sequence[SamplingConfig]) -> list[Generation]:
        out: list[Generation | None] = [None] * len(prompts)
        for cfg in dict.fromkeys(cfgs):  # one model.generate per distinct setting, in first-seen order
            rows = [i for i, c in enumerate(cfgs) if c == cfg]
            for i, g in zip(rows, self._generate([prompts[i] for i in rows], cfg)):
                out[i] = g
        return [g for g in out if g is not None]

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], cfg: SamplingConfig) -> list[Generation]:
        pad = 0
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, P - len(p) :] = torch.tensor(p)
            mask[i, P - len(p) :] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=cfg.max_tokens,
            min_new_tokens=0 if cfg.stop_token_ids else cfg.max_tokens,
            do_sample=not cfg.greedy,
            temperature=cfg.temperature if not cfg.greedy else None,
            top_p=cfg.top_p if not cfg.greedy else None,
            top_k=0 if not cfg.greedy else None,
            eos_token_id=list(cfg.stop_token_ids) or None,
            pad_token_id=pad,
            output_scores=cfg.log_probs,  # the processed (temperature-scaled) scores each token was sampled from
            return_dict_in_generate=True,
        )
        tokens = out.sequences[:, P:]
        if cfg.log_probs:
            logprobs = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
        else:
            logprobs = torch.zeros(tokens.shape)
        responses = []
        for row, lps in zip(tokens.tolist(), logprobs.tolist()):
            resp = []
            for tok in row:
                resp.append(tok)
                if tok in cfg.stop_token_ids:
                    break
            responses.append(Generation(resp, lps[: len(resp)] if cfg.log_probs else []))
        return responses

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                if name in params:
                    params[name].copy_(t)

    def load_adapter(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """The adapters copied into the model's own (injected on the first call, then kept: eval mode again, so a
        spec's dropout never drops at generation). A name the model has no adapter of is an error: the trainer's
        target modules and these differ."""
        if self.lora is None:
            raise RuntimeError("load_adapter on an HF generation engine built without spec.training.lora")
        if not self.injected:
            lora.inject(self.model, self.lora)
            self.model.eval()
            self.injected = True
        params = dict(self.model.named_parameters())
        loaded = 0
        with torch.no_grad():
            for name, t in tensors:
                if name not in params or not lora.is_adapter(name):
                    raise KeyError(f"the HF generation engine has no adapter {name!r} (spec.training.lora)")
                params[name].copy_(t)
                loaded += t.numel() * t.element_size()
        return loaded
