"""Readings from inside a worker process, for checks that must see what the public role methods do not report
(tests/gpu, the GPU suite): a registry of name -> function(host, *args) -> a JSON-able value, run by
`WorkerHost.diagnose(name, *args)`. Nothing here changes what a job computes; `precision_probe` only adds hooks
that record dtypes.

  device_memory        the generation engine's sleep flag and this process's / the device's memory in use
  process_group        the default process group's backend (and which c10d backend serves CPU / CUDA tensors), the
                       FSDP mesh's group, one all-reduce of a device tensor and one of a CPU tensor, LOCAL_RANK /
                       CUDA_VISIBLE_DEVICES as the worker took them (a collective: every rank at once)
  precision_probe      hooks on the actor's engine recording, during later steps, a decoder Linear's dtypes while
                       it runs and the gradients' / parameters' dtypes at each optimizer step
  precision            the actor's compute dtype, master (parameter, shard) dtypes, AdamW state dtypes, and what
                       precision_probe recorded
  generation_weights   the generation engine's embedding against the trainer's cast to the engine's dtype, and every
                       generation tensor against the trainer's (a collective: every rank at once)
  megatron             the megatron training engine: device, backend, TP / DP sizes, the generation engine's class

The functions take the host duck-typed (`roles`, `ctx`): the CPU tests call them on a stand-in host
(tests/single_controller/test_diagnostics.py)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

from hybridflow.registry import Registry

Diagnostic = Callable[..., Any]
DIAGNOSTICS: Registry[Diagnostic] = Registry("diagnostic")
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # vLLM's fused


def diagnostic(name: str) -> Callable[[Diagnostic], Diagnostic]:
    """Registers fn(host, *args) under `name` (a name registered twice is refused)."""
    return DIAGNOSTICS.register(name)


def run_diagnostic(host: Any, name: str, *args: Any) -> Any:
    """The registered diagnostic `name` on `host` (WorkerHost.diagnose); an unknown name raises KeyError naming the
    registered ones."""
    return DIAGNOSTICS[name](host, *args)


def _generator_kind(host: Any) -> str:
    return type(host.roles["rollout"].generator).__name__


def _state(host: Any) -> dict[str, Any]:
    """What the diagnostics keep in a worker between calls (the precision probe's records)."""
    return vars(host).setdefault("_diagnostics_state", {})


@diagnostic("device_memory")
def device_memory(host: Any, reset_peak: bool = False) -> dict[str, Any]:
    """The generation engine's sleep flag (vLLM's; None for engines without a sleep mode) and the memory in use:
    the device's (total - free, from the CUDA driver) with torch's allocator counters beside it, or this process's
    RSS on a CPU. `reset_peak` starts torch's peak counter afresh after reading it."""
    import torch

    kind = _generator_kind(host)
    generator = host.roles["rollout"].generator
    out: dict[str, Any] = {"engine": kind, "asleep": bool(generator.asleep) if kind == "VLLMRollout" else None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        out.update(device_used=int(total - free), device_total=int(total),
                   torch_allocated=int(torch.cuda.memory_allocated()),
                   torch_reserved=int(torch.cuda.memory_reserved()),
                   torch_peak_allocated=int(torch.cuda.max_memory_allocated()))
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
    else:
        import psutil

        out["rss"] = int(psutil.Process().memory_info().rss)
    return out


@diagnostic("process_group")
def process_group(host: Any) -> dict[str, Any]:
    """The process group as this rank sees it, and one all-reduce of a device tensor and one of a CPU tensor (on a
    GPU world: gloo's part of the mixed backend). Every rank must run it at once."""
    import torch
    import torch.distributed as dist

    on_gpu = host.ctx.device == "gpu"
    dev = torch.device("cuda" if on_gpu else "cpu")
    out: dict[str, Any] = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                           "backend": str(dist.get_backend())}
    with contextlib.suppress(Exception):
        out["backend_config"] = str(dist.get_backend_config())
    out["backend_class"] = {}
    for kind in ("cpu", "cuda") if on_gpu else ("cpu",):
        try:  # private API: which c10d backend serves this device type's tensors
            pg = dist.distributed_c10d._get_default_group()
            out["backend_class"][kind] = type(pg._get_backend(torch.device(kind))).__name__
        except Exception as err:
            out["backend_class"][kind] = f"none ({type(err).__name__}: {str(err)[:120]})"
    out["env"] = {k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")}
    out["ctx_local_rank"] = host.ctx.local_rank
    module = host.roles["actor"].engine.module
    p = next(module.parameters())
    out["param_type"], out["param_device"] = type(p).__name__, str(p.device)
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None:
        out["mesh_device_type"] = mesh.device_type
        out["mesh_backend"] = str(dist.get_backend(mesh.get_group()))
    x = torch.full((8,), float(dist.get_rank() + 1), device=dev)
    dist.all_reduce(x)
    y = torch.full((4,), float(dist.get_rank() + 1))  # a CPU tensor
    try:
        dist.all_reduce(y)
        out["cpu_all_reduce"] = float(y[0].item())
    except Exception as err:
        out["cpu_all_reduce"] = f"{type(err).__name__}: {str(err)[:200]}"
    if on_gpu:
        torch.cuda.synchronize()
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda_device"] = torch.cuda.current_device()
        out["cuda_device_count"] = torch.cuda.device_count()
        with contextlib.suppress(Exception):
            out["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    out["all_reduce"] = float(x[0].item())
    out["all_reduce_expected"] = float(sum(range(1, dist.get_world_size() + 1)))
    return out


@diagnostic("precision_probe")
def precision_probe(host: Any) -> bool:
    """Hooks on the actor's engine that record the dtypes that only exist mid-update: the first Linear's weight and
    output while it runs (FSDP2's gathered compute-dtype copy) and, before every optimizer step, the gradients' and
    the parameters' dtypes (six of each at most). False if the engine has no optimizer (nothing to record there)."""
    import torch

    engine = host.roles["actor"].engine
    rec: dict[str, list] = {"forward": [], "step": []}
    _state(host)["precision"] = rec
    lin = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear))  # layer 0's q_proj

    def forward_hook(m, inputs, output) -> None:
        if len(rec["forward"]) < 6:
            rec["forward"].append({"weight": str(m.weight.dtype), "weight_type": type(m.weight).__name__,
                                   "input": str(inputs[0].dtype), "output": str(output.dtype),
                                   "grad_enabled": torch.is_grad_enabled()})

    def step_hook(opt, args, kwargs) -> None:
        if len(rec["step"]) < 6:
            params = [p for g in opt.param_groups for p in g["params"]]
            grads = [p.grad for p in params if p.grad is not None]
            rec["step"].append({"grad_dtypes": sorted({str(g.dtype) for g in grads}),
                                "grad_types": sorted({type(g).__name__ for g in grads}),
                                "grads": len(grads), "params": len(params),
                                "param_dtypes": sorted({str(p.dtype) for p in params})})

    lin.register_forward_hook(forward_hook)
    if engine.optimizer is None:
        return False
    engine.optimizer.register_step_pre_hook(step_hook)
    return True


@diagnostic("precision")
def precision(host: Any) -> dict[str, Any]:
    """The actor's engine now: compute dtype, parameters' (master) dtypes and their local shards', AdamW state
    dtypes; and what precision_probe recorded since it was installed."""
    engine = host.roles["actor"].engine
    params = list(engine.module.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    state: dict[str, set] = {}
    optimizer = engine.optimizer
    if optimizer is not None:
        for st in optimizer.state.values():
            for k, v in st.items():
                if hasattr(v, "dtype"):
                    state.setdefault(k, set()).add(str(v.dtype))
    rec = _state(host).get("precision") or {}
    return {"engine": type(engine).__name__, "compute_dtype": str(engine.compute_dtype),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "shard_dtypes": sorted({str(t.dtype) for t in local}),
            "shard_devices": sorted({str(t.device) for t in local}),
            "shard_bytes": int(sum(t.numel() * t.element_size() for t in local)),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "optimizer_state_dtypes": {k: sorted(v) for k, v in state.items()},
            "optimizer_states": len(optimizer.state) if optimizer is not None else 0,
            "probe_installed": "precision" in _state(host),
            "forward": rec.get("forward", []), "step": rec.get("step", [])}


def _generation_embedding(kind: str, generator: Any) -> Any:
    if kind == "VLLMRollout":
        return generator.model.model.embed_tokens.weight.detach()
    if kind == "MegatronRollout":  # megatron names, its generation TP shard (whole at TP 1)
        return generator.params["embedding.word_embeddings.weight"].detach()
    return generator.model.get_input_embeddings().weight.detach()


@diagnostic("generation_weights")
def generation_weights(host: Any) -> dict[str, Any]:
    """The generation engine's input embedding against the trainer's cast to the engine's dtype, element by element
    (the engine may pad the vocabulary: the trainer's rows are compared, the padding rows must be zero); `all`:
    every generation tensor against the trainer's (megatron generation: its native shards). Collective (the
    trainer's whole weights are gathered): every rank at once."""
    import torch

    actor = host.roles["actor"]
    role = host.roles["rollout"]
    generator = role.generator
    kind = type(generator).__name__
    gen = _generation_embedding(kind, generator)
    if actor.config.train_engine.model_parallel:  # megatron: the embedding's TP shards gathered whole
        name = "embedding.word_embeddings.weight"
        shards = dict(actor.engine.named_shards())
        train = actor.engine.gather_tp(name, shards[name]).detach()
    else:
        train = next(t for n, t in actor.engine.full_params() if "embed_tokens" in n).detach()
    rows = train.shape[0]
    g = gen[:rows].cpu()
    cast = train.to(gen.dtype).cpu()
    same_shape = tuple(g.shape) == tuple(cast.shape)
    platform = None
    with contextlib.suppress(Exception):
        from vllm.platforms import current_platform

        platform = current_platform.device_type
    every = _every_native_shard(actor, generator) if kind == "MegatronRollout" else _every_tensor(actor, generator)
    return {
        "all": every, "engine": kind, "vllm_platform": platform,
        # what train_checksum casts the trainer's weights to (the training engine's compute dtype)
        "generation_dtype": str(getattr(role, "generation_dtype", "")).removeprefix("torch."),
        "gen_dtype": str(gen.dtype), "gen_device": str(gen.device), "gen_rows": int(gen.shape[0]),
        "train_dtype": str(train.dtype), "train_device": str(train.device), "train_rows": int(rows),
        "exact": bool(same_shape and torch.equal(g, cast)),
        "max_abs_diff": float((g.double() - cast.double()).abs().max()) if same_shape else None,
        "padding_zero": bool(gen[rows:].count_nonzero().item() == 0) if gen.shape[0] > rows else True,
        "gen_sum": float(gen.double().sum()), "train_sum": float(train.double().sum()),
        "train_cast_sum": float(cast.double().sum()), "train_abs_sum": float(train.double().abs().sum()),
        "unit_roundoff": float(torch.finfo(gen.dtype).eps) / 2,
    }


def _compared(exact: list, differ: list, unmatched: list, packed: int, unused: set[str]) -> dict[str, Any]:
    return {"tensors": len(exact) + len(differ), "exact": len(exact), "differ": differ[:8], "unmatched": unmatched[:8],
            "packed": packed, "trainer_unused": sorted(unused)[:8]}


def _every_native_shard(actor: Any, generator: Any) -> dict[str, Any]:
    """megatron generation: every parameter it holds against the training engine's shard of the same name (equal
    shapes only where generation TP = training TP; otherwise the difference is reported)."""
    import torch

    train = {n: t.detach() for n, t in actor.engine.named_shards()}
    exact, differ, unmatched = [], [], []
    for name, param in generator.params.items():
        have = param.detach()
        if name not in train:
            unmatched.append(name)
        elif tuple(have.shape) != tuple(train[name].shape):
            differ.append(f"{name} (shape {tuple(have.shape)} vs {tuple(train[name].shape)})")
        elif torch.equal(have.cpu(), train[name].to(have.dtype).cpu()):
            exact.append(name)
        else:
            diff = float((have.double().cpu() - train[name].double().cpu()).abs().max())
            differ.append(f"{name} (max |diff| {diff:.3e})")
    return _compared(exact, differ, unmatched, 0, set(train) - set(generator.params))


def _every_tensor(actor: Any, generator: Any) -> dict[str, Any]:
    """Every vLLM (or HF generation) parameter against the trainer's whole HF-named weights (`full_params()`,
    collective) cast to the engine's dtype: vLLM stacks q/k/v and gate/up (dim 0) and pads the vocabulary rows
    (which must be zero); HF holds them as the trainer names them. Empty parameters (vLLM's CPU backend packs
    linear weights into its kernels) are counted as `packed`, not compared."""
    import torch

    train = {n: t.detach() for n, t in actor.engine.full_params()}
    used: set[str] = set()
    exact, differ, unmatched, packed = [], [], [], 0
    for name, param in generator.model.named_parameters():
        have = param.detach()
        if have.numel() == 0:
            packed += 1
            continue
        fused = next((f for f in STACKED if f".{f}." in name), None)
        sources = [name.replace(fused, part) for part in STACKED[fused]] if fused else [name]
        if any(src not in train for src in sources):
            unmatched.append(name)
            continue
        used.update(sources)
        want = torch.cat([train[src] for src in sources], 0) if fused else train[name]
        want = want.to(have.dtype)
        if have.dim() == want.dim() and have.shape[0] > want.shape[0] and have.shape[1:] == want.shape[1:]:
            pad = have[want.shape[0]:]  # vocabulary padding
            have = have[:want.shape[0]]
            if pad.count_nonzero().item():
                differ.append(f"{name} (padding rows not zero)")
                continue
        if tuple(have.shape) != tuple(want.shape):
            differ.append(f"{name} (shape {tuple(have.shape)} vs {tuple(want.shape)})")
        elif torch.equal(have.cpu(), want.cpu()):
            exact.append(name)
        else:
            diff = float((have.double().cpu() - want.double().cpu()).abs().max())
            differ.append(f"{name} (max |diff| {diff:.3e})")
    return _compared(exact, differ, unmatched, packed, set(train) - used)


@diagnostic("megatron")
def megatron(host: Any) -> dict[str, Any]:
    """The megatron training engine on this rank: its device and its parameters', the backend, TP and DP sizes,
    and the generation engine's class."""
    import torch.distributed as dist

    e = host.roles["actor"].engine
    p = next(e.module.parameters())
    return {"rank": dist.get_rank(), "engine": type(e).__name__, "device": str(e.device),
            "param_device": str(p.device), "param_dtype": str(p.dtype), "backend": str(dist.get_backend()),
            "tp": e.tp_size, "dp": e.dp_size, "rollout": _generator_kind(host)}
