"""The train -> generate transition: after an actor update, the running vLLM engine holds exactly the trained
weights (checksums) and generates what HF generates with them (greedy), without being re-created."""
import pytest

from pathlib import Path

from hybridflow.trainer import loop, setup, task as tasks
from hybridflow.checkpoint import CheckpointRoot, checkpointer
from hybridflow.trainer.step import AlgorithmState
from hybridflow.models.builders import materialize
from hybridflow.api import load_job
from support.hf_greedy import assert_greedy_matches_hf
from support.paths import ROOT

pytestmark = pytest.mark.slow


def _start_workers(job, tmp_path, model_cache, local_ray, prompts=8):
    """Eight prompts a step (unless told) and a big learning rate, so that stale weights could not pass for new ones.
    No reference policy (nor KL term): it is a model of its own that these tests neither sync nor check."""
    job.spec.trainer.checkpoint_dir = str(tmp_path / "ckpt")
    job.spec.trainer.prompts_per_step = prompts
    job.spec.training.actor_lr = 0.05
    job.spec.algorithm.kl_coef = 0.0
    job.spec.models.reference = False
    model_dir = materialize(job.spec.models.actor, model_cache, job.spec.trainer.seed)
    task = tasks.build_task(job, model_dir)
    local_ray(job)
    return setup.build_workers(job, model_dir, task, None, None), task, model_dir


# vLLM in fp32 runs with SmolLM2 (its update is the slow one: 2 prompts); vLLM fed by the cross-pool stream after
# 40 updates in tests/trainer/test_async_rollout.py (checksums and greedy == HF there too).
@pytest.mark.parametrize("example,engine,dtype", [("tiny-grpo.yaml", "vllm", "bfloat16"),
                                                  ("tiny-grpo.yaml", "hf", "float32"),
                                                  ("smollm2-arithmetic.yaml", "vllm", "float32")])
def test_generation_engine_follows_the_trained_weights(tmp_path, model_cache, local_ray, example, engine, dtype):
    """The tiny Qwen2 model, and SmolLM2 (Llama, tied embeddings, grouped-query attention) in vLLM; in bf16, vLLM
    holds the fp32 masters rounded to bf16 (the checksums compare in the generation dtype, HF runs in it too)."""
    job = load_job(ROOT / "examples" / example)
    job.spec.rollout.engine = engine
    job.spec.training.compute_dtype = dtype
    # An entropy bonus moves the weights whatever rewards the samples get, so SmolLM2, whose update costs about a
    # second per row on 2 CPU cores, trains on two prompts (eight rows) instead of eight.
    job.spec.algorithm.entropy_coef = 0.01
    train_prompts = 2 if example.startswith("smollm2") else 8
    w, task, model_dir = _start_workers(job, tmp_path, model_cache, local_ray, train_prompts)
    try:
        rollout = w.roles["rollout"]
        engines_before = rollout.instance_id()
        assert len(set(engines_before)) == len(engines_before) > 1, "each rank has its own engine"
        before = rollout.weight_checksums()
        assert [x["embedding"] for x in before] == pytest.approx([x["embedding"] for x in rollout.train_checksum()],
                                                                 rel=0, abs=1e-6)

        prompts = tasks.prompt_batch(task.train[:train_prompts])
        stats, stages = loop.run_iteration(loop.build_step(job, w, task), prompts)
        assert stats["reshard_bytes"] > 0 and stages["reshard"] > 0

        after_train, after_rollout = rollout.train_checksum(), rollout.weight_checksums()
        assert after_train[0]["embedding"] != pytest.approx(before[0]["embedding"], abs=1e-3), \
            "the update did not change the weights"
        assert after_rollout == after_train, "generation weights differ from training weights after the sync"
        assert rollout.instance_id() == engines_before, "the generation engine was re-created, not updated"

        # Greedy generation by the synced engine equals HF greedy on the trained weights.
        assert_greedy_matches_hf(job, w, task, model_dir, step=1)
    finally:
        w.shutdown()


