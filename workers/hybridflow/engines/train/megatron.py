"""Training engine on megatron-core: a GPTModel split tensor-parallel (t), into pipeline stages (p) and replicated
data-parallel (d) over the worker group's torch.distributed world, in Megatron's rank order
(rank = tp + t * (dp + d * pp)).

It loads and exports HF weights (`megatron_model` converts), computes log-probabilities vocab-parallel (no rank
ever holds a full row of logits), all-reduces gradients over the data-parallel group and takes their norm over
the tensor-parallel and pipeline groups. Pipeline stages run micro-batches through megatron's schedules
(`megatron_pipeline`); everything outside the engine (roles, checkpoints, the weight bridge) sees whole-model names:
a stage's layers under their global numbers. On CPU it runs on gloo with the fallbacks in `megatron_cpu`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.data.packing import padded_positions
from hybridflow.single_controller.batch import Batch
from hybridflow.engines.train import megatron_model as mm
from hybridflow.engines.train.megatron_pipeline import catalog, run_schedule, stage_ranks
from hybridflow.engines.train.base import TrainLoop
from hybridflow.engines.train.master_weights import MasterWeights
from hybridflow.engines import collectives

log = logging.getLogger(__name__)


def init_model_parallel(tp: int, pp: int = 1, seed: int = 0) -> None:
    """Megatron's process groups over the existing world; idempotent for the same sizes."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not torch.cuda.is_available():
        from hybridflow.engines.train.megatron_cpu import apply_cpu_fallbacks

        apply_cpu_fallbacks()
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(f"megatron is already initialised with (tp, pp) = {have}, not {(tp, pp)}")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)


def attention_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, mask) for megatron: mask is True where attention is *not* allowed (future or padding).

    RoPE scores depend only on the distance between positions, so megatron's absolute positions (it ignores
    position_ids for RoPE) give the same result as HF's padding-aware ones once padded keys are masked."""
    ids, keep = batch["input_ids"], batch["attention_mask"].bool()
    S = ids.shape[1]
    future = torch.triu(torch.ones(S, S, dtype=torch.bool, device=ids.device), diagonal=1)
    mask = future[None, None] | ~keep[:, None, None, :]
    return ids, padded_positions(keep), mask


def vocab_parallel_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.clone(), tokens)  # it shifts its input in place


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) whose last dim is split over the TP group: H = log Z - sum(e * l) / Z."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    m = logits.detach().max(-1, keepdim=True).values
    collectives.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - m
    e = shifted.exp()
    z = tp_sum(e.sum(-1))
    return z.log() - tp_sum((e * shifted).sum(-1)) / z


