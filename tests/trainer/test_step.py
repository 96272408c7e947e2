"""The step's pure operations (no workers): dynamic sampling's group selection and refill, and advantages built
from the algorithm's estimator with the KL controller's current coefficient."""
import numpy as np
import pytest
import torch

from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.generation.rollouts import Rollouts
from hybridflow.trainer.generation.weight_sync import ColocatedWeightSync
from hybridflow.trainer.step import AlgorithmState, Step, generation_rows, skipped_stages, stage_seconds
from hybridflow.api import JobSpec


def _no_rollouts(spec: JobSpec) -> Rollouts:
    """A sync source with no rollout role behind it: these steps never generate."""
    return Rollouts(spec, None, ColocatedWeightSync(None), lambda: Batch(), generation_rows)


def _step(**algorithm):
    spec = JobSpec.model_validate({"algorithm": algorithm, "rollout": {"responsesPerPrompt": 2},
                                   "trainer": {"promptsPerStep": 4}})
    return Step(spec, {}, {}, {}, AlgorithmState.for_spec(spec), _no_rollouts(spec), skipped_stages(spec))


def _scored(scores, uid0=0):
    n = len(scores)
    return Batch({"scores": torch.tensor(scores, dtype=torch.float32), "response_mask": torch.ones(n, 3)},
                 {"uid": np.repeat(np.arange(uid0, uid0 + n // 2), 2)})


def test_dynamic_sampling_keeps_groups_whose_scores_differ_and_refills():
    step = _step(name="dapo")
    first = _scored([1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.2, 0.3])  # groups: varied, same, same, varied
    kept = step.groups_with_varied_scores(first)
    assert [g["uid"][0] for g in kept] == [0, 3]
    second = _scored([0.0, 1.0, 1.0, 1.0], uid0=10)
    kept += step.groups_with_varied_scores(second)
    assert step.stats["sampled_groups"] == 6 and step.stats["kept_groups"] == 3
    batch = step.fill_batch(kept, spare=second)  # one short after the last round: its uniform group fills in
    assert len(batch) == 8 and step.stats["filler_groups"] == 1
    assert list(batch["uid"]) == [0, 0, 3, 3, 10, 10, 11, 11]  # never a second copy of a kept group
    full = step.fill_batch(kept * 2, spare=second)
    assert len(full) == 8 and step.stats["filler_groups"] == 0


def test_advantages_use_the_estimator_and_the_controllers_kl_coefficient():
    step = _step(name="reinforce_plus_plus", klCoef=0.5, klController="adaptive", targetKl=0.1)
    batch = _scored([1.0, 0.0, 0.5, 0.25]).with_columns(
        old_log_probs=torch.full((4, 3), -1.0), ref_log_probs=torch.full((4, 3), -1.5))
    step.state.kl.value = 0.2  # as an adaptive controller may have moved it
    _, returns = step.advantages(batch)
    # k3 of log-ratio 0.5 per token, times 0.2, subtracted on each of 3 tokens; the score on the last one.
    k3 = float(np.exp(-0.5) - 1 + 0.5)
    assert float(returns[0, 0]) == pytest.approx(1.0 - 3 * 0.2 * k3, abs=1e-6)
    _, no_kl = step.advantages(batch, kl_weight=0.0)
    assert float(no_kl[0, 0]) == pytest.approx(1.0)


def test_a_program_that_never_updates_the_actor_is_an_error():
    with pytest.raises(RuntimeError, match="never called update_actor"):
        _step().summary()


def test_the_step_summary_moves_an_adaptive_kl_coefficient_toward_its_target():
    step = _step(name="grpo", klCoef=0.1, klController="adaptive", targetKl=0.01, klHorizon=100)
    batch = _scored([1.0, 0.0, 0.5, 0.25]).with_columns(
        old_log_probs=torch.full((4, 3), -1.0), ref_log_probs=torch.full((4, 3), -1.5), entropy=torch.ones(4, 3),
        attention_mask=torch.ones(4, 5))
    step.trained = batch  # as update_actor leaves it
    stats = step.summary()
    assert stats["kl_coef"] == pytest.approx(0.1)  # the coefficient the step trained with
    assert stats["kl_mean"] > 0.01
    assert step.state.kl.value == pytest.approx(0.1 * (1 + 0.2 * 4 / 100))  # KL above target: +20% x n/horizon


def test_stage_seconds_start_when_the_pool_is_free_and_are_never_negative():
    # old_log_prob and ref share the actor pool, values runs on the critic pool; launched at t=10.
    launched = [("old_log_prob", "actor"), ("ref", "actor"), ("values", "critic")]
    in_order = stage_seconds(launched, {"old_log_prob": 12.0, "ref": 15.0, "values": 11.0}, 10.0)
    assert in_order == {"old_log_prob": 2.0, "ref": 3.0, "values": 1.0}
    # A busy machine reorders the pool's results: ref's last row lands before old_log_prob's. Prometheus counters
    # refuse a negative increment, which once failed a resumed job.
    reordered = stage_seconds(launched, {"old_log_prob": 15.0, "ref": 12.0, "values": 11.0}, 10.0)
    assert reordered == {"old_log_prob": 5.0, "ref": 0.0, "values": 1.0}


def test_an_on_policy_step_skips_the_old_log_prob_pass_and_summarises_from_the_update():
    doc = {"algorithm": {"name": "grpo", "klCoef": 0.1, "klController": "adaptive", "targetKl": 0.01,
                         "klHorizon": 100}, "rollout": {"responsesPerPrompt": 2}, "trainer": {"promptsPerStep": 4}}

    def step_for(training: dict) -> Step:
        spec = JobSpec.model_validate({**doc, "training": training})
        return Step(spec, {}, {}, {}, AlgorithmState.for_spec(spec), _no_rollouts(spec), skipped_stages(spec))

    step = step_for({})
    assert step.skipped == {"old_log_prob"}
    assert step.compute(_scored([1.0, 0.0, 0.5, 0.25]), "old_log_prob").tensors.keys() == {"scores", "response_mask"}
    step.stats.update(entropy_mean=0.7, kl_mean=0.05)  # what the on-policy update reports (roles/actor.py)
    step.trained = _scored([1.0, 0.0, 0.5, 0.25]).with_columns(attention_mask=torch.ones(4, 5))
    stats = step.summary()
    assert stats["entropy_mean"] == 0.7 and stats["kl_mean"] == 0.05
    assert step.state.kl.value > 0.1  # the controller moved on the update's KL
    for off_policy in ({"ppoEpochs": 2}, {"miniBatchSize": 2}, {"onPolicyOldLogProbs": False}):
        assert step_for(off_policy).skipped == set(), off_policy


def test_step_implements_the_whole_dataflow_protocol():
    """The programs type against algorithms.dataflow.Dataflow; the Step they get has every member, with the same
    parameters."""
    import inspect

    from hybridflow.algorithms.dataflow import Dataflow

    members = {n: m for n, m in vars(Dataflow).items() if not n.startswith("_")}
    assert {"generate", "compute", "advantages", "update_actor", "sync_weights", "carried"} <= set(members)
    for name, declared in members.items():
        implemented = getattr(Step, name, None)
        assert implemented is not None, f"Step lacks {name}"
        assert isinstance(implemented, property) == isinstance(declared, property), name
        if callable(declared):
            assert list(inspect.signature(implemented).parameters) == list(inspect.signature(declared).parameters)


def test_an_algorithm_carries_its_own_state_and_checkpoints_it_by_name():
    """safe_rlhf's multiplier comes from the algorithm (no controller code names it); another algorithm carries
    none, and loading a checkpoint that lacks it keeps the start value."""
    def _safe():
        spec = JobSpec.model_validate({"algorithm": {"name": "safe_rlhf", "lambdaInit": 0.5},
                                       "models": {"cost": {"type": "rule", "rule": "top_ids"}},
                                       "rollout": {"responsesPerPrompt": 2}, "trainer": {"promptsPerStep": 4}})
        return Step(spec, {}, {}, {}, AlgorithmState.for_spec(spec), _no_rollouts(spec), skipped_stages(spec))

    safe = _safe()
    assert safe.carried("lagrangian").value == 0.5
    safe.carried("lagrangian").update(mean_cost=1.5)
    saved = safe.state.state()
    assert saved["lagrangian"]["value"] == pytest.approx(safe.carried("lagrangian").value) and "kl" in saved
    grpo = _step(name="grpo")
    assert set(grpo.state.state()) == {"kl"}
    fresh = _safe()
    fresh.state.load(saved)
    assert fresh.carried("lagrangian").value == pytest.approx(saved["lagrangian"]["value"])
    fresh.state.load(grpo.state.state())
    assert fresh.carried("lagrangian").value == pytest.approx(saved["lagrangian"]["value"])
