"""A critic on the actor's devices (PPO's, which updates first) frees the generation engine beside it before its
own update, as the actor's update does: neither update runs beside generation memory (memory/terms.py prices the
updates without it). The engine is freed once per step, whichever update comes first, and is back after the
transition. The actor, its HF rollout and the critic as the worker host builds them on one rank."""
import pytest
import torch

from hybridflow.api import TinyModel, parse_job
from hybridflow.models.builders import build_tiny
from hybridflow.roles.actor import ActorWorker
from hybridflow.roles.config import actor_config, critic_config
from hybridflow.roles.critic import CriticWorker
from hybridflow.roles.rollout import RolloutWorker
from hybridflow.single_controller.context import WorkerContext
from support.tiny_actor import ragged_batch


@pytest.fixture
def beside(one_rank, tmp_path):
    model_dir = build_tiny(TinyModel(vocab_size=32, hidden_size=32, intermediate_size=64), tmp_path / "m", 0)
    spec = parse_job({"spec": {"models": {"actor": {"source": "path", "path": str(model_dir)}},
                               "algorithm": {"name": "ppo"},
                               "rollout": {"engine": "hf", "maxPromptLength": 8, "maxResponseLength": 6},
                               "training": {"microBatchSize": 4, "computeDtype": "float32"},
                               "trainer": {"promptsPerStep": 4}}}).spec
    ctx = WorkerContext(0, 1, 0, "cpu")
    actor = ActorWorker(ctx, actor_config(spec), str(model_dir))
    rollout = RolloutWorker(ctx, actor_config(spec), [], actor)
    critic = CriticWorker(ctx, critic_config(spec), str(model_dir), rollout=rollout)
    released = []
    free = rollout.generator.release
    rollout.generator.release = lambda: released.append("critic update" if updating else "after") or free()
    updating = False

    def update() -> None:
        nonlocal updating
        batch = ragged_batch()
        mask = batch["response_mask"].float()
        updating = True
        critic.update_critic(batch.with_columns(values=torch.zeros_like(mask), returns=mask))
        updating = False

    return rollout, released, update


def test_the_critic_frees_the_generation_engine_before_its_update_once_a_step(beside):
    rollout, released, update = beside
    update()
    assert released == ["critic update"]  # freed by the critic's update, before it trains
    rollout.release()  # what the actor's update calls next: nothing left to free this step
    assert released == ["critic update"]
    rollout.sync_weights()  # train -> generate: the engine holds weights again
    update()
    assert released == ["critic update", "critic update"]
