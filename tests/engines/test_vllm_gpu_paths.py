"""vLLM's GPU paths, decided and plumbed in code that runs here (issue 50, item 5): the weight reload through vLLM's
public `collective_rpc("reload_weights")`; t_g > 1 shards copied into the storage vLLM allocated (sleep mode's on a
GPU, and what CUDA graphs captured); `rollout.cudaGraphs`; each phase's own peak memory, and what generation's
sleep frees and its wake takes back. What only a GPU shows (sleep really unmapping, graphs replaying the new
weights) is left to the device check; every decision that leads there is tested on CPU. `CudaDouble` is a test
double of the few torch.cuda calls the memory readings make (there is no GPU here). The reload through vLLM's
public RPC, into the same storage, on a real vLLM engine: tests/engines/test_throughput.py's release-and-reload test (one
engine start shared); greedy == HF after syncs at t_g = 1 and 2: tests/trainer/test_weight_sync.py."""
from __future__ import annotations

import mmap
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hybridflow.api import SpecError, parse_job
from hybridflow.engines.rollout.vllm import enforce_eager
from hybridflow.engines.rollout.vllm_tp import install_shards
from hybridflow.roles import common
from hybridflow.roles.rollout import RolloutWorker
from hybridflow.trainer.generation.weight_sync import ColocatedWeightSync

MB = 1 << 20


# --- rollout.cudaGraphs ------------------------------------------------------------------------------------------

def test_cuda_graphs_are_on_only_on_a_gpu_at_tg1_unless_asked_for_everywhere():
    """auto: graphs at t_g = 1 on a GPU, eager elsewhere; on: graphs on any GPU layout; off: eager everywhere;
    on a CPU there are none (vLLM's CPU build captures none), and asking for them is an error."""
    want = {  # (setting, on_gpu, t_g) -> enforce_eager
        ("auto", True, 1): False, ("auto", True, 2): True, ("auto", False, 1): True, ("auto", False, 2): True,
        ("on", True, 1): False, ("on", True, 2): False,
        ("off", True, 1): True, ("off", True, 2): True, ("off", False, 1): True, ("off", False, 2): True,
    }
    for (setting, on_gpu, t_g), eager in want.items():
        assert enforce_eager(setting, on_gpu, t_g) is eager, (setting, on_gpu, t_g)
    for t_g in (1, 2):
        with pytest.raises(ValueError, match="cudaGraphs = on: CUDA graphs need a GPU"):
            enforce_eager("on", False, t_g)
    with pytest.raises(ValueError, match="use auto, on or off"):
        enforce_eager("always", True, 1)


def _job(rollout: dict, device: str = "cpu") -> object:
    return parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
                      "spec": {"rollout": rollout, "resourcePools": [{"name": "default", "device": device}]}})


def test_cuda_graphs_on_is_refused_where_none_can_be_captured_naming_the_field():
    assert _job({}).spec.rollout.cuda_graphs == "auto"
    assert _job({"cudaGraphs": "on"}, "gpu").spec.rollout.cuda_graphs == "on"
    assert _job({"cudaGraphs": "off"}).spec.rollout.cuda_graphs == "off"
    with pytest.raises(SpecError, match=r"spec.rollout.cudaGraphs = on: CUDA graphs need a GPU.*'default'"):
        _job({"cudaGraphs": "on"})
    with pytest.raises(SpecError, match="spec.rollout.cudaGraphs = on: the hf engine captures no CUDA graphs"):
        _job({"cudaGraphs": "on", "engine": "hf"}, "gpu")
    with pytest.raises(SpecError, match=r'spec.rollout.cudaGraphs: write "on" in quotes'):
        _job({"cudaGraphs": True}, "gpu")  # what YAML makes of a bare `cudaGraphs: on`


# --- t_g > 1: shards copied into the parameters' own storage -------------------------------------------------------

class _PostLoadDouble:
    """Test double of a vLLM layer's quant method: records each layer's post-load step."""

    def __init__(self, seen: list[str], name: str) -> None:
        self.seen, self.name = seen, name

    def process_weights_after_loading(self, module: nn.Module) -> None:
        self.seen.append(self.name)


