"""Every algorithm's example, run as a user runs it: `hybridflow run`'s own load, prepare and execute (in this process
on the suite's shared Ray: conftest's run_here, ~10-15 s a run less than a process of its own), real Ray, FSDP2 on two
CPU ranks.

Learning is tested once per algorithm family: GRPO's outcome-advantage family in tests/trainer/test_end_to_end.py
(test_tiny_example_learns), REINFORCE with a baseline by remax, critics with GAE and the Lagrangian constraint by
safe_rlhf, each generating with vLLM. Thresholds: greedy held-out reward (fraction of correct continuation tokens; the
untrained policy scores about 0) must reach 0.4 and gain at least 0.3 in the example's steps. Measured here with the
full examples: remax 0.62, safe_rlhf 0.68, rloo 1.00, reinforce_plus_plus 1.00, dr_grpo 1.00, dapo 0.85, gspo 0.93.
The numerics (and so the runs) differ between CPUs: on an AMD EPYC without AVX-512, ReMax with 4 responses per prompt
reached only 0.02, with 8 (the example's now) 0.69.

The others (rloo, reinforce_plus_plus, dr_grpo, dapo, gspo) share GRPO's dataflow and differ in what they compute:
their examples run 3 steps of 8 prompts with `trainer.rolloutLog` on, and each step's trained samples are checked
against the float64 references of tests/algorithms/test_algorithms.py: the scores against the reward rule, the advantages
against the estimator, and the step log's policy-loss statistics against the loss and aggregation (on-policy, the
ratio is exactly 1: nothing is clipped and pg_loss is the aggregated -advantage). The learning runs check theirs the
same way: remax's advantages and loss, safe_rlhf's two GAEs and the multiplier that weighs them."""
import json

import numpy as np
import pytest
import torch
import yaml
from support.learning import EXAMPLES_LEARNED_GAIN, EXAMPLES_LEARNED_MIN
from support.paths import ROOT
from support.algorithm_references import AGG_REFERENCES, ESTIMATOR_REFERENCES, LOSS_REFERENCES, Rows, ref_gae, ref_kl

from hybridflow import checkpoint as ck
from hybridflow.checkpoint import read_step_log
from hybridflow.single_controller.batch import Batch
from hybridflow.trainer.step import rollout_records
from hybridflow.data.packing import pack_rollout
from hybridflow.rewards.rules import increment, top_ids
from hybridflow.roles.config import old_log_probs_from_update
from hybridflow.api import JobSpec, load_job

LEARNING = ["remax", "safe-rlhf"]  # one per family (GRPO's: tests/trainer/test_end_to_end.py::test_tiny_example_learns)
SHORT = ["rloo", "reinforce-pp", "dr-grpo", "dapo", "gspo"]
SHORT_STEPS, SHORT_PROMPTS = 3, 8
DP = 2  # the examples' actor: FSDP2 on one pool of two CPU ranks
TOL = 1e-5  # float32 on the ranks against float64 here (measured: under 1e-6), over a few hundred tokens


def _run(tmp_path, run_here, stem):
    """The example as it is, with the rollout log on (it changes nothing the job computes)."""
    ckpt = tmp_path / "run"
    doc = yaml.safe_load((ROOT / "examples" / f"tiny-{stem}.yaml").read_text())
    doc["spec"]["trainer"]["rolloutLog"] = True
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    rc, printed = run_here(job, {"spec.trainer.checkpointDir": str(ckpt)}, cwd=tmp_path)
    assert rc == 0, printed[-3000:]
    return ckpt, json.loads((ckpt / "summary.json").read_text()), read_step_log(ckpt), printed


def _check_stages(job, spec, records, printed, stem):
    """What every example's run shows, learning or not: its steps, its stages, where old log-probs came from."""
    algo = job["spec"]["algorithm"]
    assert [r["step"] for r in records] == list(range(1, job["spec"]["trainer"]["steps"] + 1))
    last = records[-1]
    assert f"job tiny-{stem}: {algo['name']}" in printed
    for stage in ("generate", "reward", "advantages", "actor_update", "reshard"):
        assert last["stages"][stage] > 0, stage
    on_policy = old_log_probs_from_update(spec.training, spec.algorithm, spec.trainer.prompts_per_step)
    assert ("old_log_prob" in last["stages"]) != on_policy  # the update's own forward gave them, or a pass did
    # With truncated IS on (dapo's example), vLLM returns its own log-probs (after temperature); they agree with the
    # trainer's forward pass on the same weights. Without it none are asked for (vLLM's first such call is slow).
    assert ("rollout_log_prob_gap" in last) == ("tisCap" in algo)
    if "tisCap" in algo:
        assert 0 <= last["rollout_log_prob_gap"] < 1e-3
    return on_policy


