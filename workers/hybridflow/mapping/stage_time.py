"""The simulator: seconds of each stage of one step for a model on a pool, and of the step for a placement.

After the paper's section 6: training and scoring passes are compute-bound (6 x parameters x tokens to train,
2 x to score) at a calibrated fraction of the device's peak (MFU), plus what does not hide behind the compute:
tensor-parallel all-reduces (two per layer forward, two more backward), pipeline bubbles ((p - 1) / m of the
compute for m micro-batches per flush), pipeline sends, the data-parallel gradient all-reduce, and FSDP's gathers
and reduce-scatters (overlapped with the compute as far as comm_overlap says: on GPUs the slower of the two counts;
how many a training pass makes follows spec.training's switches as the engine resolves them, `fsdp_switched`).
Generation is bound by memory bandwidth: each decode step reads the device's weights and its sequences' KV cache,
with a batch capped by the KV cache the memory model leaves; prefill is compute-bound. The transition is the
3D-HybridEngine's all-gather inside each micro-DP group, (t p - t_g p_g) / (t_g p_g t p) x M per device (p_g = 1
here; FSDP gathers the whole model); a rollout pool of its own gets the weights as a broadcast over the network.
Colocated roles add up per stage; pools run each stage side by side (the slowest counts, and the others as far as
pool_overlap says); one_step_off and async overlap generation with the trainer's stages, which run the actor's own
old-log-prob pass there, and async pays for the stale batches its queue drops (step_s).

Besides FLOPs and bytes, a step pays fixed costs (`Calibration`'s second group): each remote call of a pass (Ray's
dispatch, the batch there and back), each layer of each micro-batch (an eager framework's per-op dispatch), each
collective launch (FSDP gathers per unit and per tensor, megatron's vocab-parallel head, its row-by-row entropy of
the on-policy update), each optimizer step, each sequence of each decode step, the generation engine taking new
weights, and the controller's own work per step. On a GPU with a real model they are small against the compute,
and their defaults are 0 (not measured there); on a CPU with a tiny model they are most of the step.

Every constant that is not a device's data sheet is in `Calibration`, to be fitted to measurements (issue 52,
item 4): its defaults are assumptions, not measurements; CALIBRATIONS holds those fitted for a device profile
(the cpu one: bench/plan.py, provenance beside it)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from hybridflow.api.devices import DeviceProfile
from hybridflow.api.training import Training, fsdp_switch_on
from hybridflow.mapping.workload import Workload
from hybridflow.memory.shapes import ModelShape

BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class Calibration:
    """The model's free constants. Defaults are typical published figures (Megatron-LM reports 40-50% MFU for
    dense GPT training on A100/H100; vLLM's decode reaches 60-80% of HBM bandwidth at moderate batch), not fits."""

    train_mfu: float = 0.40  # of peak, a training pass (forward and backward)
    forward_mfu: float = 0.40  # of peak, a scoring pass
    prefill_mfu: float = 0.50  # of peak, generation's prefill
    decode_mfu: float = 0.50  # of peak: the compute floor of a large decode batch
    bandwidth_efficiency: float = 0.70  # of the memory bandwidth a decode step reaches
    link_efficiency: float = 0.80  # of a link's bandwidth a collective reaches (NCCL's bus bandwidth)
    collective_latency_s: float = 20e-6  # per collective launch
    max_num_seqs: int = 256  # vLLM's default cap on the sequences one engine decodes at once
    kernel_step_s: float = 0.0  # a fixed cost per decode step (launches, sampling); 0 with CUDA graphs
    # Fixed costs (see the module's docstring); 0 by default: unmeasured on GPUs, where they hide behind the compute.
    call_s: float = 0.0  # per remote call of a pass on a pool: Ray's dispatch, the batch there and back, setup
    layer_op_s: float = 0.0  # per layer (and one for embedding, head and loss) per micro-batch, forward; training 3x
    optimizer_step_s: float = 0.0  # per optimizer step: gradient clipping and AdamW over every tensor
    decode_row_s: float = 0.0  # per sequence per decode step: the engine's scheduling, sampling and output
    weight_load_s: float = 0.0  # the generation engine taking new weights (colocated: wake and load; streamed: load)
    driver_step_s: float = 0.0  # the controller's own work per step: rule rewards, advantages, the step log
    comm_overlap: float = 1.0  # share of FSDP's gathers hidden behind the compute (1: prefetched on their own
    #                            stream, the slower counts; 0: they add, as gloo's do on the cores that compute)
    pool_overlap: float = 1.0  # share of the shorter side's seconds hidden when pools work side by side (1: each
    #                            pool has devices of its own; less when they share a host with the controller and
    #                            Ray, as CPU ranks on a few cores do)