class VLLMModelDouble(nn.Module):
    """Test double of vLLM's model at t_g = 2 (one layer): fused qkv and gate_up shards, a vocabulary shard, a
    norm; `packed_modules_mapping` as vLLM's Qwen2/Llama declare it; the LM head tied (no parameter of its own)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.post_loaded: list[str] = []
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = nn.Linear(8, 12, bias=False, device=device)  # q 8 rows + k 2 + v 2
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = nn.Linear(8, 6, bias=False, device=device)
        layer.input_layernorm = nn.Module()
        layer.input_layernorm.weight = nn.Parameter(torch.zeros(8, device=device))
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
            layer.get_submodule(name).quant_method = _PostLoadDouble(self.post_loaded, name)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(16, 8, device=device)
        self.model.layers = nn.ModuleList([layer])


def _shards(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (16, 8), "model.layers.0.self_attn.q_proj.weight": (8, 8),
              "model.layers.0.self_attn.k_proj.weight": (2, 8), "model.layers.0.self_attn.v_proj.weight": (2, 8),
              "model.layers.0.mlp.gate_proj.weight": (3, 8), "model.layers.0.mlp.up_proj.weight": (3, 8),
              "model.layers.0.input_layernorm.weight": (8,), "lm_head.weight": (16, 8)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_shards_are_copied_into_the_storage_vllm_allocated():
    """Every parameter keeps its storage (on a GPU: sleep mode's memory, and the addresses CUDA graphs read), holds
    the new shard (q/k/v and gate/up fused in vLLM's order), and each fused layer is post-loaded once. With
    `param.data = shard` (the old code) the storage moves and sleep would free nothing of it."""
    model = VLLMModelDouble()
    params = dict(model.named_parameters())
    where = {name: p.data_ptr() for name, p in params.items()}
    shards = _shards(0)
    install_shards(model, iter(shards.items()))
    assert {name: p.data_ptr() for name, p in params.items()} == where, "a parameter's storage was replaced"
    layer = "model.layers.0."
    torch.testing.assert_close(params[layer + "self_attn.qkv_proj.weight"].data, torch.cat(
        [shards[layer + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
    torch.testing.assert_close(params[layer + "mlp.gate_up_proj.weight"].data, torch.cat(
        [shards[layer + "mlp.gate_proj.weight"], shards[layer + "mlp.up_proj.weight"]]))
    torch.testing.assert_close(params["model.embed_tokens.weight"].data, shards["model.embed_tokens.weight"])
    torch.testing.assert_close(params[layer + "input_layernorm.weight"].data, shards[layer + "input_layernorm.weight"])
    assert sorted(model.post_loaded) == ["mlp.gate_up_proj", "self_attn.qkv_proj"]


def test_only_a_cpu_parameter_that_vllm_packed_away_gets_new_storage():
    """vLLM's CPU GEMM packing leaves a linear weight empty (shape (0,)): the shard becomes its storage and the
    post-load step packs it. Anywhere else a shape that does not fit is an error, never a rebinding."""
    model = VLLMModelDouble()
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    qkv.data = torch.empty(0)
    install_shards(model, iter(_shards(1).items()))
    assert qkv.shape == (12, 8)
    bad = {**_shards(2), "model.layers.0.input_layernorm.weight": torch.ones(4)}
    with pytest.raises(ValueError, match="input_layernorm.weight is \\(8,\\).*its shard \\(4,\\)"):
        install_shards(VLLMModelDouble(), iter(bad.items()))
    meta = VLLMModelDouble("meta")  # an empty parameter off the CPU (device meta stands in for cuda here)
    meta.model.embed_tokens.weight.data = torch.empty(0, device="meta")
    with pytest.raises(ValueError, match="embed_tokens.weight is \\(0,\\) on meta"):
        install_shards(meta, iter(_shards(3).items()))


# --- memory: each phase's own peak, sleep and wake -----------------------------------------------------------------

class CudaDouble:
    """Test double of torch.cuda's memory calls: an allocator whose peak since the last reset is tracked, and a
    device whose free memory the test sets."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.allocated, self.peak, self.reserved = 0, 0, 0
        self.free, self.total = 80 << 30, 80 << 30

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def max_memory_allocated(self) -> int:
        self.calls.append("max_memory_allocated")
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak_memory_stats")
        self.peak = self.allocated

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, self.total

    def memory_reserved(self) -> int:
        return self.reserved

    def memory_allocated(self) -> int:
        return self.allocated


def test_a_phase_on_a_gpu_resets_torchs_peak_at_its_start_and_reads_it_at_its_end():
    cuda = CudaDouble()
    cuda.alloc(30 << 30)  # vLLM's start-up profiling
    cuda.allocated = 2 << 30
    with common.memory_phase(cuda) as phase:
        assert cuda.calls == ["reset_peak_memory_stats"]
        cuda.alloc(1 << 30)
        cuda.allocated -= 1 << 30
    assert cuda.calls == ["reset_peak_memory_stats", "max_memory_allocated"]
    assert phase.bytes == 3 << 30, "the phase's peak is its own, not the start-up's"


def test_memory_in_use_on_a_gpu_is_what_the_driver_sees_less_torchs_free_cache():
    """sleep unmaps memory beneath torch (the driver's free memory grows); buffers a transition freed stay in
    torch's cache and are not the engine's."""
    cuda = CudaDouble()
    cuda.alloc(10 << 30)
    cuda.allocated = 6 << 30  # 4 GiB freed into torch's cache
    cuda.free = cuda.total - (30 << 30)  # vLLM's weights and KV cache mapped (20 GiB) beside torch's 10
    assert common.memory_in_use_bytes(cuda) == 26 << 30


def _touch(n: int) -> mmap.mmap:
    """n bytes made resident page by page, given back to the kernel when the object goes: an anonymous mapping of
    its own, not the C heap's (whose free memory an earlier test in this process can leave resident and reuse, so a
    bytearray of the same size can come and go without the resident set moving)."""
    buf = mmap.mmap(-1, n)
    for offset in range(0, n, mmap.PAGESIZE):
        buf[offset] = 1
    return buf


def test_a_phase_on_cpu_reads_its_own_peak_resident_set():
    """On CPU the kernel's resident high-water mark is reset at a phase's start: a phase after a 300 MB spike
    reports its own peak, not the spike."""
    with common.memory_phase() as first:
        del_me = _touch(300 * MB)
        del del_me
    with common.memory_phase() as second:
        pass
    assert first.bytes - second.bytes > 250 * MB, (first, second)


def test_release_and_sync_report_what_generation_freed_and_took_back():
    """The colocated rollout role measures its engine's release (vLLM on GPU: sleep) and the transition that brings
    the weights back (wake); the step reports both (max over ranks) and Prometheus serves them."""
    from hybridflow.metrics import JobMetrics

    class GeneratorDouble:
        """Test double of a generation engine holding 200 MB of weights that release() drops."""

        weights: mmap.mmap | None = None

        def release(self) -> None:
            self.weights = None

    class TransferDouble:
        """Test double of the bridge: the push loads 150 MB of weights into the engine."""

        def push(self, generator: GeneratorDouble) -> SimpleNamespace:
            generator.weights = _touch(150 * MB)
            return SimpleNamespace(bytes_received=1, peak_transient_bytes=2, generation_bytes=3)

    generator = GeneratorDouble()
    generator.weights = _touch(200 * MB)
    worker = SimpleNamespace(generator=generator, transfer=TransferDouble(), gen=SimpleNamespace(version=0),
                             sleep_freed_bytes=0.0, released=False)
    RolloutWorker.release(worker)  # type: ignore[arg-type]
    assert worker.sleep_freed_bytes == pytest.approx(200 * MB, rel=0.1)
    RolloutWorker.release(worker)  # type: ignore[arg-type]  # a second update this step: nothing more to free
    assert worker.sleep_freed_bytes == pytest.approx(200 * MB, rel=0.1)
    stats = RolloutWorker.sync_weights(worker)  # type: ignore[arg-type]
    assert not worker.released  # the transition brought the weights back: the next update frees them again
    assert stats["sleep_freed_bytes"] == worker.sleep_freed_bytes
    assert stats["wake_bytes"] == pytest.approx(150 * MB, rel=0.1)

    class RolloutRoleDouble:
        """Test double of the rollout role's handle: two ranks' sync statistics."""

        def sync_weights(self, version: int, profile: bool = False) -> list[dict[str, float]]:
            return [stats, {**stats, "sleep_freed_bytes": 1.0, "wake_bytes": 2.0}]

    step = ColocatedWeightSync(RolloutRoleDouble()).sync(1)
    assert step["rollout_sleep_freed_bytes"] == stats["sleep_freed_bytes"]
    assert step["rollout_wake_bytes"] == stats["wake_bytes"]
    served = JobMetrics("t", primed=False)
    served.record_step({"step": 1, "tokens": 1.0, "throughput_tokens_per_s": 1.0, "throughput_per_device": 1.0,
                        "generation_tokens_per_s": 1.0, "iteration_seconds": 1.0, "eta_seconds": 0.0, **step}, {})
    assert served.scalars()["hybridflow_rollout_sleep_freed_bytes"] == step["rollout_sleep_freed_bytes"]
    assert served.scalars()["hybridflow_rollout_wake_bytes"] == step["rollout_wake_bytes"]


# The actor's real one-rank update and log-prob pass (support.tiny_actor; `tiny_dir`: tests/conftest.py)
from support.tiny_actor import one_rank_actor, ragged_batch_with_uids  # noqa: E402


def test_the_actors_log_prob_pass_and_update_report_their_own_peaks(one_rank, tiny_dir):
    """A 400 MB spike before the log-prob pass (as vLLM's start-up was) is not in its peak, and one between the
    pass and the update (as generation's would be) is not in the update's: each phase resets the peak at its start."""
    actor = one_rank_actor(tiny_dir, {})
    batch = ragged_batch_with_uids()

    def spike() -> int:
        del_me = _touch(400 * MB)
        high = common.peak_memory_bytes()
        del del_me
        return high

    before_pass = spike()
    with_old = batch.union(actor.compute_log_prob(batch))
    before_update = spike()
    stats = actor.update_actor(with_old)
    assert stats["log_prob_peak_memory_bytes"] < before_pass - 300 * MB, (stats, before_pass)
    assert stats["peak_memory_bytes"] < before_update - 300 * MB, (stats, before_update)