@pytest.mark.slow
@pytest.mark.parametrize("stem", LEARNING)
def test_algorithm_example_learns(tmp_path, run_here, stem):
    job = yaml.safe_load((ROOT / "examples" / f"tiny-{stem}.yaml").read_text())
    algo = job["spec"]["algorithm"]
    ckpt, summary, records, printed = _run(tmp_path, run_here, stem)
    assert summary["eval_after"] >= EXAMPLES_LEARNED_MIN, summary
    assert summary["eval_after"] - summary["eval_before"] >= EXAMPLES_LEARNED_GAIN, summary
    spec = load_job(ROOT / "examples" / f"tiny-{stem}.yaml").spec
    on_policy = _check_stages(job, spec, records, printed, stem)
    last = records[-1]
    assert ck.rollout_steps(ckpt) == [r["step"] for r in records]
    if algo["name"] == "safe_rlhf":
        # The cost stays at or under its limit on held-out prompts while the reward rises; the constraint was
        # active (lambda rose above its start while the cost exceeded the limit) and lambda is in the checkpoint.
        assert summary["eval_cost_after"] <= algo["costLimit"], summary
        assert max(r["lagrange_multiplier"] for r in records) > algo["lambdaInit"]
        assert records[0]["cost_mean"] > algo["costLimit"]
        state = json.loads((ckpt / f"step_{len(records):08d}" / "trainer_state.json").read_text())
        assert state["algorithm"]["lagrangian"]["value"] == pytest.approx(last["lagrange_multiplier"])
        assert last["stages"]["cost"] > 0 and last["stages"]["cost_critic_update"] > 0
        assert (ckpt / f"step_{len(records):08d}" / "cost_critic" / ".metadata").is_file()  # its own shards
        assert "cost" in printed and "lambda" in printed
        for r in records:  # what each step trained on: rule costs, (A_r - lambda A_c) / (1 + lambda) of two GAEs
            samples = ck.read_rollouts(ckpt, r["step"])
            _check_scores(samples, spec)
            vocab = spec.models.actor.tiny.vocab_size
            assert all(x["cost"] == pytest.approx(top_ids(x["prompt_ids"], x["response_ids"], vocab), abs=1e-6)
                       for x in samples)
            _check_safe_rlhf_advantages(samples, spec, r)
    if algo["name"] == "remax":
        assert "values" not in last["stages"]  # no critic
        # ReMax's advantage is the score minus the greedy response's (the baseline, the same for a prompt's
        # responses) on every token. Its advantages do not sum to 0 over a group, so the on-policy update's
        # pg_loss (-advantage, token-mean over each rank's half, averaged) is far from 0 and tells losses apart.
        assert on_policy
        for r in records:
            samples = ck.read_rollouts(ckpt, r["step"])
            _check_scores(samples, spec)
            for g in _groups(samples).values():
                baseline = [x["score"] - a for x in g for a in x["advantages"]]
                assert max(baseline) - min(baseline) < 1e-6, g
                # a rule score of a full-length greedy response: a multiple of 1/6 in [0, 1]
                length = spec.rollout.max_response_length
                assert baseline[0] * length == pytest.approx(round(baseline[0] * length), abs=1e-4)
                assert -1e-6 <= baseline[0] <= 1 + 1e-6
            assert r["clip_frac"] == 0 and r["approx_kl"] == 0
            assert r["pg_loss"] == pytest.approx(_expected_pg_loss(samples, spec, DP), abs=1e-5), r["step"]
        assert max(abs(r["pg_loss"]) for r in records) > 1e-2


# --- short runs: what each algorithm computes, exactly, from the rollout log ---------------------------------------