class MegatronEngine(TrainLoop):
    def __init__(self, model_dir: Path, dtype: str, tp: int, lr: float, grad_clip: float, device: str,
                 seed: int = 0, pp: int = 1) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        self.shape = mm.shape_from_hf(AutoConfig.from_pretrained(model_dir))
        if self.shape.kv_heads % tp or self.shape.vocab % tp:
            raise ValueError(f"spec.training.tensorParallel = {tp} must divide the model's key/value heads "
                             f"({self.shape.kv_heads}) and vocabulary ({self.shape.vocab})")
        if self.shape.layers % pp:
            raise ValueError(f"spec.training.pipelineParallel = {pp} must divide the model's {self.shape.layers} "
                             "layers (every stage holds as many)")
        init_model_parallel(tp, pp, seed)
        self.ps, self.seed = ps, seed
        self.device = torch.device("cuda" if device == "gpu" else "cpu")
        self.dtype = getattr(torch, dtype)
        self.compute_dtype = self.dtype  # megatron computes in its weights' dtype; below fp32, fp32 masters step
        self.pp_size, self.pp_rank = pp, ps.get_pipeline_model_parallel_rank()
        self.layer_offset = self.pp_rank * (self.shape.layers // pp)  # global number of this stage's first layer
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        groups = None
        if pp > 1:  # no embedding group for the model: the engine loads both tied copies and sums their gradients
            from megatron.core.process_groups_config import ProcessGroupCollection

            groups = ProcessGroupCollection.use_mpu_process_groups()
            groups.embd = None
        self.module = mm.build_gpt(mm.transformer_config(self.shape, self.dtype), self.shape, groups,
                                   pre_process=first, post_process=last).to(self.device)
        # tied embeddings split over stages: the last stage's output layer is a copy of the first's embedding
        self.tied_copy = self.module.output_layer.weight if self.shape.tied and last and not first else None
        per_stage = self.shape.layers // pp
        self.load_shards(mm.read_rank_shards(model_dir, self.shape, tp, self.tp_rank, first, last,
                                          range(self.layer_offset, self.layer_offset + per_stage)))
        self.grad_clip = grad_clip
        # below fp32 the optimizer steps fp32 masters, cast back into the module after each step (master_weights)
        trained = self.adapt()
        self.masters = MasterWeights(trained) if any(p.dtype != torch.float32 for p in trained) else None
        stepped = self.masters.masters if self.masters else trained
        self.optimizer = torch.optim.AdamW(stepped, lr=lr, weight_decay=0.0)
        if self.masters:
            self.optimizer.register_step_post_hook(lambda *_: self.masters.publish())
        self._device_mesh: Any = None  # made on first use by sharded checkpoints (_mesh)
        self._stages: list | None = None  # every stage's whole tensors, made on first use by whole_shards

    def adapt(self) -> list[nn.Parameter]:
        """What the optimizer steps: every parameter (a LoRA engine injects its adapters here: megatron_lora)."""
        return list(self.module.parameters())

    @property
    def tp_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_rank()

    @property
    def tp_size(self) -> int:
        return self.ps.get_tensor_model_parallel_world_size()

    @property
    def dp_rank(self) -> int:
        return self.ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self.ps.get_data_parallel_world_size()

    def global_name(self, name: str) -> str:
        """A parameter's name in the whole model: a stage's layer i is layer i + offset; a tied output layer is the
        embedding it copies."""
        if name == "output_layer.weight" and self.tied_copy is not None:
            return "embedding.word_embeddings.weight"
        return mm.global_layer_name(name, self.layer_offset)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This stage's parameters under whole-model names (the tied copy under the embedding's name too)."""
        for name, p in self.module.named_parameters():
            yield self.global_name(name), p

    def trained_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the optimizer steps, named as `named_parameters`: the fp32 masters below fp32, else the parameters
        (what checkpoints keep)."""
        for name, p in self.named_parameters():
            yield name, self.masters.master_of(p) if self.masters else p

    def load_shards(self, local: dict[str, torch.Tensor]) -> None:
        """Take this rank's own shards (whole-model megatron names, this TP rank's part: `read_rank_shards`)."""
        own = self.module.state_dict()
        names = {k: self.global_name(k) for k in own if not k.endswith("_extra_state")}
        missing = [g for g in names.values() if g not in local]
        if missing:
            raise KeyError(f"weights lack {missing[:3]}...")
        for k, g in names.items():
            if local[g].shape != own[k].shape:
                raise ValueError(f"{g}: this rank's shard {tuple(local[g].shape)} != the model's {tuple(own[k].shape)}")
        own.update({k: local[g].to(own[k].dtype) for k, g in names.items()})
        self.module.load_state_dict(own)

    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        """Take this rank's TP shard of every (unsharded, whole-model-named megatron) tensor of its stage."""
        names = {self.global_name(k) for k in self.module.state_dict() if not k.endswith("_extra_state")}
        self.load_shards({g: mm.shard(g, full[g], self.tp_size, self.tp_rank) for g in names if g in full})

    # --- model outputs ---

    def log_probs(self, model: nn.Module, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the response tokens, and the vocab-parallel logits that predicted them (B, R, V/t)."""
        ids, pos, mask = attention_inputs(batch)
        logits = model(ids, pos, attention_mask=mask)
        R = batch["responses"].shape[1]
        logits = logits[:, -R - 1: -1, :].float() / temperature
        return vocab_parallel_log_probs(logits, batch["responses"]), logits

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_entropy(logits)

    def run_micro_batches(self, micro: list[Batch], fn: Any, backward: bool) -> list[Any]:
        """Through the pipeline schedule when the model is split into stages (1F1B for gradients)."""
        if self.pp_size == 1:
            return super().run_micro_batches(micro, fn, backward)
        return run_schedule(self.module, micro, fn, backward, self.device, attention_inputs)

    # --- gradients ---

    def clip_grad_norm(self) -> torch.Tensor:
        """Average gradients over data-parallel replicas, then clip by the norm of the whole (unsharded) model:
        TP-split parameters add their squares over the TP group, replicated ones (norms) count once, stages add
        theirs over the pipeline. Tied embeddings split over stages first sum their two copies' gradients (megatron's
        embedding group), so both copies take the same step and stay equal; the norm counts them once."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.dp_size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            collectives.all_reduce(flat, group=self.ps.get_data_parallel_group())
            flat /= self.dp_size
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
                offset += n
        if self.pp_size > 1 and self.shape.tied and self.ps.is_rank_in_embedding_group():
            shared = self.module.shared_embedding_or_output_weight()
            if shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            collectives.all_reduce(shared.grad, group=self.ps.get_embedding_group())
        split = torch.zeros((), dtype=torch.float64, device=self.device)
        whole = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            if p is self.tied_copy:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                split += sq
            else:
                whole += sq
        collectives.all_reduce(split, group=self.ps.get_tensor_model_parallel_group())
        total = split + whole
        if self.pp_size > 1:
            collectives.all_reduce(total, group=self.ps.get_pipeline_model_parallel_group())
        norm = total.sqrt()
        scale = self.grad_clip / (norm + 1e-6)
        if scale < 1:
            for p in params:
                p.grad.mul_(scale.to(p.grad.dtype))
        if self.masters:
            self.masters.take_grads()
        return norm.float()

    # --- whole-model views ---

    def gather_tp(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or mm.split_rule(name) == "replicated":
            return shard
        parts = [torch.empty_like(shard) for _ in range(self.tp_size)]
        collectives.all_gather(parts, shard.contiguous(), group=self.ps.get_tensor_model_parallel_group())
        return mm.unshard(name, parts)

    def named_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's shards under whole-model names, each once (not the tied copy)."""
        for name, p in self.named_parameters():
            if p is not self.tied_copy:
                yield name, p.detach()

    def whole_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter of the whole model, whole, megatron names, on every rank: gathered over the TP group
        and broadcast from its stage over the pipeline (collective over both)."""
        if self.pp_size == 1:
            for name, t in self.named_shards():
                yield name, self.gather_tp(name, t)
            return
        mine = dict(self.named_shards())
        if self._stages is None:  # which whole tensors each stage holds: fixed for the engine's life
            self._stages = catalog([(n, self._whole_shape(n, t), t.dtype) for n, t in mine.items()])
        ranks, group = stage_ranks(), self.ps.get_pipeline_model_parallel_group()
        for stage, entries in enumerate(self._stages):
            for name, shape, dtype in entries:
                if stage == self.pp_rank:
                    t = self.gather_tp(name, mine[name]).contiguous()
                else:
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                collectives.broadcast(t, src=ranks[stage], group=group)
                yield name, t

    def _whole_shape(self, name: str, shard: torch.Tensor) -> tuple[int, ...]:
        dim = mm.shard_dim(name)
        shape = list(shard.shape)
        if dim is not None:
            shape[dim] *= self.tp_size
        return tuple(shape)

    def full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Whole tensors under HF names (collective over the TP group and the pipeline): export, and generation
        engines at t_g=1 fed without the 3D-HybridEngine."""
        yield from mm.megatron_to_hf_items(self.whole_shards(), self.shape)

    def num_parameters(self) -> int:
        return int(sum(t.numel() for _, t in self.full_params()))  # collective: every rank counts

    def num_trained_parameters(self) -> int:
        return self.num_parameters()

    def state_dict(self) -> dict:
        """HF-named whole weights (loadable by the FSDP engine or `from_pretrained`), plus every model-parallel
        rank's optimizer state, TP rank fastest (data-parallel replicas are identical: replica 0's speaks for all)."""
        model = {k: v.cpu().clone() for k, v in self.full_params()}
        group = self.ps.get_model_parallel_group()
        optim: list = [None] * dist.get_world_size(group)
        collectives.all_gather_object(optim, self.optimizer.state_dict(), group=group)
        return {"model": model, "optimizer_tp": optim, "tensor_parallel": self.tp_size,
                "pipeline_parallel": self.pp_size}

    def load_state_dict(self, state: dict) -> None:
        self.load_full(mm.hf_to_megatron(state["model"], self.shape))
        if self.masters:  # this format keeps whole weights in the module's dtype: the masters start from them
            self.masters.refresh()
        optim = state.get("optimizer_tp")
        layout = (state.get("tensor_parallel"), state.get("pipeline_parallel", 1))
        if optim and layout == (self.tp_size, self.pp_size):
            self.optimizer.load_state_dict(optim[dist.get_rank(self.ps.get_model_parallel_group())])
        else:
            log.warning("checkpoint optimizer state is for (tensorParallel, pipelineParallel) = %s, not %s: weights "
                        "restored, optimizer starts fresh", layout, (self.tp_size, self.pp_size))

    # --- sharded (DCP) checkpoints ---

    def _mesh(self) -> Any:
        """(dp, tp) device mesh of this stage over megatron's own groups, in its rank order (rank = tp_rank + t *
        (dp_rank + d * pp_rank)). Each stage saves its own layers, so the meshes of different stages never share a
        tensor (except the tied embedding's two equal copies, which the checkpoint keeps once)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(dist.get_world_size()).view(self.pp_size, self.dp_size, self.tp_size)[self.pp_rank]
            self._device_mesh = DeviceMesh.from_group(
                [self.ps.get_data_parallel_group(), self.ps.get_tensor_model_parallel_group()], self.device.type,
                mesh=ranks, mesh_dim_names=("dp", "tp"))
            coordinate = self._device_mesh.get_coordinate()
            if tuple(coordinate or ()) != (self.dp_rank, self.tp_rank):  # the mesh assumes megatron's tp-first rank order
                raise RuntimeError(f"rank {dist.get_rank()} is at {coordinate} of the checkpoint mesh, but megatron "
                                   f"placed it at (dp, tp) = {(self.dp_rank, self.tp_rank)}")
        return self._device_mesh

    def _hf_blocks(self, items: Iterable[tuple[str, torch.Tensor]],
                   params_only: bool = False) -> Iterator[tuple[str, Any]]:
        """This rank's shards (megatron names) as DTensors of the whole HF tensors: Shard(dim) over the TP group,
        replicated over data parallel. `params_only` drops the tied lm_head (not a parameter of its own), as
        the optimizer state of an HF module names it."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        local = mm.local_shape(self.shape, self.tp_size)
        for name, t in items:
            dim = mm.shard_dim(name)
            placements = [Replicate(), Replicate() if dim is None else Shard(dim)]
            for hf, block in mm.megatron_to_hf_items([(name, t)], local):
                if params_only and self.shape.tied and hf == "lm_head.weight":
                    continue
                yield hf, DTensor.from_local(block, self._mesh(), placements, run_check=False)

    def _optim_template(self, p: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        """AdamW's state for `p` as its first step makes it (what a resuming engine's template is built from)."""
        fused_or_graph = group.get("fused") or group.get("capturable")
        step = (torch.zeros((), dtype=torch.float32, device=p.device) if fused_or_graph
                else torch.tensor(0.0, dtype=torch.float32))
        out = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
               "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        if group.get("amsgrad"):
            out["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return out

    def checkpoint_state(self) -> dict[str, Any]:
        """The model and AdamW state as get_state_dict gives them for an HF module under FSDP: {"model": {hf_name:
        DTensor}, "optimizer": {"state": {hf_name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}},
        each DTensor this rank's block of the whole HF tensor. Moments split like their parameters; a megatron
        parameter that fuses several HF ones (QKV, fc1) gives each of them a copy of its step. A fresh optimizer
        contributes zero state (not installed: building the template changes nothing).

        The model's blocks alias the parameters where the conversion allows (q/k/v only where a rank holds a single
        query group), so a load writes into them; `load_checkpoint_state` then completes it."""
        model = dict(self._hf_blocks((n, p.detach()) for n, p in self.trained_parameters()))
        if self.optimizer is None:
            return {"model": model}
        names = {p: n for n, p in self.trained_parameters()}
        state: dict[str, dict[str, Any]] = {}
        groups = []
        for group in self.optimizer.param_groups:
            params: list[str] = []
            for p in group["params"]:
                own = self.optimizer.state.get(p) or self._optim_template(p, group)
                entries: dict[str, dict[str, Any]] = {}
                for key, v in own.items():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        for hf, block in self._hf_blocks([(names[p], v.detach())], params_only=True):
                            entries.setdefault(hf, {})[key] = block
                for hf in entries:  # scalars (the step) per HF name
                    entries[hf].update({k: v.clone() if torch.is_tensor(v) else v for k, v in own.items()
                                        if not (torch.is_tensor(v) and v.shape == p.shape)})
                state.update(entries)
                params.extend(entries)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        return {"model": model, "optimizer": {"state": state, "param_groups": groups}}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Each tensor's blocks (DTensors that a load filled in this rank's layout) fused back into this rank's
        shards; the optimizer state is installed whether or not the optimizer has any yet."""
        local = mm.local_shape(self.shape, self.tp_size)

        def shards(blocks: dict[str, Any]) -> dict[str, torch.Tensor]:
            return mm.hf_to_megatron({k: v.to_local() if hasattr(v, "to_local") else v for k, v in blocks.items()},
                                     local)

        model = shards(state["model"])
        with torch.no_grad():
            for name, p in self.trained_parameters():
                p.copy_(model[name])
        if self.masters:
            self.masters.publish()
        if self.optimizer is None:
            return
        optim = state.get("optimizer")
        if optim is None:
            log.warning("checkpoint has no optimizer state: weights restored, optimizer starts fresh")
            return
        saved = optim["state"]
        keys = {k for entry in saved.values() for k in entry}
        moments = {k: shards({hf: entry[k] for hf, entry in saved.items()}) for k in keys
                   if all(hasattr(entry[k], "to_local") for entry in saved.values())}
        names = {p: n for n, p in self.trained_parameters()}
        first_hf = {}  # megatron name -> the first HF name it converts to (whose scalars it takes)
        for n, p in self.named_parameters():
            meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
            first_hf[n] = next(hf for hf, _ in mm.megatron_to_hf_items([(n, meta)], local)
                               if not (self.shape.tied and hf == "lm_head.weight"))
        if len(optim["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(optim['param_groups'])} optimizer parameter groups, the engine "
                             f"{len(self.optimizer.param_groups)}")
        for group in self.optimizer.param_groups:  # the moments from the checkpoint; lr and betas stay the spec's
            for p in group["params"]:
                n = names[p]
                entry = saved[first_hf[n]]
                self.optimizer.state[p] = {k: moments[k][n] if k in moments else v for k, v in entry.items()}