# Stages joined across TP ranks too (t=2 x p=2 -> t_g=1: a micro-DP group of four) is checked bit for bit, at every
# bucket size, by tests/engines/test_hybrid_engine.py::test_megatron_micro_dp_gather_is_exact.
# (TP=4 -> t_g=2, micro-DP gathered, is the vLLM case's: its generation groups are not consecutive ranks; the
# megatron generation engine at t_g=2 is the TP2xPP2 case's)
@pytest.mark.parametrize("t,p,t_g,rollout", [(2, 1, 1, "vllm"), (2, 2, 2, "megatron"), (1, 2, 1, "vllm"),
                                             (4, 1, 2, "vllm")],
                         ids=["t2-tg1-vllm", "t2xp2-tg2-megatron", "p2-tg1-vllm", "t4-tg2-vllm"])
def test_megatron_actor_reshards_into_another_layout_exactly(tmp_path, model_cache, local_ray, t, p, t_g, rollout):
    """The 3D-HybridEngine in the RLHF loop: a megatron actor trains at TP=t in p pipeline stages and generates at
    TP=t_g in one stage on the same ranks. After every transition the generation weights equal the training weights
    (per-tensor checksums on every rank), the bytes moved match the paper's formula, and greedy generation equals
    HF's on the exported weights."""
    from fractions import Fraction

    from support.reshard_baselines import comm_fraction

    from hybridflow.engines.bridge.layout import Layout

    job = load_job(ROOT / "examples" / "tiny-grpo-megatron.yaml")
    job.spec.models.actor.tiny.num_heads = job.spec.models.actor.tiny.num_kv_heads = t
    job.spec.resource_pools[0].devices_per_node = t * p
    job.spec.training.tensor_parallel, job.spec.training.pipeline_parallel = t, p
    job.spec.rollout.engine, job.spec.rollout.tensor_parallel = rollout, t_g
    if rollout == "vllm" and t_g > 1:  # vLLM pads the vocabulary to a multiple of 64 before it splits it, and its
        job.spec.models.actor.tiny.vocab_size = 64 * t_g  # CPU attention takes heads of 32 and more (not 64 / 4)
        job.spec.models.actor.tiny.hidden_size = 32 * t
    w, task, model_dir = _start_workers(job, tmp_path, model_cache, local_ray)
    try:
        actor, generator = w.roles["actor"], w.roles["rollout"]
        assert generator.dp_sizes == {"train": 1, "rollout": t // t_g * p}
        before = generator.train_checksum()
        assert generator.weight_checksums() == before
        params = actor.num_parameters()
        for step in range(2):
            stats, stages = loop.run_iteration(loop.build_step(job, w, task),
                                               tasks.prompt_batch(task.train[8 * step: 8 * step + 8]))
            after_train, after_rollout = generator.train_checksum(), generator.weight_checksums()
            assert after_rollout == after_train, f"generation weights differ from training weights after step {step}"
            assert after_train != before, "the update did not change the weights"
            before = after_train
            tiny = job.spec.models.actor.tiny  # the tied LM head is the embedding: counted once in the weights
            model_bytes = 4 * (params - tiny.tie_embeddings * tiny.vocab_size * tiny.hidden_size)
            expected = float(comm_fraction(Layout(p=p, t=t, d=1, p_g=1, t_g=t_g), "hybridflow")) * model_bytes
            # replicated tensors (norms) travel whole to every member where the formula counts a share: 2% of these
            # tiny models at most, under 1% at hidden 128 (the vLLM t_g = 2 case)
            assert stats["reshard_bytes"] == pytest.approx(expected, rel=0.01 if tiny.hidden_size >= 128 else 0.02)
            assert stats["generation_weight_bytes"] == pytest.approx(model_bytes * float(Fraction(1, t_g)), rel=0.05)
            assert stages["reshard"] > 0
        if rollout == "megatron":
            assert len(after_rollout[0]) > 10  # every tensor was compared, not just one

        assert_greedy_matches_hf(job, w, task, model_dir, step=2)  # the checkpoint's HF-named weights, exported

        # resume: another update moves the weights; restoring step 2 brings back exactly the saved ones
        saved_sums = generator.train_checksum()
        loop.run_iteration(loop.build_step(job, w, task), tasks.prompt_batch(task.train[16:24]))
        assert generator.train_checksum() != saved_sums
        root = CheckpointRoot(Path(job.spec.trainer.checkpoint_dir))
        assert checkpointer.restore(w, root, AlgorithmState.for_spec(job.spec))[0] == 2
        assert generator.train_checksum() == saved_sums
        if rollout == "megatron":
            assert generator.weight_checksums() == saved_sums
    finally:
        w.shutdown()