def _short_job(tmp_path, stem):
    doc = yaml.safe_load((ROOT / "examples" / f"tiny-{stem}.yaml").read_text())
    doc["spec"]["trainer"].update(steps=SHORT_STEPS, promptsPerStep=SHORT_PROMPTS, saveFreq=0, eval=False,
                                  rolloutLog=True, checkpointDir=str(tmp_path / "run"))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return doc, path


def _layout(samples, spec):
    """The references' view of a logged batch: response lengths, groups, the job's response width, gamma, lambda."""
    return Rows(tuple(len(s["response_ids"]) for s in samples), tuple(s["uid"] for s in samples),
                spec.rollout.max_response_length, gamma=spec.algorithm.gamma, lam=spec.algorithm.lam)


def _per_token(samples, rows, key):
    return [s[key] + [0.0] * (rows.width - len(s[key])) for s in samples]


def _token_rewards(samples, rows, score="score", kl=None, coef=0.0):
    """Float64 per-token rewards as the controller builds them: the score on the last real token, minus coef * KL
    on every token when KL is in the reward."""
    out = []
    for i, s in enumerate(samples):
        row = [0.0] * rows.width
        n = rows.real(i)
        for t in range(n):
            row[t] -= coef * kl[i][t] if kl is not None else 0.0
        row[n - 1] += s[score]
        out.append(row)
    return out


def _expected_advantages(samples, spec, record, kl_penalty=True):
    a = spec.algorithm
    rows = _layout(samples, spec)
    kl, coef = None, 0.0
    if kl_penalty and a.kl_in == "reward" and a.kl_coef > 0:
        assert record["kl_coef"] == pytest.approx(a.kl_coef)  # the fixed controller's coefficient, used this step
        kl = [[ref_kl(a.kl_estimator, o, r) for o, r in zip(s["old_log_probs"], s["ref_log_probs"])]
              for s in samples]
        coef = record["kl_coef"]
    r = _token_rewards(samples, rows, kl=kl, coef=coef)
    kw = {"norm_by_std": bool(a.norm_adv_by_std)} if a.advantage_estimator == "grpo" else {}
    return ESTIMATOR_REFERENCES[a.advantage_estimator](r, None, None, rows, **kw)


def _expected_pg_loss(samples, spec, dp):
    """The step log's pg_loss on an update whose ratio is 1: each rank's aggregate of the policy loss over its
    contiguous shard of the batch (DP_COMPUTE's split), averaged over ranks."""
    a, t = spec.algorithm, spec.training
    rows = _layout(samples, spec)
    zeros = [[0.0] * rows.width for _ in samples]
    token = LOSS_REFERENCES[a.policy_loss](zeros, zeros, _per_token(samples, rows, "advantages"),
                                           a.clip_ratio_low or t.clip_ratio, a.clip_ratio_high or t.clip_ratio,
                                           a.dual_clip, rows)
    size = len(samples) // dp
    per_rank = []
    for k in range(dp):
        part = slice(k * size, (k + 1) * size)
        shard = Rows(rows.lengths[part], rows.groups[part], rows.width)
        per_rank.append(AGG_REFERENCES[a.loss_agg](token[part], shard))
    return sum(per_rank) / dp


def _check_scores(samples, spec):
    """The logged scores are the reward rule's on the logged tokens (plus the overlong shaping, where it is on)."""
    a, vocab = spec.algorithm, spec.models.actor.tiny.vocab_size
    for s in samples:
        n = len(s["response_ids"])
        want = increment(s["prompt_ids"], s["response_ids"], vocab)
        if a.overlong_buffer:
            over = min(max(n - (spec.rollout.max_response_length - a.overlong_buffer), 0), a.overlong_buffer)
            want -= a.overlong_penalty * over / a.overlong_buffer
        assert s["score"] == pytest.approx(want, abs=1e-6), s


