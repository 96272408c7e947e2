"""Pipeline stages of the megatron engine: micro-batches through megatron-core's own schedules (1F1B when gradients
are wanted, forward-only for log-probs), and the whole model seen from any stage.

A stage holds a contiguous run of layers; the first also the embedding, the last the final norm and the output
layer (with tied embeddings, a copy of the embedding, kept equal by the engine, which sums both copies' gradients
over megatron's embedding group). Only the last stage sees logits, so the roles' functions (log-probs, losses) run there,
on the logits the schedule produced, and what they return is broadcast to the other stages: every rank of the
pipeline returns the same, as a rank of a pipeline-less engine does.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.single_controller.batch import Batch
from hybridflow.engines import collectives


class StageLogits:
    """The last stage's logits for one micro-batch, standing in for the model in a role's `fn(model, mb)`: the
    engine's `log_probs` calls the model, and gets the logits the schedule already computed."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.logits


def run_schedule(module: nn.Module, micro: list[Batch], fn: Callable[[Any, Batch], Any], backward: bool,
                 device: torch.device, inputs: Callable[[Batch], tuple[torch.Tensor, ...]]) -> list[Any]:
    """`fn` over the micro-batches through megatron's pipeline schedule; its outputs in order, on every stage.

    With `backward`, `fn` returns (loss, output) and 1F1B backpropagates each loss through every stage. The
    schedule divides each micro-batch's loss by their number; the loss is multiplied by it first, so gradients are
    those of the sum of `fn`'s losses, as the pipeline-less loop accumulates them. Micro-batches may differ in
    rows and length (dynamic batch sizes, the last one short): stages exchange shapes before each activation
    (megatron's variable_seq_lengths)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    outs: list[Any] = []
    n = len(micro)

    def forward_step(data: Any, model: nn.Module) -> tuple[torch.Tensor, Callable]:
        mb = next(data).to(device)
        ids, pos, mask = inputs(mb)
        hidden = model(ids, pos, attention_mask=mask)

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            out = fn(StageLogits(logits), mb)
            if backward:
                loss, out = out
            else:
                loss = logits.new_zeros(())
            outs.append(out)
            return loss * n, {}

        return hidden, loss_func

    config = module.config  # type: ignore[attr-defined]
    config.variable_seq_lengths = True
    first = micro[0]["input_ids"] if micro else torch.zeros(1, 1)
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro), model=[module],
                                num_microbatches=n, seq_length=first.shape[1], micro_batch_size=first.shape[0],
                                forward_only=not backward)
    return from_last_stage(outs if ps.is_pipeline_last_stage() else None)


def from_last_stage(value: Any) -> Any:
    """The last stage's `value` on every stage of this rank's pipeline (tensors travel on the CPU)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [_to_cpu(value) if ps.is_pipeline_last_stage() else None]
    collectives.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]


def _to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def stage_ranks() -> list[int]:
    """The global ranks of this rank's pipeline, stage by stage."""
    from megatron.core import parallel_state as ps

    return dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())


Entry = tuple[str, tuple[int, ...], torch.dtype]  # a tensor's name, shape and dtype


def catalog(own: list[Entry]) -> list[list[Entry]]:
    """Every stage's (name, shape, dtype) list, stage by stage (collective over the pipeline)."""
    from megatron.core import parallel_state as ps

    every: list = [None] * ps.get_pipeline_model_parallel_world_size()
    collectives.all_gather_object(every, own, group=ps.get_pipeline_model_parallel_group())
    return every
