"""vLLM generation, in-process on every rank of the actor's worker group (its `external_launcher` executor joins our
own torch.distributed world), so the colocated actor hands it new weights without a reload from disk.

At tensor-parallel size t_g > 1 it generates on the 3D-HybridEngine's generation groups, which are strided ranks of
the training layout, while vLLM forms its groups from consecutive ranks: it is started with the world's ranks listed
in generation-group order (`ranks_in_order`), so each of its TP groups is one generation group. Each transition
then hands it this rank's generation shard under HF names, installed as its own TP shard (q/k/v and gate/up fused
as vLLM packs them), never a whole tensor (both in engines/rollout/vllm_tp.py).

vLLM is reached through its public API only (`LLM.collective_rpc`, `LLM.apply_model`): in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) these run on the engine's one worker in this process and hand it our objects as
they are (weight iterators, the model back), unpickled. Weights are always copied into the storage vLLM allocated:
on a GPU that storage belongs to sleep mode's allocator (what `sleep` unmaps and `wake_up` maps back) and is what
captured CUDA graphs read, so new storage would be neither freed by sleep nor seen by the graphs.

With spec.training.lora the base never comes from the trainer: every sync brings the trainer's adapters
(`load_adapter`), written as a PEFT adapter directory and registered as a new `LoRARequest` (a new id and name per
version) that every generation passes (vLLM's LoRA path, CPU included: punica_cpu). The base is loaded from the model
directory; on a GPU it sleeps through the update in host memory, on a CPU (no sleep mode) it is released as a full
fine-tuning job's weights are and read back from the model directory at the transition."""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch

from hybridflow.capacity import GIB, KV_BLOCK_TOKENS
from hybridflow.single_controller.context import WorkerContext
from hybridflow.engines.precision import dtype_name
from hybridflow.models import lora
from hybridflow.models.lora import LoraSettings
from hybridflow.engines.rollout.base import Generation, RolloutSetup, SamplingConfig, model_kv_cache_bytes
from hybridflow.engines import collectives
from hybridflow.engines.rollout.vllm_tp import (check_vocabulary_shards, install_shards_in_worker,
                                                 ranks_in_order)

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest


def build(ctx: WorkerContext, setup: RolloutSetup) -> VLLMRollout:
    """The KV cache is `kvCacheGib`, or sized for the most sequences one call on this replica holds."""
    r = setup.rollout
    max_len = r.max_prompt_length + r.max_response_length
    kv_bytes = int(r.kv_cache_gib * GIB) or model_kv_cache_bytes(setup.model_dir, setup.generation_dtype,
                                                                  setup.sequences, max_len)
    rank_order = None
    if r.tensor_parallel > 1:
        if setup.transfer is None:
            raise ValueError("spec.rollout.tensorParallel > 1: vLLM generates tensor-parallel only beside its actor, "
                             "on the 3D-HybridEngine's generation groups")
        rank_order = [rank for group in setup.transfer.generation_groups for rank in group]
    on_gpu = ctx.device == "gpu"
    return VLLMRollout(setup.model_dir, max_model_len=max_len, dtype=dtype_name(setup.generation_dtype),
                       seed=setup.seed, kv_cache_bytes=kv_bytes, gpu_memory_utilization=r.gpu_memory_utilization,
                       on_gpu=on_gpu, prefix_caching=r.prefix_caching,
                       tensor_parallel=r.tensor_parallel, rank_order=rank_order,
                       enforce_eager=enforce_eager(r.cuda_graphs, on_gpu, r.tensor_parallel), lora=setup.lora)


def vllm_lora_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for spec.training.lora.rank: vLLM 0.32 accepts only the ranks of its
    `MaxLoRARanks` (1, 8, 16, 32, 64, 128, 256, 320, 512), so the next one up (an adapter of a lower rank runs
    zero-padded in its buffers: the same output, a little more memory); above its largest, refused."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    accepted = sorted(get_args(MaxLoRARanks))
    for allowed in accepted:
        if allowed >= rank:
            return allowed
    raise ValueError(f"spec.training.lora.rank = {rank}: vLLM serves LoRA ranks up to {accepted[-1]}; use a lower "
                     f"rank or spec.rollout.engine: hf")


def enforce_eager(cuda_graphs: str, on_gpu: bool, tensor_parallel: int) -> bool:
    """vLLM's `enforce_eager` for spec.rollout.cudaGraphs (auto | on | off). CUDA graphs make GPU decode 2-4x faster,
    and they survive weight syncs because every sync copies into the storage they captured (module docstring).
    auto: graphs on a GPU at t_g = 1 (vLLM's own reload_weights, which keeps that storage: reload/layerwise.py);
    eager at t_g > 1, whose in-place shard path has not run with graphs on a GPU yet (`on` asks for it). On CPU
    always eager: vLLM's CPU build captures no graphs (platforms/cpu.py empties cudagraph_capture_sizes), and
    without enforce_eager it compiles the model with torch.compile/inductor at start-up instead, a cost our CPU
    runs never measured as paying back, so `on` there is refused (rules: spec.rollout.cudaGraphs) and raises here."""
    if cuda_graphs not in ("auto", "on", "off"):
        raise ValueError(f"spec.rollout.cudaGraphs = {cuda_graphs!r}: use auto, on or off")
    if cuda_graphs == "off":
        return True
    if not on_gpu:
        if cuda_graphs == "on":
            raise ValueError("spec.rollout.cudaGraphs = on: CUDA graphs need a GPU, and vLLM generates on CPU here; "
                             "use auto (eager on CPU) or off")
        return True
    return cuda_graphs == "auto" and tensor_parallel > 1