def _check_safe_rlhf_advantages(samples, spec, record):
    """(A_r - lambda A_c) / (1 + lambda), A_r and A_c unwhitened GAEs over the reward and cost critics' values, lambda
    the multiplier (raised from this batch's mean cost before the update); no KL (the example has no reference)."""
    assert record["cost_mean"] == pytest.approx(np.mean([x["cost"] for x in samples]), rel=1e-5, abs=1e-7)
    assert not spec.algorithm.kl_coef
    rows = _layout(samples, spec)
    a_r = ref_gae(_token_rewards(samples, rows), _per_token(samples, rows, "values"), None, rows, whiten=False)
    a_c = ref_gae(_token_rewards(samples, rows, "cost"), _per_token(samples, rows, "cost_values"), None, rows,
                  whiten=False)
    lam = record["lagrange_multiplier"]
    for i, x in enumerate(samples):
        want = [(a_r[i][t] - lam * a_c[i][t]) / (1 + lam) for t in range(len(x["advantages"]))]
        assert x["advantages"] == pytest.approx(want, abs=TOL), (record["step"], i)


def _groups(samples):
    out = {}
    for s in samples:
        out.setdefault(s["uid"], []).append(s)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stem", SHORT)
def test_algorithm_example_computes_its_advantages_and_loss(tmp_path, run_here, stem):
    job, path = _short_job(tmp_path, stem)
    algo = job["spec"]["algorithm"]
    # Generation is plain HF (its engine starts ~10 s sooner) unless the algorithm reads the rollout engine's own
    # log-probs (tisCap: dapo's); the learning runs and GRPO's generate with vLLM. The job runs in this process on
    # the suite's Ray (the CLI's own code after its argument parsing: run_here); the learning runs are `hybridflow run`.
    engine = {} if "tisCap" in algo else {"spec.rollout.engine": "hf"}
    rc, printed = run_here(path, engine)
    assert rc == 0, printed[-3000:]
    ckpt = tmp_path / "run"
    records = read_step_log(ckpt)
    spec = load_job(path).spec
    on_policy = _check_stages(job, spec, records, printed, stem)
    n = spec.rollout.responses_per_prompt
    assert ck.rollout_steps(ckpt) == list(range(1, SHORT_STEPS + 1))
    kl_effect = 0.0
    for record in records:
        samples = ck.read_rollouts(ckpt, record["step"])
        assert len(samples) == SHORT_PROMPTS * n
        groups = _groups(samples)
        assert len(groups) == SHORT_PROMPTS
        assert all(len(g) == n and all(s["prompt_ids"] == g[0]["prompt_ids"] for s in g) for g in groups.values())
        _check_scores(samples, spec)
        assert record["reward_mean"] == pytest.approx(np.mean([s["score"] for s in samples]), abs=1e-6)

        want = _expected_advantages(samples, spec, record)
        for s, w in zip(samples, want):
            assert s["advantages"] == pytest.approx(w[:len(s["advantages"])], abs=TOL), (stem, record["step"], s)
        if spec.algorithm.kl_in == "reward" and spec.algorithm.kl_coef > 0:
            plain = _expected_advantages(samples, spec, record, kl_penalty=False)
            kl_effect = max(kl_effect, max(abs(a - b) for w, p in zip(want, plain) for a, b in zip(w, p)))

        # The update's loss statistics. On-policy, the ratio is exactly 1 (old log-probs are the update's own,
        # detached): no token is clipped and pg_loss is the aggregated -advantage. A separate old-log-prob pass
        # (reinforce_plus_plus: KL in the reward needs them first) gives the same log-probs to float rounding.
        # Here every response runs to maxResponseLength and these advantages sum to 0 over each group (whitened:
        # over the batch), so the expected value is about 0: this shows that nothing but the advantages entered
        # the loss. remax's run, whose advantages do not cancel, is where the aggregation itself shows.
        assert record["clip_frac"] == 0, record
        expect = _expected_pg_loss(samples, spec, DP)
        if on_policy:
            assert record["approx_kl"] == 0
        else:
            assert abs(record["approx_kl"]) < 1e-5
        tol = 1e-5 if on_policy else TOL
        if spec.algorithm.tis_cap is not None:
            # Each token's loss is also weighted by w = min(pi_old / pi_rollout, cap); for a cap <= 2,
            # |w - 1| <= 1.45 |log-ratio|, so the difference is bounded by the logged mean |log-ratio| (the gap).
            assert spec.algorithm.tis_cap <= 2
            tol += 1.5 * max(abs(a) for s in samples for a in s["advantages"]) * record["rollout_log_prob_gap"]
        assert record["pg_loss"] == pytest.approx(expect, abs=tol), (stem, record["step"])

        if algo["name"] == "dapo":
            # Only groups whose rewards differ were kept; short after the last round, the batch was filled with
            # that round's uniform groups, whose advantages are 0.
            varied = [g for g in groups.values() if max(s["score"] for s in g) - min(s["score"] for s in g) > 1e-6]
            assert len(varied) == min(record["kept_groups"], SHORT_PROMPTS)
            assert len(groups) - len(varied) == record["filler_groups"]
            assert samples[:len(varied) * n] == [s for g in varied for s in g]  # the informative groups first
            for g in groups.values():
                if g not in varied:
                    assert all(a == pytest.approx(0, abs=1e-6) for s in g for a in s["advantages"])
            assert all(len(s["rollout_log_probs"]) == len(s["response_ids"]) for s in samples)
    if spec.algorithm.kl_in == "reward" and spec.algorithm.kl_coef > 0:
        assert kl_effect > 10 * TOL, kl_effect  # the KL penalty moved the advantages more than the tolerance
    if algo["name"] == "dapo":
        # Dynamic sampling: some step drew more groups than it kept and went back for more prompts.
        assert any(r["sampled_groups"] > r["kept_groups"] for r in records)
        assert all(r["kept_groups"] + r["filler_groups"] >= SHORT_PROMPTS for r in records)


