"""Generation engines: token ids in, token ids out, weights replaced in memory after every actor update.

vLLM runs in-process on every rank of the actor's worker group (its `external_launcher` executor joins our own
torch.distributed world), so the colocated actor can hand it new weights without a reload from disk.
"""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol, Sequence

import torch

from hybridflow.capacity import kv_cache_bytes


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    log_probs: bool = False  # also return each token's log-prob (vLLM's first such call costs seconds of set-up)


@dataclass
class Generation:
    tokens: list[int]
    log_probs: list[float]  # the engine's own log-prob of each token after temperature, when asked (truncated IS)


class RolloutEngine(Protocol):
    """What the actor needs of a generation engine; every engine implements all of it."""

    instance_id: str  # made once when the engine is built: a changed id means the engine was re-created

    def generate(self, prompts: list[list[int]], cfgs: Sequence[SamplingConfig]) -> list[Generation]:
        """One response per prompt, each with its own sampling settings (e.g. sampled and greedy in one call)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights in memory from HF-named tensors (whole, or the engine's own shards)."""

    def release(self) -> None:
        """Free what generation holds that training does not need (a no-op where the engine cannot)."""

    def weight_checksums(self) -> dict[str, float]:
        """Sums of the weights it generates with, to check that a transition landed."""


def model_kv_cache_bytes(model_dir: Path, dtype: torch.dtype, sequences: int, max_len: int) -> int:
    """`kv_cache_bytes` for the HF model in `model_dir` (its config.json)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return kv_cache_bytes(cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads, head_dim,
                          torch.tensor([], dtype=dtype).element_size(), sequences, max_len)


class VLLMRollout:
    def __init__(self, model_dir: Path, max_model_len: int, dtype: str, seed: int, kv_cache_bytes: int,
                 gpu_memory_utilization: float, on_gpu: bool) -> None:
        """`kv_cache_bytes` sizes the KV cache on CPU; on GPU `gpu_memory_utilization` does (and sleep mode frees
        weights and cache during training)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import gc

        import torch.distributed as dist
        from vllm import LLM

        gc.freeze()  # vLLM's modules (~300k objects) live as long as the process: its start-up collections skip them
        self.instance_id = uuid.uuid4().hex
        kwargs: dict = {"enable_sleep_mode": True} if on_gpu else {"kv_cache_memory_bytes": kv_cache_bytes}
        if dist.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.on_gpu = on_gpu
        self.asleep = False
        self._emptied: list[tuple[torch.nn.Parameter, torch.Size]] = []  # parameters release() gave back (CPU)
        self.llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype=dtype,
            enforce_eager=True,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=1,
            gpu_memory_utilization=gpu_memory_utilization if on_gpu else 0.9,
            logprobs_mode="processed_logprobs",  # after temperature, as the trainer computes them
            **kwargs,
        )

    def generate(self, prompts: list[list[int]], cfgs: Sequence[SamplingConfig]) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError("vLLM's weights were released for training and no weights were loaded since: "
                               "the train -> generate transition (load_weights) must run before generation")

        def params(cfg: SamplingConfig) -> SamplingParams:
            return SamplingParams(
                max_tokens=cfg.max_tokens,
                temperature=0.0 if cfg.greedy else cfg.temperature,
                top_p=1.0 if cfg.greedy else cfg.top_p,
                detokenize=False,
                ignore_eos=not cfg.stop_token_ids,
                stop_token_ids=list(cfg.stop_token_ids) or None,
                logprobs=0 if cfg.log_probs else None,  # the sampled token's own log-prob
            )

        made = {cfg: params(cfg) for cfg in set(cfgs)}
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], [made[c] for c in cfgs],
                                 use_tqdm=False)
        result = []
        for o in outs:
            done = o.outputs[0]
            logprobs = [step[tok].logprob for tok, step in zip(done.token_ids, done.logprobs or [])]
            result.append(Generation(list(done.token_ids), logprobs))
        return result

    @property
    def model(self) -> torch.nn.Module:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.asleep and self.on_gpu:  # weights come back first (into fresh memory), the KV cache once in place
            self.llm.wake_up(tags=["weights"])
        for weight, shape in self._emptied:  # the reload writes into the parameters it finds: their storage again
            weight.data = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        self._emptied = []
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        runner.reload_weights(weights_iterator=iter(weights))  # on CPU this also packs every GEMM afresh
        _repack_tied_lm_head(self.model)
        if self.asleep and self.on_gpu:
            self.llm.wake_up(tags=["kv_cache"])
        self.asleep = False
        self.llm.reset_prefix_cache()

    def release(self) -> None:
        """Free the generation weights during training (the transition brings new ones anyway). On GPU: sleep mode
        level 2, weights and KV cache. On CPU vLLM has no sleep mode. Where the CPU has the kernels for it
        (AVX-512), vLLM keeps its weights only as packed GEMMs (oneDNN / sgl handles; the parameters are emptied);
        elsewhere (AVX2) its GEMMs are plain `linear` calls on the parameters. Either way reload_weights rebuilds
        both from its own record of the layers, so dropping the GEMMs and emptying the parameters frees the
        weights (SmolLM2 in bf16: 0.27 GB of resident memory per rank); the KV cache, sized from the job, stays."""
        if self.asleep:
            return
        if self.on_gpu:
            self.llm.sleep(level=2)
        else:
            for module in self.model.modules():
                if "cpu_linear" not in vars(module):
                    continue
                module.cpu_linear = _released_gemm
                weight = module._parameters.get("weight")
                if weight is not None and weight.numel():  # a plain GEMM's weight: not needed until the reload
                    self._emptied.append((weight, weight.shape))
                    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        self.asleep = True

    def weight_checksums(self) -> dict[str, float]:
        return {"embedding": float(self.model.model.embed_tokens.weight.detach().double().sum())}


def _released_gemm(*args: object, **kwargs: object) -> torch.Tensor:
    raise RuntimeError("this vLLM layer's packed weights were released for training; load_weights re-packs them")


def _repack_tied_lm_head(model: torch.nn.Module) -> None:
    """vLLM 0.32 on CPU: a tied LM head receives no weights of its own during `reload_weights`, so its GEMM
    stays packed from the *old* embedding and logits go stale (greedy output then differs from HF). Re-running
    the embedding method's post-load step re-packs it from the (already updated, shared) weight."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and hasattr(head, "cpu_linear") and method is not None:
        method.process_weights_after_loading(head)


class HFRollout:
    """Plain torch generation with a private copy of the policy: the fallback when vLLM is not available."""

    def __init__(self, model_dir: Path, dtype: str, device: torch.device, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
        self.model.eval()
        self.device = device
        self.generator_seed = seed
        self.instance_id = uuid.uuid4().hex

    def release(self) -> None:
        """The private copy is what generation runs on; nothing to give back."""

    def weight_checksums(self) -> dict[str, float]:
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
