"""vLLM generation, in-process on every rank of the actor's worker group (its `external_launcher` executor joins our
own torch.distributed world), so the colocated actor hands it new weights without a reload from disk."""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterable, Sequence

import torch

from hybridflow.capacity import GIB, KV_BLOCK_TOKENS
from hybridflow.single_controller.context import WorkerContext
from hybridflow.engines.precision import dtype_name
from hybridflow.engines.rollout.base import Generation, RolloutSetup, SamplingConfig, model_kv_cache_bytes


def build(ctx: WorkerContext, setup: RolloutSetup) -> VLLMRollout:
    """The KV cache is `kvCacheGib`, or sized for the most sequences one call on this replica holds."""
    r = setup.rollout
    max_len = r.max_prompt_length + r.max_response_length
    kv_bytes = int(r.kv_cache_gib * GIB) or model_kv_cache_bytes(setup.model_dir, setup.generation_dtype,
                                                                  setup.sequences, max_len)
    return VLLMRollout(setup.model_dir, max_model_len=max_len, dtype=dtype_name(setup.generation_dtype),
                       seed=setup.seed, kv_cache_bytes=kv_bytes, gpu_memory_utilization=r.gpu_memory_utilization,
                       on_gpu=ctx.device == "gpu", prefix_caching=r.prefix_caching)


class VLLMRollout:
    def __init__(self, model_dir: Path, max_model_len: int, dtype: str, seed: int, kv_cache_bytes: int,
                 gpu_memory_utilization: float, on_gpu: bool, prefix_caching: bool = True) -> None:
        """`kv_cache_bytes` sizes the KV cache on CPU; on GPU `gpu_memory_utilization` does (and sleep mode frees
        weights and cache during training)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import gc

        import torch.distributed as dist
        from vllm import LLM

        gc.freeze()  # vLLM's modules (~300k objects) live as long as the process: its start-up collections skip them
        self.instance_id = uuid.uuid4().hex
        # prefix caching: the n responses of a prompt (and an agent's next turn) reuse its KV blocks; on CPU in
        # blocks of KV_BLOCK_TOKENS. load_weights resets the cache: KV computed by older weights is never reused.
        kwargs: dict = {"enable_sleep_mode": True} if on_gpu else {"kv_cache_memory_bytes": kv_cache_bytes,
                                                                    "block_size": KV_BLOCK_TOKENS}
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
            enable_prefix_caching=prefix_caching,
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
        level 2, weights and KV cache. On CPU vLLM has no sleep mode. Where its build has the kernels (oneDNN, on
        the AVX-512 and the AVX2 machines seen here; sgl with AMX), vLLM keeps its weights only as packed GEMMs (the
        handles; the parameters are emptied); elsewhere its GEMMs are plain `linear` calls on the parameters.
        Either way reload_weights rebuilds both from its own record of the layers, so dropping the GEMMs and
        emptying the parameters frees the weights (SmolLM2 in bf16: 0.27 GB of resident memory per rank); the KV
        cache, sized from the job, stays."""
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


