"""Bytes per device of every role of a job, term by term and phase by phase (pure: a spec, shapes, a profile in).

A device's memory is the sum of what its colocated roles hold in each phase; its peak is the largest phase:
  generate  vLLM awake (on GPU it takes rollout.gpuMemoryUtilization x the device: weights, workspace, KV cache)
  forward   reference / reward / critic scoring (vLLM asleep on GPU)
  update    actor and critic updates (one at a time: the largest transient counts), fp32 gradients live
  reshard   the 3D-HybridEngine's transition: vLLM's weights woken and filled bucket by bucket
Trained models keep fp32 master weights, fp32 gradients and fp32 AdamW moments, sharded by FSDP over the pool's
world size or by megatron over TP x PP, and compute in the compute dtype (training.computeDtype; auto: bf16 on a
GPU or where models.*.dtype is bfloat16). Frozen models are held in their own dtype. With spec.training.lora the
trained parameters are the adapters' (`TrainedParams`): the base is held frozen in the compute dtype, the reference
is the actor with its adapters switched off (no weights of its own) and the weight sync moves the adapters only.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.api import JobSpec, ResourcePool
from hybridflow.api.engines import TRAIN_ENGINES
from hybridflow.api.devices import DeviceProfile
from hybridflow.api.training import (LORA_DEFAULT_TARGETS, Lora, actor_is_reference, fsdp_switch_on, fsdp_unsharded,
                                     role_lora)
from hybridflow.capacity import DTYPE_BYTES, kv_cache_bytes
from hybridflow.memory.shapes import ModelShape, ShapeError

PHASES = ("generate", "forward", "update", "reshard")
MB = 1 << 20
BUCKET_BYTES = 4 * MB  # engines/bridge/reshard.py: the transition's transient is one bucket
# vLLM's own workspace inside its gpuMemoryUtilization share (the profiling run's activations and sampler at its
# default max_num_batched_tokens), and the CUDA-graph pool it captures at t_g = 1 (outside sleep mode's pools, so
# it stays through the update): vLLM's start-up log reports both ("took 0.4 GiB" for the graphs of a 7B model).
VLLM_WORKSPACE_BYTES = 1536 * MB
CUDA_GRAPH_POOL_BYTES = 512 * MB


@dataclass(frozen=True)
class Term:
    """One line of a device's budget: a role's part, the spec field that moves it, bytes in each phase."""

    role: str
    what: str
    field: str
    phases: dict[str, int]
    # held only while the role's own call runs (activations, logits, gathered layers): colocated roles run one call
    # at a time in their shared process, so a phase holds the largest role's transients, not their sum
    transient: bool = False

    @property
    def peak(self) -> int:
        return max(self.phases.values(), default=0)


def _in(phases: tuple[str, ...], n: int) -> dict[str, int]:
    return {p: (n if p in phases else 0) for p in PHASES}


def compute_bytes(spec: JobSpec, gpu: bool, native_bf16: bool = True) -> int:
    """Bytes per element of compute, generation and activations (engines/precision.py's rule)."""
    setting = spec.training.compute_dtype
    if setting != "auto":
        return DTYPE_BYTES[setting]
    return 2 if spec.models.actor.dtype == "bfloat16" or gpu or native_bf16 else 4


def dtype_of(c: int) -> str:
    """The compute dtype's name from its bytes per element (compute_bytes's)."""
    return next(name for name, size in DTYPE_BYTES.items() if size == c)


def micro_batch_tokens(spec: JobSpec, dp: int) -> tuple[int, int]:
    """(tokens, response tokens) of the largest micro-batch one rank runs: the token budget microBatchSize x
    (maxPromptLength + maxResponseLength) at full lengths, never more rows than the rank's share of the batch; with
    sharedPrompt, whole groups of responsesPerPrompt rows share one prompt (the LM head runs on responses only)."""
    r, t = spec.rollout, spec.training
    P, R, n = r.max_prompt_length, r.max_response_length, r.responses_per_prompt
    mini = t.mini_batch_size or spec.trainer.prompts_per_step
    rows = max(1, -(-mini * n // dp))
    budget = t.micro_batch_size * (P + R)
    if t.shared_prompt and n > 1:
        groups = min(budget // (P + n * R), -(-rows // n))
        if groups == 0:  # a group longer than the budget is cut into sequences of fewer responses
            return max(budget, P + R), max(budget, P + R) - P
        return groups * (P + n * R), groups * n * R
    rows = min(rows, t.micro_batch_size)
    return rows * (P + R), rows * R


def activation_bytes_per_token(s: ModelShape, c: int) -> int:
    """Bytes one token leaves saved for backward across the decoder (no recompute; HF's eager/sdpa decoder): per
    layer two RMSNorms (their fp32 input and the normalized output), q, k and v as the attention kernel takes
    them (k, v repeated to every head), its output and o_proj's input, and the MLP's gate, up, activation and
    product; plus the embedding output and the final norm."""
    h, inter, q = s.hidden, s.intermediate, s.heads * s.head_dim
    norm = 4 * h + c * h
    attention = c * (3 * q + 2 * h)
    mlp = 4 * inter * c
    return s.layers * (2 * norm + attention + mlp) + 2 * norm


def logits_bytes(s: ModelShape, response_tokens: int, c: int, trained: bool) -> int:
    """The LM head on response positions: logits in the compute dtype and log-softmax in fp32; a trained pass also
    holds log-softmax's gradient and the logits' (fp32, then cast)."""
    per = c + 4 + ((4 + 4 + c) if trained else 0)
    return response_tokens * s.vocab * per


def fsdp_transients(s: ModelShape, c: int, trained: TrainedParams | None, keep_gathered: bool = False,
                    reduce_per_step: bool = False) -> tuple[int, int]:
    """(gathered compute-dtype weights, unsharded fp32 gradients) of FSDP2: two decoder layers (the one running and
    the one prefetched) and the root unit (embeddings, LM head, final norm) held whole while it runs, or every layer
    where a backward keeps what its forward gathered (training.keepGatheredForBackward); gradients exist for the
    trained parameters only (with LoRA, the adapters), one layer's at a time, or all of them where they are reduced
    once per step (training.reduceGradientsPerStep)."""
    gathered = ((s.layers if keep_gathered else 2) * s.layer_params + s.root_params) * c
    if trained is None:
        return gathered, 0
    return gathered, (trained.trained if reduce_per_step else trained.layer + trained.root) * 4


# role -> whether spec.training.lora gives it adapters: the actor always, a critic (and the cost critic) only when
# lora.critic asks; every other role is frozen or generates
@dataclass(frozen=True)
class TrainedParams:
    """How a trained model's parameters are held, before sharding: the trained ones carry fp32 master weights, fp32
    gradients and fp32 AdamW moments; the frozen ones (LoRA's base) only their weights, in the compute dtype."""

    layer: int  # trained parameters per decoder layer (FSDP unshards one layer's gradients at a time)
    root: int  # trained parameters outside the layers (the root unit; a LoRA critic's value head)
    layers: int
    frozen: int
    what: str  # how the plan names the trained parameters after "fp32 master weights" (LoRA: "of the adapters")

    @property
    def trained(self) -> int:
        return self.layers * self.layer + self.root


def adapted_linears(s: ModelShape, lora: Lora) -> dict[str, tuple[int, int]]:
    """The linear modules of a decoder layer that get adapters, with PEFT's rule (a module whose name is a target or
    ends with "." + a target; no targets: the model family's default); none matched is refused, as PEFT refuses it."""
    targets = lora.target_modules or LORA_DEFAULT_TARGETS.get(s.family, ())
    if not targets:
        raise ShapeError(f"spec.training.lora.targetModules: no default for model type {s.family!r} ({s.source}); "
                         "name the linear modules to adapt, e.g. [q_proj, v_proj]")
    out = {n: io for n, io in s.linears.items() if any(n == t or n.endswith(f".{t}") for t in targets)}
    if not out:
        raise ShapeError(f"spec.training.lora.targetModules: {list(targets)} name no linear module of a decoder "
                         f"layer of {s.source} ({', '.join(s.linears)})")
    return out


def adapter_layer_params(s: ModelShape, lora: Lora) -> int:
    """One decoder layer's adapter parameters: A (rank x in) and B (out x rank) on every adapted linear module."""
    return sum(lora.rank * (n_in + n_out) for n_in, n_out in adapted_linears(s, lora).values())


def trained_params(role: str, spec: JobSpec, s: ModelShape, lm: bool) -> TrainedParams:
    """Every weight trained (full fine-tuning), or with LoRA the adapters (and a critic's value head, trained whole)
    on a frozen base."""
    lora = role_lora(role, spec.training)
    if lora is None:
        return TrainedParams(s.layer_params, s.root_params, s.layers, 0, "")
    head = 0 if lm else s.hidden + 1  # AutoModelForTokenClassification's score layer, bias included
    return TrainedParams(adapter_layer_params(s, lora), head, s.layers, s.params,
                         f" of the LoRA adapters, rank {lora.rank}")


def trained_weight_dtypes(held: TrainedParams, c: int) -> set[str]:
    """The dtypes a trained model's FSDP engine holds its weights in (engines.train.fsdp.weights_dtype): fp32
    masters, or with LoRA (a frozen base) the base in the compute dtype beside the fp32 adapters."""
    return {"float32"} | ({dtype_of(c)} if held.frozen else set())


def trained_terms(role: str, spec: JobSpec, pool: ResourcePool, s: ModelShape, c: int, lm: bool) -> list[Term]:
    """A trained model (actor, critic): master weights, AdamW moments, gradients, the update's transients."""
    t = spec.training
    megatron_like = TRAIN_ENGINES[t.engine].model_parallel  # shards by TP x PP and needs no gathering
    model_parallel = t.tensor_parallel * t.pipeline_parallel if megatron_like else 1
    shard = model_parallel if megatron_like else pool.world_size
    dp = max(1, pool.world_size // model_parallel)
    tokens, response = micro_batch_tokens(spec, dp)
    held = trained_params(role, spec, s, lm)
    P = held.trained
    how = f"1/{shard}, {'TP x PP' if megatron_like else 'FSDP over the pool'}"
    pool_field = "spec.resourcePools[].devicesPerNode"
    out = [Term(role, f"fp32 master weights{held.what} ({how})", pool_field, _in(PHASES, P * 4 // shard)),
           Term(role, "fp32 AdamW moments", "spec.resourcePools[].devicesPerNode", _in(PHASES, P * 8 // shard)),
           Term(role, "fp32 gradients", "spec.resourcePools[].devicesPerNode", _in(("update",), P * 4 // shard))]
    if held.frozen:
        out.append(Term(role, f"frozen base weights (compute dtype, {how}; no master, gradients or moments)",
                        "spec.training.lora", _in(PHASES, held.frozen * c // shard)))
    module = DTYPE_BYTES[spec.models.actor.dtype]
    if megatron_like and module < 4:  # its module computes in its own dtype: a copy beside the masters
        out += [Term(role, f"{spec.models.actor.dtype} module weights (beside the fp32 masters)",
                     "spec.models.actor.dtype", _in(PHASES, P * module // shard)),
                Term(role, f"{spec.models.actor.dtype} module gradients", "spec.models.actor.dtype",
                     _in(("update",), P * module // shard))]
    if not megatron_like and not fsdp_unsharded(shard, trained_weight_dtypes(held, c), dtype_of(c)):
        gathered, grads = fsdp_transients(s, c, held,
                                          fsdp_switch_on(t.keep_gathered_for_backward, pool.device, shard),
                                          fsdp_switch_on(t.reduce_gradients_per_step, pool.device, shard))
        out.append(Term(role, "FSDP gathered layers + root, fp32 unsharded grads", "spec.training.computeDtype",
                        _in(("update",), gathered + grads), transient=True))
    acts = tokens * activation_bytes_per_token(s, c) // t.tensor_parallel
    out.append(Term(role, f"activations ({tokens} tokens/micro-batch)", "spec.training.microBatchSize",
                    _in(("update",), acts), transient=True))
    head = logits_bytes(s, response, c, True) // t.tensor_parallel if lm else response * 16
    out.append(Term(role, f"logits ({response} response tokens, fp32 log-softmax)", "spec.training.microBatchSize",
                    _in(("update",), head), transient=True))
    return out


def reference_is_actor_base(role: str, spec: JobSpec) -> bool:
    """With LoRA the reference policy is the actor's frozen base (its adapters switched off for the call,
    models/lora.py), so the reference holds no model of its own; its forward pass still runs."""
    return role == "reference" and actor_is_reference(spec.training)


def frozen_terms(role: str, spec: JobSpec, pool: ResourcePool, s: ModelShape, c: int, dtype: str,
                 lm: bool) -> list[Term]:
    """A scoring model (reference, reward): weights in its own dtype, FSDP-sharded, and one forward's transient."""
    tokens, response = micro_batch_tokens(spec, pool.world_size)
    b = DTYPE_BYTES[dtype]
    # the engine it runs on holds weights in these dtypes: the actor's with LoRA (its base, adapters off), else its own
    held = (trained_weight_dtypes(trained_params("actor", spec, s, True), c) if reference_is_actor_base(role, spec)
            else {dtype})
    gathered = 0 if fsdp_unsharded(pool.world_size, held, dtype_of(c)) else fsdp_transients(s, c, None)[0]
    forward = gathered + tokens * (2 * s.intermediate + 2 * s.hidden) * c + (
        logits_bytes(s, response, c, False) if lm else 0)
    weights = (Term(role, "no weights of its own: the actor's base, adapters switched off", "spec.training.lora",
                    _in(PHASES, 0)) if reference_is_actor_base(role, spec) else
               Term(role, f"{dtype} weights (1/{pool.world_size}, FSDP)", "spec.resourcePools[].devicesPerNode",
                    _in(PHASES, s.params * b // pool.world_size)))
    return [weights,
            Term(role, "forward pass (gathered layers, one layer's activations, logits)",
                 "spec.training.microBatchSize", _in(("forward",), forward), transient=True)]


def cuda_graphs_on(spec: JobSpec) -> bool:
    """rollout.cudaGraphs (auto: on at t_g = 1), where the spec has the field; eager otherwise."""
    setting = spec.rollout.cuda_graphs
    return setting == "on" or (setting == "auto" and spec.rollout.tensor_parallel == 1)


def rollout_terms(spec: JobSpec, pool: ResourcePool, s: ModelShape, c: int, device: DeviceProfile,
                  gpu: bool, colocated: bool) -> list[Term]:
    """vLLM on its pool. On GPU it takes gpuMemoryUtilization x the device while awake (weights, workspace, and a
    KV cache of whatever is left), sleeps through scoring and the update (weights and KV cache freed; the CUDA-graph
    pool stays), and wakes its weights for the transition. On CPU its KV cache is sized from the job; it and the
    weights are released during the update. With LoRA, vLLM's slot for the adapter comes out of its share too."""
    r = spec.rollout
    weights = s.params * c // r.tensor_parallel
    adapter = adapter_bytes(spec, s, c)
    where = "the transition" if colocated else "the weight stream"
    if gpu:
        share = int(r.gpu_memory_utilization * device.capacity_bytes)
        kv = share - weights - VLLM_WORKSPACE_BYTES - adapter // r.tensor_parallel
        out = [Term("rollout", f"vLLM weights (1/{r.tensor_parallel}), woken for {where}",
                    "spec.rollout.tensorParallel", _in(("generate", "reshard"), weights)),
               Term("rollout", "vLLM workspace (activations, sampler)", "spec.rollout.gpuMemoryUtilization",
                    _in(("generate",), VLLM_WORKSPACE_BYTES)),
               Term("rollout", f"vLLM KV cache (gpuMemoryUtilization {r.gpu_memory_utilization} x device, less the "
                    "above)", "spec.rollout.gpuMemoryUtilization", _in(("generate",), kv))]
        if cuda_graphs_on(spec):
            out.append(Term("rollout", "CUDA-graph pool (kept through sleep)", "spec.rollout.cudaGraphs",
                            _in(PHASES, CUDA_GRAPH_POOL_BYTES)))
    else:
        sequences = max(spec.trainer.prompts_per_step * (r.responses_per_prompt + 1), spec.data.eval_prompts)
        per_rank = -(-sequences // max(1, pool.world_size // r.tensor_parallel))
        kv = int(r.kv_cache_gib * (1 << 30)) or kv_cache_bytes(
            s.layers, s.kv_heads, s.head_dim, c, per_rank, r.max_prompt_length + r.max_response_length)
        # beside the actor both are released for the updates (engines/rollout/vllm.py: release; a critic on these
        # devices releases them before its own); with LoRA the base comes back from the model's files at the
        # transition. On a pool of its own nothing releases them.
        held = ("generate", "forward", "reshard") if colocated else PHASES
        out = [Term("rollout", f"vLLM weights (1/{r.tensor_parallel}), released in the update" + (
                    " (the LoRA base: read back from the model directory)" if adapter else ""),
                    "spec.rollout.tensorParallel", _in(held, weights)),
               Term("rollout", "vLLM KV cache (sized from the job), released in the update",
                    "spec.rollout.kvCacheGib", _in(held, kv))]
    if adapter:
        out.append(Term("rollout", f"vLLM LoRA slot (enable_lora: one adapter, 1/{r.tensor_parallel})",
                        "spec.training.lora.rank", _in(("generate", "reshard"), adapter // r.tensor_parallel)))
    out.append(sync_transient(s, c, adapter))
    return out


def adapter_bytes(spec: JobSpec, s: ModelShape, c: int) -> int:
    """The actor's LoRA adapters whole, in the compute dtype (0 without LoRA): what each weight sync moves and what
    vLLM's LoRA slot holds beside the base weights, which never change."""
    lora = role_lora("actor", spec.training)
    return 0 if lora is None else s.layers * adapter_layer_params(s, lora) * c


def sync_transient(s: ModelShape, c: int, adapter: int) -> Term:
    """The weight sync's transient: the 3D-HybridEngine's bucket (or the largest tensor) of the whole model, or with
    LoRA the adapters alone, gathered whole."""
    largest = max(BUCKET_BYTES, max(s.vocab * s.hidden, s.hidden * s.intermediate) * c)
    what = ("weight sync transient (the LoRA adapters, gathered whole)" if adapter else
            "3D-HybridEngine transient (shard M/(t_g p_g) = the weights above; one bucket)")
    field = "spec.training.lora.rank" if adapter else "spec.rollout.tensorParallel"
    return Term("rollout", what, field, _in(("reshard",), adapter or largest))


def judge_terms(spec: JobSpec, pool: ResourcePool, s: ModelShape, c: int, device: DeviceProfile,
                gpu: bool) -> list[Term]:
    """A generative judge's engine on each rank of its pool, awake all the time (it never trains nor syncs): on a
    GPU vLLM's share of the device (judge.gpuMemoryUtilization; the pool is the judge's alone: api.rules), on a CPU
    its weights in the compute dtype and a KV cache for batchSize requests."""
    j = spec.models.reward.judge
    assert j is not None
    if gpu:
        share = int(j.gpu_memory_utilization * device.capacity_bytes)
        return [Term("judge", f"vLLM (gpuMemoryUtilization {j.gpu_memory_utilization} x device: weights, "
                     "workspace, KV cache)", "spec.models.reward.judge.gpuMemoryUtilization", _in(PHASES, share))]
    kv = kv_cache_bytes(s.layers, s.kv_heads, s.head_dim, c, j.batch_size, j.max_prompt_length + j.max_tokens)
    return [Term("judge", "judge weights (whole, each rank)", "spec.models.reward.judge.model",
                 _in(PHASES, s.params * c)),
            Term("judge", "judge KV cache (batchSize requests)", "spec.models.reward.judge.batchSize", _in(PHASES, kv))]
