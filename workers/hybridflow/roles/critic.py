"""A critic: the policy's architecture with a scalar value head, one value per response token. PPO has one for the
reward; Safe-RLHF a second one for the cost (columns prefixed `cost_`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridflow.algorithms.core import value_loss
from hybridflow.api.training import role_lora
from hybridflow.checkpoint.role import CheckpointMixin
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.protocol import Dispatch, register
from hybridflow.single_controller.context import WorkerContext
from hybridflow.models.lora import LoraSettings
from hybridflow.engines.train.base import TrainEngine, TrainEngineFactory, TrainSettings
from hybridflow.engines.train.fsdp import response_outputs
from hybridflow.models.builders import local_model_dir
from hybridflow.roles.common import release_free_memory
from hybridflow.roles.config import CriticConfig

if TYPE_CHECKING:
    from hybridflow.roles.rollout import RolloutWorker


def response_values(model: nn.Module, batch: Batch, shared: bool = False) -> torch.Tensor:
    """V(s_t) for each response position t, read where the token that precedes it sits: (B, R)."""
    return response_outputs(model, batch, shared, lm=False)[..., 0].float()


def critic_lora(config: CriticConfig) -> LoraSettings | None:
    """The critic's own adapter (spec.training.lora.critic; its value head trains whole), or None: every weight."""
    return LoraSettings.from_spec(role_lora("critic", config.training))


class CriticWorker(CheckpointMixin):
    checkpoint_name = "critic"

    def __init__(self, ctx: WorkerContext, config: CriticConfig, model_dir: str, prefix: str = "",
                 rollout: RolloutWorker | None = None) -> None:
        """`rollout`: the generation engine beside the actor when this critic shares its devices (PPO's critic
        updates first): it is released before this update too, so the update never runs beside it."""
        self.prefix = prefix  # reads `{prefix}values` and `{prefix}returns`
        self.rollout = rollout
        self.checkpoint_name = f"{prefix}critic"
        self.config = config
        torch.manual_seed(config.seed + 7)
        self.model_dir = local_model_dir(model_dir, config.model, config.seed)
        t = config.training
        build: TrainEngineFactory = config.train_engine.load()
        self.engine: TrainEngine = build(ctx, TrainSettings(
            self.model_dir, config.dtype, head="value", lr=t.critic_lr, grad_clip=t.grad_clip,
            compute_dtype=t.compute_dtype, dynamic_batch_size=t.dynamic_batch_size, shared_prompt=t.shared_prompt,
            seed=config.seed, lora=critic_lora(config), keep_gathered_for_backward=t.keep_gathered_for_backward,
            reduce_gradients_per_step=t.reduce_gradients_per_step, fp32_attention_backward=t.fp32_attention_backward))

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_values(self, batch: Batch) -> Batch:
        values = self.engine.forward_micro(batch, self.config.training.micro_batch_size,
                                           lambda model, mb: response_values(model, mb, self.engine.shared_prompt))
        return Batch({f"{self.prefix}values": values.cpu() * batch["response_mask"]})

    @register(Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        t = self.config.training
        if self.rollout is not None:  # generate -> train, as the actor's update does it
            self.rollout.release()
            release_free_memory()

        def loss_fn(model: nn.Module, mb: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            v = response_values(model, mb, self.engine.shared_prompt)
            p = self.prefix
            loss, clip_frac = value_loss(v, mb[f"{p}values"], mb[f"{p}returns"], mb["response_mask"], t.value_clip)
            return loss, {"vf_loss": loss.item(), "vf_clip_frac": clip_frac.item()}

        return self.engine.ppo_update(batch, t, self.config.prompts_per_step, loss_fn, per="tokens")  # a token mean