# Fitted for the cpu profile; GPU profiles keep the defaults (nothing measured on GPUs yet).
#
# cpu: `.venv/bin/python bench/plan.py --from-json bench/plan_fit.json --fit abcefgj` (2026-12-06): non-negative
# least squares on the relative errors of 25 stage medians (generate, transition or stream, prepare, update, the
# controller's own) of the sync placements a, b, c, e, j of bench/plan.py (FSDP colocated at micro-batch 64 and 8,
# megatron TP=2 colocated at 64, FSDP with rollout on its own device, megatron TP=1 with rollout on its own device),
# then pool_overlap on a grid to the steps of f (one_step_off) and g (async); d (megatron TP=2 at 8), h (the
# reference apart) and i (async at 8) were held out. bench/plan_fit.json holds the step logs fitted on: three
# invocations of bench/plan.py (`--json`, one run per placement each, the least disturbed counted) on a 2-core Intel
# Xeon with AVX-512-BF16 and AMX, no GPU, shared with other test suites. The MFU is of the peak measured at the fit
# (1196 GFLOP/s in bfloat16, 161 in float32, one thread): 171 and 23 GFLOP/s effective. comm_overlap is 0 by
# construction (gloo computes and communicates on the same cores), not fitted; kernel_step_s came out 0 (vLLM's
# per-step cost is per sequence here: decode_row_s); prefill/decode MFU, bandwidth and link efficiency and
# max_num_seqs keep their defaults: the tiny job's generation does not depend on them. The runs predate
# training.keepGatheredForBackward and reduceGradientsPerStep (issue 57): they gathered and reduced per micro-batch,
# so the fit prices them with both switches "off" (tests/mapping/test_mapping.py refits so).
CALIBRATIONS: dict[str, Calibration] = {
    "cpu": Calibration(
        train_mfu=0.143, forward_mfu=0.143,
        call_s=0.0242,  # a remote call of a pass: Ray's dispatch, the batch there and back, the worker's setup
        layer_op_s=0.000348,  # a layer of a micro-batch, forward (eager dispatch of its ~20 ops)
        collective_latency_s=0.00076,  # a gloo collective over loopback between two single-threaded ranks
        optimizer_step_s=0.0282,  # clipping, AdamW, the update's bookkeeping (and what else one update call pays)
        decode_row_s=4.24e-05,  # vLLM's CPU engine, a sequence of a decode step (scheduling, sampling, output)
        kernel_step_s=0.0,
        weight_load_s=0.0159,  # the rollout engine taking new weights (wake, load, sleep)
        driver_step_s=0.00497,  # rule rewards, advantages, the step log
        comm_overlap=0.0,
        pool_overlap=0.65,  # two pools of one core each beside the controller and Ray on 2 cores
    ),
}


def calibration_for(device: DeviceProfile) -> Calibration:
    """The calibration fitted for `device`'s profile (bench/plan.py), else the defaults."""
    return CALIBRATIONS.get(device.name, Calibration())


def _link(dev: DeviceProfile, ranks_span: int) -> float:
    """The bandwidth a collective over `ranks_span` consecutive ranks gets: NVLink inside a node, the network
    beyond it."""
    return dev.intra_node_bandwidth if ranks_span <= dev.devices_per_node else dev.inter_node_bandwidth


def all_reduce_s(nbytes: float, ranks: int, bandwidth: float, cal: Calibration) -> float:
    """A ring all-reduce: each rank sends and receives 2 (n - 1) / n of the buffer."""
    if ranks <= 1:
        return 0.0
    return cal.collective_latency_s + 2 * (ranks - 1) / ranks * nbytes / (bandwidth * cal.link_efficiency)


def all_gather_s(nbytes: float, ranks: int, bandwidth: float, cal: Calibration, count: int = 1) -> float:
    """Ring all-gathers (or reduce-scatters) of `nbytes` whole in `count` launches: (n - 1) / n of it per rank."""
    if ranks <= 1:
        return 0.0
    return count * cal.collective_latency_s + (ranks - 1) / ranks * nbytes / (bandwidth * cal.link_efficiency)