@pytest.mark.slow
def test_safe_rlhf_with_a_cost_model_on_its_own_pool(tmp_path, run_here):
    """The cost judged by a (random, tiny) model instead of a rule, the cost model and cost critic placed on a second
    resource pool: their stages run beside the actor pool's, and the multiplier moves with real-valued costs. The
    rollout log shows the advantage as (A_r - lambda A_c) / (1 + lambda) of two unwhitened GAEs, and a resumed job
    drops the rollouts of the steps after its checkpoint."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-safe-rlhf.yaml").read_text())
    s = doc["spec"]
    s["models"]["cost"] = {"type": "model", "model": {"source": "tiny", "tiny": s["models"]["actor"]["tiny"]}}
    s["resourcePools"].append({"name": "judges", "devicesPerNode": 1})
    s["placement"] = {"cost": "judges", "cost_critic": "judges"}
    s["trainer"].update(steps=2, checkpointDir=str(tmp_path / "run"), rolloutLog=True)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    rc, printed = run_here(job, {"spec.rollout.engine": "hf"}, cwd=tmp_path)
    assert rc == 0, printed[-3000:]
    records = read_step_log(tmp_path / "run")
    assert len(records) == 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_cost_before"] is not None and summary["eval_cost_after"] is not None  # by the cost model
    for r in records:
        assert r["stages"]["cost"] > 0 and r["stages"]["cost_values"] > 0 and r["stages"]["cost_critic_update"] > 0
    a = s["algorithm"]  # the multiplier's dual step on the first batch's mean cost
    expect = max(0.0, a["lambdaInit"] + a["lambdaLr"] * (records[0]["cost_mean"] - a["costLimit"]))
    assert records[0]["lagrange_multiplier"] == pytest.approx(expect, rel=1e-5)
    # A model's costs are real-valued; the top_ids rule can only give multiples of 1/6 per response.
    assert any(abs(r["cost_mean"] * 6 * 128 - round(r["cost_mean"] * 6 * 128)) > 1e-3 for r in records)

    spec = load_job(job).spec
    root = tmp_path / "run"
    for r in records:  # the trained batch: its costs, and the advantage Safe-RLHF makes of the critics' values
        samples = ck.read_rollouts(root, r["step"])
        assert len(samples) == 128
        _check_scores(samples, spec)
        _check_safe_rlhf_advantages(samples, spec, r)

    # One more step, resumed from the step-2 checkpoint: the multiplier continues from its saved value. Rollouts of
    # steps after the checkpoint (as a run killed after it would leave) are dropped; step 3 writes its own.
    for step in (3, 4):
        ck.write_rollouts(root, step, [{"left": "by a run killed after step 2's checkpoint"}])
    rc, printed = run_here(job, {"spec.trainer.steps": 3, "spec.rollout.engine": "hf"}, cwd=tmp_path)
    assert rc == 0, printed[-3000:]
    third = read_step_log(tmp_path / "run")[2]
    saved = records[1]["lagrange_multiplier"]
    assert saved != pytest.approx(a["lambdaInit"])
    assert third["lagrange_multiplier"] == pytest.approx(
        max(0.0, saved + a["lambdaLr"] * (third["cost_mean"] - a["costLimit"])), rel=1e-5)
    assert ck.rollout_steps(root) == [1, 2, 3]
    redone = ck.read_rollouts(root, 3)
    assert len(redone) == 128 and all("left" not in x for x in redone)
    assert third["cost_mean"] == pytest.approx(np.mean([x["cost"] for x in redone]), rel=1e-5)


# --- the rollout log itself (fast) --------------------------------------------------------------------------------

def _trained_batch():
    packed = pack_rollout([[3, 4], [5], [7, 8, 9]], [[5, 6, 7], [6], []], 4, 3)
    mask = packed["response_mask"].float()
    return Batch({**packed, "scores": torch.tensor([1.0, 0.5, 0.0]), "costs": torch.tensor([0.25, 0.0, 1.0]),
                  "advantages": torch.tensor([[0.5, 0.5, 0.5], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]) * mask,
                  "old_log_probs": torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0], [0.0, 0.0, 0.0]])},
                 {"uid": np.array([7, 7, 8]), "truth": ["x", "y", "z"]})


def test_rollout_records_are_the_trained_samples_over_their_response_tokens():
    batch = _trained_batch()
    before = {k: v.clone() for k, v in batch.tensors.items()}
    recs = rollout_records(batch, decode=lambda ids: " ".join(map(str, ids)))
    assert [r["uid"] for r in recs] == [7, 7, 8] and type(recs[0]["uid"]) is int  # numpy ints become JSON's
    assert recs[0] == {"uid": 7, "prompt_ids": [3, 4], "response_ids": [5, 6, 7], "prompt": "3 4",
                       "response": "5 6 7", "score": 1.0, "cost": 0.25, "advantages": [0.5, 0.5, 0.5],
                       "old_log_probs": pytest.approx([-0.1, -0.2, -0.3])}
    assert recs[1]["advantages"] == [-1.0] and recs[1]["old_log_probs"] == pytest.approx([-0.4])  # no padding
    assert recs[2]["response_ids"] == [] and recs[2]["advantages"] == [] and recs[2]["response"] == ""
    json.dumps(recs)
    assert all(torch.equal(batch[k], v) for k, v in before.items())  # only read
    plain = rollout_records(batch.select("prompts", "responses", "attention_mask", "response_mask", "scores"))
    assert plain[0] == {"uid": None, "prompt_ids": [3, 4], "response_ids": [5, 6, 7], "score": 1.0}  # no tokenizer


def _round_trip(root):
    for step in range(1, 6):
        ck.write_rollouts(root, step, [{"step": step, "i": i} for i in range(3)])
    assert ck.rollout_steps(root) == [1, 2, 3, 4, 5]
    assert ck.read_rollouts(root, 4) == [{"step": 4, "i": i} for i in range(3)]
    assert ck.rewind_rollouts(root, 3) == 2 and ck.rollout_steps(root) == [1, 2, 3]  # the steps a resume redoes
    assert ck.read_rollouts(root, 4) == []
    ck.write_rollouts(root, 3, [{"redone": True}])  # a redone step replaces its file
    assert ck.read_rollouts(root, 3) == [{"redone": True}]
    assert ck.rewind_rollouts(root, 3) == 0


def test_rollout_files_are_written_rewound_and_replaced(tmp_path):
    _round_trip(tmp_path)
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [f"step_{i:08d}.jsonl" for i in (1, 2, 3)]
    assert ck.rollout_steps(tmp_path / "elsewhere") == [] and ck.rewind_rollouts(tmp_path / "elsewhere", 0) == 0


def test_rollout_files_on_object_storage(s3_server, monkeypatch):
    s3_server.use(monkeypatch)
    _round_trip(ck.storage_path(f"{s3_server.url}/job"))


def test_rollout_log_is_off_unless_asked_for():
    assert JobSpec.model_validate({}).trainer.rollout_log is False
    assert JobSpec.model_validate({"trainer": {"rolloutLog": True}}).trainer.rollout_log is True