class VLLMRollout:
    def __init__(self, model_dir: Path, max_model_len: int, dtype: str, seed: int, kv_cache_bytes: int,
                 gpu_memory_utilization: float, on_gpu: bool, prefix_caching: bool = True, tensor_parallel: int = 1,
                 rank_order: list[int] | None = None, enforce_eager: bool = True,
                 lora: LoraSettings | None = None) -> None:
        """`kv_cache_bytes` sizes the KV cache on CPU; on GPU `gpu_memory_utilization` does (and sleep mode frees
        weights and cache during training). `rank_order`: the world's ranks with each TP group's consecutive.
        `enforce_eager`: no CUDA graphs (the module's `enforce_eager` decides it from spec.rollout.cudaGraphs).
        `lora`: LoRA on, one adapter at a time (the current policy's), at the next rank vLLM accepts."""
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
        if lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora.rank), max_loras=1)
        self.model_dir, self.lora = model_dir, lora
        self.adapter: LoRARequest | None = None  # the current adapter (None: the base alone, before the first sync)
        # weight_checksums' with LoRA: the sum of the adapter this engine wrote and vLLM registered (in vLLM's dtype);
        # what vLLM then holds is read from those files by vLLM itself, not read back here
        self.adapter_sum = 0.0
        self.lora_dtype = getattr(torch, dtype)
        self.adapters_dir = _adapters_root() / f"hybridflow-lora-{uuid.uuid4().hex}"
        weakref.finalize(self, shutil.rmtree, self.adapters_dir, True)  # the current version's files, at the end
        self.on_gpu = on_gpu
        self.asleep = False
        self._emptied: list[tuple[torch.nn.Parameter, torch.Size]] = []  # parameters release() gave back (CPU)
        self._kv_freed: list[tuple[torch.UntypedStorage, int]] = []  # KV cache storage release() gave back (CPU)
        self.tensor_parallel = tensor_parallel
        with ranks_in_order(rank_order):
            self.llm = LLM(
                model=str(model_dir),
                skip_tokenizer_init=True,
                dtype=dtype,
                enforce_eager=enforce_eager,
                seed=seed,
                max_model_len=max_model_len,
                tensor_parallel_size=tensor_parallel,
                gpu_memory_utilization=gpu_memory_utilization if on_gpu else 0.9,
                logprobs_mode="processed_logprobs",  # after temperature, as the trainer computes them
                enable_prefix_caching=prefix_caching,
                **kwargs,
            )
        if tensor_parallel > 1:
            check_vocabulary_shards(self.model, tensor_parallel)

    def generate(self, prompts: list[list[int]], cfgs: Sequence[SamplingConfig]) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError("vLLM's weights were released for training and no weights were loaded since: "
                               "the train -> generate transition (load_weights, load_adapter with LoRA) must run "
                               "before generation")

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
                                 use_tqdm=False, lora_request=self.adapter)
        result = []
        for o in outs:
            done = o.outputs[0]
            logprobs = [step[tok].logprob for tok, step in zip(done.token_ids, done.logprobs or [])]
            result.append(Generation(list(done.token_ids), logprobs))
        return result

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's model, through the public `apply_model`: in-process the worker hands back the object itself."""
        return self.llm.apply_model(_itself)[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Whole HF tensors (t_g = 1: vLLM's loaders take its shard), or this rank's TP shards (t_g > 1)."""
        if self.asleep and self.on_gpu:  # weights come back first (into fresh memory), the KV cache once in place
            self.llm.wake_up(tags=["weights"])
        self._restore_emptied()
        if self.tensor_parallel > 1:
            self.llm.collective_rpc(install_shards_in_worker, args=(weights,))
        else:  # the worker's reload_weights: vLLM's loaders in its config context, into the existing storage (on
            # CPU it also packs every GEMM afresh). In-process, the iterator reaches the worker as it is.
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.apply_model(_repack_tied_lm_head)
        if self.asleep and self.on_gpu:
            self.llm.wake_up(tags=["kv_cache"])
        self.asleep = False
        self.llm.reset_prefix_cache()

    def load_adapter(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """The trainer's adapters as the next version: a PEFT directory of its own (models.lora.write_adapter,
        under /dev/shm where there is one), registered now under a new id and name (vLLM reads the files here, not
        at the next generation) and used by every generation from now on; the previous one is removed from vLLM and
        its directory deleted. No prefix-cache reset: vLLM keys cached blocks by the adapter's name and path
        (v1/core/kv_cache_utils._gen_lora_extra_hash_keys), both new per version, so KV computed with an older
        adapter is never reused. On GPU the engine wakes from release()'s level-1 sleep first (its base comes back
        from host memory). Returns the bytes of the adapter tensors."""
        from vllm.lora.request import LoRARequest

        if self.lora is None:
            raise RuntimeError("load_adapter on a vLLM engine started without LoRA (spec.training.lora)")
        if self.asleep and self.on_gpu:
            self.llm.wake_up()
        elif self.asleep:
            self._reload_base()
        self.asleep = False
        held: list[tuple[str, torch.Tensor]] = []

        def kept() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in tensors:
                # copies: a streamed tensor is valid only until the next one is asked for (engines.bridge.stream),
                # and both the checksum and the file's tensors are kept until all of them arrived
                own = t.detach().clone()
                held.append((name, own.to(self.lora_dtype)))
                yield name, own

        version = 1 if self.adapter is None else self.adapter.lora_int_id + 1
        directory = self.adapters_dir / f"v{version}"
        nbytes = lora.write_adapter(directory, kept(), self.lora, lora.model_type(self.model_dir),
                                    str(self.model_dir))
        request = LoRARequest(f"policy-v{version}", version, str(directory))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter of version {version} from {directory}")
        previous, self.adapter = self.adapter, request
        self.adapter_sum = lora.adapter_checksum(held)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)  # False where a base reload dropped it already
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return nbytes

    def _reload_base(self) -> None:
        """A CPU engine's LoRA base, emptied by release(), read back from the model's own files (vLLM's in-place
        reload_weights from disk, which re-packs the GEMMs and drops the registered adapters): not a transfer."""
        self._restore_emptied()
        self.llm.collective_rpc("reload_weights")
        self.llm.apply_model(_repack_tied_lm_head)

    def _restore_emptied(self) -> None:
        for weight, shape in self._emptied:  # the reload writes into the parameters it finds: their storage again
            weight.data = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        self._emptied = []
        for storage, nbytes in self._kv_freed:  # zeroed as vLLM allocates it: a block is never read unwritten
            storage.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8).set_(storage).zero_()
        if self._kv_freed:
            self.llm.reset_prefix_cache()  # its blocks' contents are gone
        self._kv_freed = []

    def _free_kv_cache(self) -> None:
        """Give the KV cache's memory back until the next transition (CPU: vLLM has no sleep mode there). Its
        storage is resized to nothing and back, so the views vLLM's layers and runner hold stay bound to it."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage()
                    for t in self.llm.collective_rpc(_kv_caches_in_worker)[0]}
        for storage in storages.values():
            self._kv_freed.append((storage, storage.nbytes()))
            storage.resize_(0)

    def release(self) -> None:
        """Free the generation weights during training (the transition brings new ones anyway). With LoRA the
        transition brings adapters only: on GPU sleep level 1 (the base offloaded to host memory, the KV cache
        dropped; load_adapter wakes it); on CPU the base is released as below and load_adapter reads it back from
        the model directory (its KV cache freed as below). Without LoRA, on GPU: sleep mode level 2, weights and KV
        cache. On CPU vLLM has no sleep mode. Where its build has the kernels (oneDNN,
        on the AVX-512 and the AVX2 machines seen here; sgl with AMX), vLLM keeps its weights only as packed GEMMs
        (the handles; the parameters are emptied); elsewhere its GEMMs are plain `linear` calls on the parameters.
        Either way reload_weights rebuilds both from its own record of the layers, so dropping the GEMMs and
        emptying the parameters frees the weights (SmolLM2 in bf16: 0.27 GB of resident memory per rank). The KV
        cache, sized from the job, is freed too (`_free_kv_cache`; SmolLM2 in fp32 at 64 sequences of 76 tokens:
        0.28 GB) and comes back zeroed, with an empty prefix cache, at the next transition."""
        if self.asleep:
            return
        if self.lora is not None and self.on_gpu:
            self.llm.sleep(level=1)
        elif self.on_gpu:
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
            self._free_kv_cache()
        self.asleep = True

    def weight_checksums(self) -> dict[str, float]:
        """The embedding's sum (over the TP group: each rank holds a vocabulary shard); with LoRA the current
        adapter's (models.lora.adapter_checksum in vLLM's LoRA dtype; 0 before the first), the base never moving."""
        if self.lora is not None:
            return {"adapter": self.adapter_sum}
        total = self.model.model.embed_tokens.weight.detach().double().sum().reshape(1)
        if self.tensor_parallel > 1:
            from vllm.distributed import parallel_state as vps

            collectives.all_reduce(total, group=vps.get_tp_group().cpu_group)  # gloo: float64 as it is
        return {"embedding": float(total[0])}


def _adapters_root() -> Path:
    """Where adapter directories go: memory-backed /dev/shm where there is one (a sync writes one per version and
    vLLM reads it back at once), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _itself(model: torch.nn.Module) -> torch.nn.Module:
    return model


def _kv_caches_in_worker(worker: Any) -> list[torch.Tensor]:
    """The KV cache tensors vLLM's worker allocated (collective_rpc hands the worker over; in-process, the
    tensors themselves come back). Views of them are bound into the attention layers."""
    return list(worker.model_runner.kv_caches)


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


