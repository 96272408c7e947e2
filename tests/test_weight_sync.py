"""The train -> generate transition: after an actor update, the running vLLM engine holds exactly the trained
weights (checksums) and generates what HF generates with them (greedy), without being re-created."""
import pytest
import ray
import torch

from hybridflow import trainer
from hybridflow.cli import start_local_ray
from hybridflow.data.packing import unpack_responses
from hybridflow.models.builders import materialize
from hybridflow.spec import load_job

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_generation_engine_follows_the_trained_weights(tmp_path, model_cache, ray_tmp, engine):
    job = load_job(trainer.Path(__file__).resolve().parents[1] / "examples" / "tiny-grpo.yaml")
    job.spec.rollout.engine = engine
    job.spec.trainer.checkpoint_dir = str(tmp_path / "ckpt")
    job.spec.trainer.prompts_per_step = 8
    job.spec.training.actor_lr = 0.05  # a big step, so that stale weights could not pass for new ones
    model_dir = materialize(job.spec.models.actor, model_cache, job.spec.trainer.seed)
    task = trainer.build_task(job, model_dir)
    start_local_ray(job, ray_tmp)
    w = trainer.build_workers(job, model_dir, task, None, None)
    try:
        actor = w.roles["actor"]
        engine_ids_before = [id(x) for x in actor.rollout_checksum()]
        before = actor.rollout_checksum()
        assert before == pytest.approx(actor.train_checksum(), rel=0, abs=1e-6)

        prompts = trainer.prompt_batch(task.train[:8])
        stats, stages = trainer.rlhf_iteration(job, w, task, prompts)
        assert stats["weight_sync_bytes"] > 0 and stages["weight_sync"] > 0

        after_train, after_rollout = actor.train_checksum(), actor.rollout_checksum()
        assert after_train[0] != pytest.approx(before[0], abs=1e-3), "the update did not change the weights"
        assert after_rollout == after_train, "generation weights differ from training weights after the sync"
        assert len(engine_ids_before) == len(after_rollout)

        # Greedy generation by the synced engine equals HF greedy on the trained weights.
        saved = trainer.save(job, w, trainer.Path(job.spec.trainer.checkpoint_dir), 1,
                             trainer.PromptStream(task.train, 8, 0))
        state = torch.load(saved / "actor.pt", weights_only=False)["model"]
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir)
        hf.load_state_dict(state, strict=False)
        hf.eval()
        held_out = task.eval[:8]
        got = unpack_responses(trainer.resolve(actor.generate(trainer.prompt_batch(held_out), greedy=True)))
        for sample, resp in zip(held_out, got):
            ids = torch.tensor([sample.prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(resp), do_sample=False,
                              min_new_tokens=len(resp), pad_token_id=0)[0, ids.shape[1]:].tolist()
            assert resp == ref
    finally:
        w.shutdown()
        ray.shutdown()