def param_tensors(shape: ModelShape) -> int:
    """The model's parameter tensors under HF names (q, k, v, their biases, o, gate, up, down and two norms a layer;
    the embedding, the final norm and an untied head): FSDP's `full_params` gathers each one alone."""
    return shape.layers * (9 + (3 if shape.qkv_bias else 0)) + 2 + (0 if shape.tied else 1)


def buckets(nbytes: float) -> int:
    """Buckets of the weight bridge (engines.bridge.reshard.BUCKET_BYTES, 4 MiB): one collective each."""
    return max(1, math.ceil(nbytes / (4 << 20)))


def _overlapped(compute: float, comm: float, cal: Calibration) -> float:
    return compute + comm - cal.comm_overlap * min(compute, comm)


@dataclass(frozen=True)
class Parallel:
    """A model's layout on its pool: size devices, t x p model-parallel (megatron) or FSDP over the pool."""

    size: int
    tp: int = 1
    pp: int = 1
    fsdp: bool = True  # parameters sharded over the whole pool and gathered for each pass (see the switches below)
    micro: int = 1  # rows per micro-batch (training.microBatchSize: a token budget of micro x sequence length)
    fp32: bool = False  # computes in float32 (the device's fp32_peak_flops): megatron with float32 weights
    keep_gathered: bool = False  # FSDP training: each layer gathered once per optimizer step, not twice a micro-batch
    reduce_per_step: bool = False  # FSDP training: gradients reduce-scattered once per optimizer step

    @property
    def dp(self) -> int:
        return max(1, self.size // (self.tp * self.pp))


def fsdp_switched(par: Parallel, training: Training, device: str) -> Parallel:
    """`par`, a trained model's FSDP layout on a pool of `device` ("cpu" or "gpu"), with spec.training's
    keepGatheredForBackward and reduceGradientsPerStep resolved over its `size` ranks by the engine's own rule
    (api.training.fsdp_switch_on), so that the estimate counts the collectives the engine makes."""
    return replace(par, keep_gathered=fsdp_switch_on(training.keep_gathered_for_backward, device, par.size),
                   reduce_per_step=fsdp_switch_on(training.reduce_gradients_per_step, device, par.size))


def pass_s(shape: ModelShape, work: Workload, tokens: int, kind: str, par: Parallel, dev: DeviceProfile,
           cal: Calibration, row_entropy: bool = False) -> float:
    """Seconds of one training ("train") or scoring ("forward") pass over the step's batch of `tokens`, on the
    pool's slowest rank. `row_entropy`: the actor's on-policy update, which takes its entropy statistics row by row
    (roles/actor.py: _old_log_prob_stats); with tensor parallelism each row's vocab-parallel entropy is three
    all-reduces."""
    train = kind == "train"
    params, seq = shape.params, work.prompt_len + work.response_len
    epochs = work.epochs if train else 1
    flops = (6.0 if train else 2.0) * params * tokens * epochs
    peak = dev.fp32_peak_flops if par.fp32 and dev.fp32_peak_flops else dev.peak_flops
    compute = flops / (par.size * peak * (cal.train_mfu if train else cal.forward_mfu))
    rows = work.sequences  # micro-batches count rows (training.microBatchSize), shared prompt or not
    flushes = work.optimizer_steps if train else 1  # a pipeline drains at each optimizer step
    per_flush = max(1, math.ceil(rows / par.dp / flushes / par.micro))  # micro-batches per rank per flush
    micro_batches = per_flush * flushes * epochs
    micro_tokens = par.micro * seq
    # eager dispatch: every layer of the rank's stage, and one more for embedding, head and loss, per micro-batch
    ops = micro_batches * (shape.layers / par.pp + 1) * cal.layer_op_s * (3 if train else 1)
    steps = flushes * epochs if train else 0
    if par.fsdp:
        # per FSDP unit (each layer, and the root): the compute-dtype weights gathered for each forward and again
        # for its backward (keep_gathered: once per optimizer step, kept through its micro-batches; a forward without
        # backward gathers each time) and the fp32 gradients reduce-scattered after each backward (reduce_per_step:
        # once per optimizer step), prefetched behind the compute where the device can (comm_overlap); each
        # optimizer step all-reduces the gradient norm
        link, units = _link(dev, par.size), shape.layers + 1
        gathers, reduces = micro_batches, 0
        if train:
            gathers = steps if par.keep_gathered else 2 * micro_batches
            reduces = steps if par.reduce_per_step else micro_batches
        comm = (gathers * all_gather_s(params * BF16, par.size, link, cal, units)
                + reduces * all_gather_s(params * FP32, par.size, link, cal, units))
        optimizer = steps * (cal.optimizer_step_s + all_reduce_s(FP32, par.size, link, cal))
        return cal.call_s + _overlapped(compute + ops, comm, cal) + optimizer
    bubble = (compute + ops) * (par.pp - 1) / per_flush
    layers = shape.layers / par.pp
    activation = micro_tokens * shape.hidden * BF16
    tp_link = dev.intra_node_bandwidth
    # two all-reduces a layer forward, two more backward; the vocab-parallel embedding's and the cross-entropy's
    # three (max, target logit, sum of exponentials), and backward the head's input gradient
    tp = micro_batches * (layers * (4 if train else 2) * all_reduce_s(activation, par.tp, tp_link, cal)
                          + (5 if train else 4) * all_reduce_s(micro_tokens * FP32, par.tp, tp_link, cal))
    if row_entropy and train:
        tp += math.ceil(rows / par.dp) * epochs * 3 * all_reduce_s(seq * FP32, par.tp, tp_link, cal)
    pp = 0.0
    if par.pp > 1:
        link = _link(dev, par.tp * par.pp)
        pp = micro_batches * (2 if train else 1) * (cal.collective_latency_s + activation / (link * cal.link_efficiency))
    dp = 0.0
    if train and par.dp > 1:
        dp = flushes * epochs * all_reduce_s(params / (par.tp * par.pp) * FP32, par.dp, _link(dev, par.size), cal)
    optimizer = steps * (cal.optimizer_step_s + all_reduce_s(FP32, par.tp, tp_link, cal))
    return cal.call_s + compute + ops + bubble + tp + pp + dp + optimizer


@dataclass(frozen=True)
class Generation:
    """What the rollout needs to be priced: its pool, t_g, and the KV cache one device holds for it."""

    size: int
    tg: int
    kv_cache_bytes: float  # per device (the memory model's KV term); <= 0: cannot generate


def kv_bytes_per_token(shape: ModelShape, tg: int) -> float:
    """Keys and values of one token on one device of a t_g group (heads sharded; fewer heads than t_g replicate)."""
    return 2 * shape.layers * max(1.0, shape.kv_heads / tg) * shape.head_dim * BF16


def generate_s(shape: ModelShape, work: Workload, gen: Generation, dev: DeviceProfile, cal: Calibration) -> float:
    """Seconds to generate the step's sequences on size / t_g replicas: waves of at most as many sequences as the
    KV cache holds (and vLLM's max_num_seqs); each wave prefills, then decodes response_len steps, each reading the
    device's weights and the wave's KV cache at the memory bandwidth (or its compute, if a big batch makes that
    slower), with t_g's two all-reduces per layer."""
    if gen.kv_cache_bytes <= 0:
        return math.inf
    replicas = max(1, gen.size // gen.tg)
    per_replica = math.ceil(work.sequences / replicas)
    seq = work.prompt_len + work.response_len
    kv_token = kv_bytes_per_token(shape, gen.tg)
    fits = int(gen.kv_cache_bytes // (kv_token * seq))
    if fits < 1:
        return math.inf
    cap = min(fits, cal.max_num_seqs, per_replica)
    waves = math.ceil(per_replica / cap)
    batch = math.ceil(per_replica / waves)
    weights = shape.params * BF16 / gen.tg
    context = work.prompt_len + work.response_len / 2
    read = (weights + batch * context * kv_token) / (dev.memory_bandwidth * cal.bandwidth_efficiency)
    compute = 2.0 * shape.params / gen.tg * batch / (dev.peak_flops * cal.decode_mfu)
    comm = shape.layers * 2 * all_reduce_s(batch * shape.hidden * BF16, gen.tg, dev.intra_node_bandwidth, cal)
    step = max(read, compute) + comm + cal.kernel_step_s + batch * cal.decode_row_s
    prompts = batch / work.responses if work.prefix_caching else batch
    prefill = 2.0 * shape.params / gen.tg * prompts * work.prompt_len / (dev.peak_flops * cal.prefill_mfu)
    return cal.call_s + waves * (prefill + work.response_len * step)


def transition_s(shape: ModelShape, par: Parallel, tg: int, dev: DeviceProfile, cal: Calibration) -> float:
    """The colocated train -> generate transition. Megatron: the paper's all-gather inside each micro-DP group of
    t p / t_g consecutive ranks, (t p - t_g) / (t_g t p) x M per device, in the bridge's buckets. FSDP: every device
    gathers the whole model from the pool ((n - 1) / n x M), one tensor at a time. Then the generation engine takes
    the weights (weight_load_s)."""
    model = shape.params * BF16
    if par.fsdp:
        return all_gather_s(model, par.size, _link(dev, par.size), cal, param_tensors(shape)) + cal.weight_load_s
    mp = par.tp * par.pp
    if mp == tg:
        return cal.weight_load_s
    per_device = (mp - tg) / (tg * mp) * model
    return (buckets(per_device) * cal.collective_latency_s + per_device / (_link(dev, mp) * cal.link_efficiency)
            + cal.weight_load_s)


def stream_s(shape: ModelShape, par: Parallel, dev: DeviceProfile, cal: Calibration) -> float:
    """Weights to a rollout pool of its own: the sender gathers whole tensors (FSDP: one tensor at a time; megatron:
    the TP x PP gather in buckets), then broadcasts the model over the network in buckets (a preamble, a header and
    the payload each: a pipelined broadcast costs about one model's transfer), and the rollout engine loads them."""
    model = shape.params * BF16
    if par.fsdp:
        gather = all_gather_s(model, par.size, _link(dev, par.size), cal, param_tensors(shape))
    else:
        gather = all_gather_s(model, par.tp * par.pp, _link(dev, par.tp * par.pp), cal, buckets(model))
    send = 3 * buckets(model) * cal.collective_latency_s + model / (dev.inter_node_bandwidth * cal.link_efficiency)
    return gather + send + cal.weight_load_s


def side_by_side(slowest: float, total: float, cal: Calibration) -> float:
    """Seconds of work that pools do at once, from the slowest one's and their sum (floats or numpy arrays): the
    slowest counts, and the others' seconds as far as they do not hide behind it (pool_overlap)."""
    if cal.pool_overlap >= 1.0:
        return slowest
    with np.errstate(invalid="ignore"):  # a pool that cannot run: inf, not inf - inf
        out = np.where(np.isfinite(slowest), slowest + (1.0 - cal.pool_overlap) * (total - slowest), slowest)
    return float(out) if np.ndim(out) == 0 else out


def step_s(mode: str, generate: float, transition: float, stream: float, prepare: float, update: float,
           driver: float = 0.0, cal: Calibration | None = None, waste: float = 0.0) -> float:
    """One step from its stages (each already the pools' side_by_side; floats or numpy arrays) and the
    controller's own work. sync runs them one after another. one_step_off and async generate the next batch while
    the trainer's pools prepare and update this one (the controller's work on the trainer's side), side by side,
    and the weight stream that ends a step waits for both.

    async (whole responses) with `waste` (workload.async_waste) > 0, when generation G outpaces the trainer T: the
    rollout pool generates G (1 + waste) a step, and in a share `waste` of the steps the trainer finds only stale
    batches, drops them and waits for a fresh one, which began when the previous take freed room, after the engine
    call then in flight: 2 G after that take, so 2 G - T of waiting where that is positive. (A discrete simulation
    of the queue agrees within 15% for maxStaleness 1 and 2 and queues of 2 to 4 batches.)"""
    if mode == "sync":
        return generate + transition + stream + prepare + update + driver
    trainer = prepare + update + driver
    if mode == "async" and waste:
        ahead = generate < trainer
        with np.errstate(invalid="ignore"):  # a pool that cannot run: inf (never ahead), not inf - inf
            wait = np.where(ahead, waste * np.maximum(0.0, 2 * generate - trainer), 0.0)
        generate = np.where(ahead, generate * (1.0 + waste), generate)
        trainer = trainer + wait
    slowest = np.maximum(generate, trainer)
    if cal is None:
        return slowest + stream
    return side_by_side(slowest, slowest + np.minimum(generate, trainer), cal) + stream


STALENESS = {"sync": 0, "one_step_off": 1}  # async: spec.rollout.maxStaleness
