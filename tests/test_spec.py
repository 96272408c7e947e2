"""The manifest: defaults, examples, and bad input that must fail with one clear message naming the field."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.cli import main
from hybridflow.spec import JobSpec, RLHFJob, SpecError, load_job, parse_job

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_minimal_manifest_gets_usable_defaults():
    job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "x"}})
    assert job.spec.algorithm.name == "grpo"
    assert job.spec.pool("actor").world_size == 2
    assert job.spec.trainer.resume == "auto"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path):
    job = load_job(path)
    assert job.metadata.name


def _write(tmp_path, spec: dict, top: dict | None = None) -> Path:
    doc = {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "bad"}, "spec": spec}
    doc.update(top or {})
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


# (spec fragment, text the message must contain: the field and the problem)
BAD = [
    ({"trainer": {"stepz": 3}}, "spec.trainer.stepz: unknown field"),
    ({"rollout": {"responsesPerPrompt": "four"}}, "spec.rollout.responsesPerPrompt: Input should be a valid integer"),
    ({"rollout": {"responsesPerPrompt": 0}}, "spec.rollout.responsesPerPrompt: Input should be greater than 0"),
    ({"trainer": {"promptsPerStep": -4}}, "spec.trainer.promptsPerStep: Input should be greater than 0"),
    ({"training": {"microBatchSize": 0}}, "spec.training.microBatchSize"),
    ({"trainer": {"promptsPerStep": 33}}, "promptsPerStep = 33 is not divisible by the actor's data-parallel size 2"),
    ({"training": {"engine": "megatron", "tensorParallel": 3}}, "tensorParallel*pipelineParallel = 3 does not divide"),
    ({"training": {"tensorParallel": 2}}, "only the megatron engine supports them"),
    ({"training": {"engine": "megatron", "pipelineParallel": 2}}, "pipelineParallel: the megatron actor trains"),
    ({"rollout": {"engine": "megatron"}}, "spec.rollout.engine: megatron generation is fed by the megatron actor"),
    ({"rollout": {"tensorParallel": 2}, "training": {"engine": "megatron", "tensorParallel": 2}},
     "only spec.rollout.engine megatron generates tensor-parallel"),
    ({"rollout": {"engine": "megatron", "tensorParallel": 2}, "training": {"engine": "megatron"}},
     "spec.rollout.tensorParallel = 2 must divide spec.training.tensorParallel = 1"),
    ({"training": {"engine": "megatron", "tensorParallel": 2}},
     "spec.models.actor.tiny.numKvHeads = 1 is not divisible by spec.training.tensorParallel = 2"),
    ({"models": {"actor": {"source": "path"}}}, "spec.models.actor: source is 'path' but no path is given"),
    ({"models": {"reward": {"rule": "nope"}}}, "spec.models.reward.rule: unknown rule 'nope'"),
    ({"algorithm": {"name": "dpo"}}, "spec.algorithm.name: unknown algorithm 'dpo'; registered: dapo, dr_grpo, grpo"),
    ({"rollout": {"responsesPerPrompt": 1}},
     "spec.rollout.responsesPerPrompt: grpo with the grpo estimator needs at least 2 responses per prompt"),
    ({"algorithm": {"name": "rloo"}, "rollout": {"responsesPerPrompt": 1}}, "rloo with the rloo estimator needs"),
    ({"algorithm": {"advantageEstimator": "gae"}}, "spec.algorithm.advantageEstimator: gae needs a critic's values; "
     "grpo has no critic"),
    ({"algorithm": {"advantageEstimator": "remax"}}, "remax needs the greedy-response baseline"),
    ({"algorithm": {"advantageEstimator": "vtrace"}}, "spec.algorithm.advantageEstimator: unknown advantage "
     "estimator 'vtrace'; registered: gae, grpo"),
    ({"algorithm": {"policyLoss": "cispo"}}, "spec.algorithm.policyLoss: unknown policy loss 'cispo'"),
    ({"algorithm": {"lossAgg": "sum"}}, "spec.algorithm.lossAgg: unknown loss aggregation 'sum'; registered: "
     "seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean"),
    ({"algorithm": {"klEstimator": "k4"}}, "spec.algorithm.klEstimator: unknown KL estimator 'k4'; registered: k1"),
    ({"algorithm": {"klController": "adaptive"}}, "klController adaptive needs targetKl"),
    ({"algorithm": {"klController": "adaptive", "targetKl": 0.1}}, "and klCoef > 0 (its starting value)"),
    ({"algorithm": {"name": "ppo", "advantageEstimator": "grpo"}},
     "spec.algorithm.advantageEstimator: ppo trains a critic on GAE returns; grpo gives none"),
    ({"algorithm": {"tisCap": 2}, "rollout": {"topP": 0.9}}, "spec.algorithm.tisCap: the generation engines report"),
    ({"algorithm": {"overlongBuffer": 64}}, "spec.algorithm.overlongBuffer = 64 exceeds rollout.maxResponseLength = 8"),
    ({"algorithm": {"name": "safe_rlhf"}, "models": {"cost": {"type": "rule", "rule": "arithmetic_exact"}}},
     "spec.models.cost.rule: arithmetic_exact needs a model with a tokenizer"),
    ({"algorithm": {"dualClip": 0.5}}, "spec.algorithm.dualClip: Input should be greater than 1"),
    ({"algorithm": {"name": "safe_rlhf"}}, "spec.models.cost: safe_rlhf needs a cost, e.g. cost: {type: rule"),
    ({"models": {"cost": {"type": "rule", "rule": "top_ids"}}}, "spec.models.cost: only a constrained algorithm"),
    ({"algorithm": {"name": "safe_rlhf"}, "models": {"cost": {"type": "rule", "rule": "nope"}}},
     "spec.models.cost.rule: name a registered rule"),
    ({"algorithm": {"name": "safe_rlhf"}, "models": {"cost": {"type": "scorer", "scorers": [{"name": "math"}]}}},
     "spec.models.cost.type: a cost is a rule or a model"),
    ({"placement": {"critic": "gpus"}}, "spec.placement.critic: no resource pool named 'gpus'"),
    ({"placement": {"judge": "default"}}, "spec.placement.judge: unknown role"),
    ({"models": {"actor": {"tiny": {"hiddenSize": 48, "numHeads": 3, "numKvHeads": 1}}}}, "head size"),
    ({"models": {"actor": {"tiny": {"hiddenSize": 64, "numHeads": 3}}}}, "must be divisible by numHeads"),
    ({"algorithm": {"klCoef": 0.1}, "models": {"reference": False}}, "klCoef > 0 needs spec.models.reference"),
    ({"resourcePools": [{"name": "Bad_Name"}]}, "spec.resourcePools[0].name: String should match pattern"),
    ({"rollout": {"topP": 1.5}}, "spec.rollout.topP: Input should be less than or equal to 1"),
    ({"data": {"task": "arithmetic"}}, "arithmetic_exact needs a model with a tokenizer"),
    ({"models": {"reward": {"type": "function"}}}, "type is 'function' but no function is given"),
    ({"models": {"reward": {"type": "scorer"}}}, "type is 'scorer' but reward.scorers is empty"),
    ({"models": {"reward": {"type": "scorer", "scorers": [{"name": "math"}, {"name": "bleu"}]}}},
     "spec.models.reward.scorers[1].name: unknown scorer 'bleu'; registered scorers: exact, format, math, regex"),
    ({"models": {"reward": {"type": "scorer", "scorers": [{"name": "math"}]}}},
     "spec.models.reward.type: scorer scores decoded text and needs a model with a tokenizer"),
    ({"models": {"reward": {"type": "function", "function": {"path": "/nonexistent/r.py"}, "timeoutSeconds": 0}}},
     "spec.models.reward.timeoutSeconds: Input should be greater than 0"),
    ({"models": {"reward": {"maxErrorFraction": 2}}}, "spec.models.reward.maxErrorFraction: Input should be less"),
    ({"data": {"source": "files"}, "models": {"actor": {"source": "smollm2"}, "reward": {
        "type": "scorer", "scorers": [{"name": "math"}]}}}, "spec.data.train: source is 'files' but no file is given"),
    ({"data": {"source": "files", "train": ["t.jsonl"]}},
     "spec.models.actor.source: prompts from files need a model with a tokenizer"),
    ({"data": {"source": "files", "train": ["t.jsonl"]}, "models": {"actor": {"source": "smollm2"}}},
     "spec.models.reward.type: rule scores the token ids of a generated task; for prompts from files use scorer"),
    ({"data": {"train": ["t.jsonl"]}}, "spec.data.train/eval: files are only read with spec.data.source: files"),
    ({"data": {"source": "parquet"}}, "spec.data.source: Input should be 'generated' or 'files'"),
    ({"data": {"source": "files", "train": "t.jsonl"}}, "spec.data.train: Input should be a valid list"),
]


@pytest.mark.parametrize("spec,expected", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_manifest_names_the_field(tmp_path, capsys, spec, expected):
    rc = main(["validate", str(_write(tmp_path, spec))])
    err = capsys.readouterr().err
    assert rc == 2
    assert expected in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("body,expected", [
    (None, "reward file not found"),
    ("def compute_score(a, b:\n", "r.py:1: syntax error"),
    ("def other(a, b, c, d):\n    return 1\n", "no top-level function 'compute_score' (functions found: other)"),
])
def test_reward_file_problems_are_reported_before_anything_runs(tmp_path, capsys, body, expected):
    reward = tmp_path / "r.py"
    if body is not None:
        reward.write_text(body)
    spec = {"models": {"actor": {"source": "smollm2"}, "reward": {"type": "function", "function": {"path": str(reward)}}},
            "data": {"task": "arithmetic"}, "trainer": {"checkpointDir": str(tmp_path / "ck")}}
    rc = main(["validate", str(_write(tmp_path, spec))])
    err = capsys.readouterr().err
    assert rc == 2 and "spec.models.reward.function" in err and expected in err, err


def test_missing_model_path_is_reported(tmp_path, capsys):
    rc = main(["validate", str(_write(tmp_path, {"models": {"actor": {"source": "path", "path": "/no/such/model"}}}))])
    err = capsys.readouterr().err
    assert rc == 2 and "spec.models.actor.path: '/no/such/model' is not an HF model directory" in err


def test_unwritable_checkpoint_dir_is_reported(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores mode bits: use a path under a regular file instead
            target = tmp_path / "file" / "ckpt"
            (tmp_path / "file").write_text("x")
        else:
            target = ro / "ckpt"
        rc = main(["validate", str(_write(tmp_path, {"trainer": {"checkpointDir": str(target)}}))])
    finally:
        ro.chmod(0o700)
    err = capsys.readouterr().err
    assert rc == 2 and "spec.trainer.checkpointDir" in err and "not writable" in err


def test_wrong_kind_and_bad_yaml(tmp_path, capsys):
    p = tmp_path / "x.yaml"
    p.write_text("kind: Pod\napiVersion: v1\n")
    assert main(["validate", str(p)]) == 2
    p.write_text("spec: [unclosed\n")
    assert main(["validate", str(p)]) == 2
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "expected exactly one document of kind RLHFJob" in err
    assert "not valid YAML" in err
    assert "missing.yaml: no such file" in err


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(SpecError) as exc:
        load_job(_write(tmp_path, {"rollout": {"responsesPerPrompt": 0, "topP": 2}, "trainer": {"bogus": 1}}))
    msg = str(exc.value)
    assert "3 problems" in msg and "spec.rollout.responsesPerPrompt" in msg and "spec.rollout.topP" in msg and "spec.trainer.bogus" in msg


def test_bad_input_through_the_real_cli_has_no_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "run", str(_write(tmp_path, {"rollout": {"temperature": 0}}))],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "spec.rollout.temperature: Input should be greater than 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_spec_module_does_not_import_torch():
    code = "import sys, hybridflow.spec, hybridflow.crd; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_round_trip_through_yaml_keeps_the_spec():
    job = RLHFJob()
    again = parse_job(yaml.safe_load(yaml.safe_dump(job.model_dump(by_alias=True, mode="json", exclude_none=True))))
    assert again.spec == job.spec
    assert isinstance(again.spec, JobSpec)
