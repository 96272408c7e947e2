"""The manifest: defaults, examples, and bad input that must fail with one clear message naming the field."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.jobs import save_readme_own_data_job

from hybridflow.cli import main
from hybridflow.api import JobSpec, RLHFJob, SpecError, dump_job, load_job, parse_job

from support.paths import ROOT

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
    ({"training": {"engine": "megatron", "pipelineParallel": 2}, "models": {"actor": {"tiny": {"numLayers": 3}}}},
     "spec.models.actor.tiny.numLayers = 3 is not divisible by spec.training.pipelineParallel = 2"),
    ({"rollout": {"engine": "megatron"}}, "spec.rollout.engine: megatron generation is fed by the megatron actor"),
    ({"training": {"engine": "megatron", "computeDtype": "bfloat16"}}, "computeDtype = bfloat16: the megatron engine"),
    ({"rollout": {"engine": "hf", "tensorParallel": 2}, "training": {"engine": "megatron", "tensorParallel": 2}},
     "only spec.rollout.engine megatron/vllm generates tensor-parallel"),
    ({"rollout": {"tensorParallel": 2}}, "tensor-parallel generation is fed shards by a model-parallel actor"),
    ({"rollout": {"tensorParallel": 2}, "training": {"engine": "megatron", "tensorParallel": 2}},
     "spec.models.actor.tiny.vocabSize = 32: vllm pads the vocabulary to a multiple of 64"),
    ({"rollout": {"engine": "megatron", "tensorParallel": 2}, "training": {"engine": "megatron"}},
     "spec.rollout.tensorParallel = 2 must divide spec.training.tensorParallel = 1"),
    ({"training": {"engine": "megatron", "tensorParallel": 2}},
     "spec.models.actor.tiny.numKvHeads = 1 is not divisible by spec.training.tensorParallel = 2"),
    ({"models": {"actor": {"source": "path"}}}, "spec.models.actor: source is 'path' but no path is given"),
    ({"models": {"reward": {"rule": "nope"}}}, "spec.models.reward.rule: unknown reward rule 'nope'; registered "
     "rules: arithmetic_exact, final_number_exact, increment, top_ids"),
    # beside a reward model the rule still scores the generated task's held-out evaluation (trainer.task)
    ({"models": {"reward": {"model": {"source": "tiny"}, "rule": "nope"}}},
     "spec.models.reward.rule: unknown reward rule 'nope'; registered rules: arithmetic_exact"),
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
     "spec.models.cost.rule: unknown reward rule 'nope'; registered rules: arithmetic_exact"),
    ({"algorithm": {"name": "safe_rlhf"}, "models": {"cost": {"type": "rule"}}},
     "spec.models.cost.rule: a rule cost needs one; name a registered rule (arithmetic_exact"),
    ({"algorithm": {"name": "safe_rlhf"}, "models": {"cost": {"type": "scorer", "scorers": [{"name": "math"}]}}},
     "spec.models.cost.type: a cost is a rule or a model"),
    ({"placement": {"critic": "gpus"}}, "spec.placement.critic: no resource pool named 'gpus'"),
    ({"placement": {"grader": "default"}}, "spec.placement.grader: unknown role"),
    ({"models": {"actor": {"tiny": {"hiddenSize": 48, "numHeads": 3, "numKvHeads": 1}}}}, "head size"),
    ({"models": {"actor": {"tiny": {"hiddenSize": 64, "numHeads": 3}}}}, "must be divisible by numHeads"),
    ({"algorithm": {"klCoef": 0.1}, "models": {"reference": False}}, "klCoef > 0 needs spec.models.reference"),
    ({"resourcePools": [{"name": "Bad_Name"}]}, "spec.resourcePools[0].name: must be lowercase letters and digits"),
    ({"resourcePools": [{"name": "gpu-a"}]}, "(no '-': the pods '<job>-<pool>-<index>-g<gen>' of two jobs could"),
    ({"resourcePools": [{"nodes": 1025}]}, "spec.resourcePools[0].nodes: Input should be less than or equal to 1024"),
    ({"resourcePools": [{"devicesPerNode": 65}]}, "spec.resourcePools[0].devicesPerNode: Input should be less than "
     "or equal to 64"),
    ({"resourcePools": [{"memoryPerNode": "4GB"}]}, "spec.resourcePools[0].memoryPerNode: must be a Kubernetes "
     "quantity such as 4Gi, 512Mi, 2 or 500m, got '4GB'"),
    ({"resourcePools": [{"nodeSelector": {"zone": "a b"}}]}, "spec.resourcePools[0].nodeSelector.zone: must be a "
     "label value"),
    ({"kubernetes": {"headCpu": "-1"}}, "spec.kubernetes.headCpu: must be a Kubernetes quantity"),
    ({"kubernetes": {"headMemory": "4 Gi"}}, "spec.kubernetes.headMemory: must be a Kubernetes quantity"),
    ({"kubernetes": {"checkpointPvc": "My_Claim"}}, "spec.kubernetes.checkpointPvc: must be a Kubernetes object name "
     "(a DNS-1123 subdomain"),
    ({"kubernetes": {"rayAuthSecret": "a" * 254}}, "spec.kubernetes.rayAuthSecret: String should have at most 253"),
    ({"kubernetes": {"serviceAccountName": "-sa"}}, "spec.kubernetes.serviceAccountName: must be a Kubernetes object"),
    ({"runPolicy": {"priorityClassName": "High"}}, "spec.runPolicy.priorityClassName: must be a Kubernetes object"),
    ({"runPolicy": {"backoffLimit": 1001}}, "spec.runPolicy.backoffLimit: Input should be less than or equal to 1000"),
    ({"trainer": {"steps": 10_000_001}}, "spec.trainer.steps: Input should be less than or equal to 10000000"),
    ({"trainer": {"promptsPerStep": 2**21}}, "spec.trainer.promptsPerStep: Input should be less than or equal to "
     "1048576"),
    ({"rollout": {"maxResponseLength": 2**20 + 1}}, "spec.rollout.maxResponseLength: Input should be less than"),
    ({"rollout": {"responsesPerPrompt": 1025}}, "spec.rollout.responsesPerPrompt: Input should be less than"),
    ({"rollout": {"temperature": float("inf")}}, "spec.rollout.temperature: Input should be a finite number"),
    ({"trainer": {"seed": -1}}, "spec.trainer.seed: Input should be greater than or equal to 0"),
    ({"data": {"chatTemplate": "x" * 65537}}, "spec.data.chatTemplate: String should have at most 65536 characters"),
    ({"trainer": {"checkpointDir": "/" + "d" * 4096}}, "spec.trainer.checkpointDir: String should have at most 4096"),
    ({"resourcePools": [{"name": f"p{i}"} for i in range(17)]}, "spec.resourcePools: List should have at most 16"),
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
    ({"data": {"source": "files", "train": 5}}, "spec.data.train: give a path or a list of paths, e.g. "
     "data/train.parquet or [a.parquet, b.parquet], got 5"),
    ({"data": {"source": "files", "eval": {"path": "t.jsonl"}}}, "spec.data.eval: give a path or a list of paths"),
    ({"data": {"source": "files", "train": ""}}, "spec.data.train[0]: String should have at least 1 character"),
    ({"data": {"source": "files", "train": "t" * 4097}}, "spec.data.train[0]: String should have at most 4096"),
    ({"models": {"reward": {"type": "rule", "function": {"path": "r.py"}}}},
     "spec.models.reward.type is 'rule' but spec.models.reward.function is given; remove spec.models.reward.type "
     "(function alone means type function) or remove spec.models.reward.function"),
    ({"models": {"reward": {"type": "function", "scorers": [{"name": "math"}]}}},
     "spec.models.reward.type is 'function' but spec.models.reward.scorers is given; remove spec.models.reward.type "
     "(scorers alone means type scorer) or give spec.models.reward.function in place of scorers"),
    ({"models": {"reward": {"type": "scorer", "scorers": [{"name": "math"}], "model": {}}}},
     "spec.models.reward.type is 'scorer' but spec.models.reward.model is given"),
    ({"models": {"reward": {"function": {"path": "r.py"}, "scorers": [{"name": "math"}]}}},
     "spec.models.reward.scorers, spec.models.reward.function are given together; keep the one you mean (it sets "
     "spec.models.reward.type), set spec.models.reward.type, or weigh them in spec.models.reward.weights to sum them"),
    ({"algorithm": {"name": "safe_rlhf"}, "models": {"cost": {"type": "rule", "model": {}}}},
     "spec.models.cost.type is 'rule' but spec.models.cost.model is given"),
    ({"algorithm": {"name": "safe_rlhf"}, "models": {"cost": {"function": {"path": "c.py"}}}},
     "spec.models.cost.type: a cost is a rule or a model, got function"),  # inferred for a cost too
    ({"tracking": {"tensorboard": True}, "trainer": {"checkpointDir": "s3://bucket/runs"}},
     "spec.tracking.tensorboard: event files are written beside the checkpoints on a file system, and "
     "spec.trainer.checkpointDir is object storage (s3://bucket/runs)"),
    ({"tracking": {"comet": True}}, "spec.tracking.comet: unknown field"),
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


def _files_job(tmp_path, data=None, reward=None) -> dict:
    """A job on prompt files that exist (empty: validate only resolves them) and a reward function file."""
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "r.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                   "    return 1.0\n")
    reward = reward or {"function": {"path": str(tmp_path / "r.py")}}
    return {"models": {"actor": {"source": "smollm2"}, "reward": reward},
            "data": {"source": "files", "train": str(tmp_path / "train.parquet"), **(data or {})},
            "trainer": {"checkpointDir": str(tmp_path / "ck")}}


@pytest.mark.parametrize("as_list", [False, True], ids=["one-path", "a-list"])
def test_train_and_eval_take_one_path_or_a_list(tmp_path, capsys, as_list):
    """verl's data.train_files takes either; a single path is a one-element list, and resolves as such."""
    train, test = str(tmp_path / "train.parquet"), str(tmp_path / "test.parquet")
    spec = _files_job(tmp_path, {"train": [train] if as_list else train, "eval": [test] if as_list else test})
    assert main(["validate", str(_write(tmp_path, spec))]) == 0, capsys.readouterr().err
    job = load_job(_write(tmp_path, spec))
    assert job.spec.data.train == [str(tmp_path / "train.parquet")]
    assert job.spec.data.eval == [str(tmp_path / "test.parquet")]
    assert dump_job(job)["spec"]["data"]["train"] == [str(tmp_path / "train.parquet")]  # the resolved spec: a list
    (tmp_path / "train.parquet").unlink()  # and the preflight checks the single path's file
    assert main(["validate", str(_write(tmp_path, spec))]) == 2
    assert f"spec.data.train: '{tmp_path / 'train.parquet'}' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("reward,expected", [
    ({"function": {"path": "r.py"}}, "function"),
    ({"scorers": [{"name": "math"}]}, "scorer"),
    ({"model": {"source": "smollm2"}}, "model"),
    ({"rule": "increment"}, "rule"),
    ({}, "rule"),
    ({"type": "function", "function": {"path": "r.py"}}, "function"),
    # a generated task's rule beside a reward model scores the held-out evaluation: no second source
    ({"model": {"source": "smollm2"}, "rule": "increment"}, "model"),
    ({"type": "model", "model": {"source": "smollm2"}, "rule": "increment"}, "model"),
], ids=["function", "scorers", "model", "rule", "nothing", "explicit", "model-and-eval-rule", "explicit-model-rule"])
def test_reward_type_follows_from_the_one_field_given(reward, expected):
    spec = {"models": {"actor": {"source": "smollm2"}, "reward": reward}}
    job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "x"},
                     "spec": spec})
    assert job.spec.models.reward.type == expected
    resolved = dump_job(job)
    assert resolved["spec"]["models"]["reward"]["type"] == expected  # the operator's ConfigMap says it
    assert parse_job(resolved).spec == job.spec


def test_a_cost_type_follows_from_its_field_too():
    job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "x"}, "spec": {
        "algorithm": {"name": "safe_rlhf"}, "models": {"cost": {"model": {"source": "tiny"}}}}})
    assert job.spec.models.cost.type == "model"


def test_validate_checks_the_reward_file_of_an_inferred_function(tmp_path, capsys):
    """`reward: {function: {path: ...}}` is type function, so the preflight checks its file."""
    spec = _files_job(tmp_path)
    assert main(["validate", str(_write(tmp_path, spec))]) == 0, capsys.readouterr().err
    (tmp_path / "r.py").write_text("def other(a, b, c, d):\n    return 1\n")
    assert main(["validate", str(_write(tmp_path, spec))]) == 2
    assert "spec.models.reward.function: " in capsys.readouterr().err


def test_the_readme_own_data_job_is_valid_as_printed(tmp_path, capsys, monkeypatch):
    """`hybridflow validate my-job.yaml` in the repository root, as README.md says (the data's files need only exist
    here; tests/trainer/test_end_to_end.py runs the job)."""
    data = tmp_path / "examples" / "data" / "gsm8k_style"
    data.mkdir(parents=True)
    for name in ("train.parquet", "test.parquet"):
        (data / name).write_bytes(b"")
    job, ckpt = save_readme_own_data_job(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", job.name]) == 0, capsys.readouterr().err
    spec = load_job(job).spec
    assert spec.models.reward.type == "function" and spec.data.train == ["examples/data/gsm8k_style/train.parquet"]
    assert not ckpt.exists()


def _file_in_the_way(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "ckpt"


# Root ignores permission bits, so chmod cannot make a directory read-only for these tests; the kernel's own
# filesystems refuse root: /proc (no directory can be made in it) and /sys (read-only to everyone).
@pytest.mark.parametrize("target,reason", [
    (lambda tmp: Path("/proc/hybridflow-ckpt"), "cannot make a directory in '/proc'"),
    (lambda tmp: Path("/proc"), "cannot make a directory in '/proc'"),
    (lambda tmp: Path("/sys/hybridflow-ckpt"), "cannot make a directory in '/sys'"),
    (_file_in_the_way, "is a file, not a directory"),
], ids=["proc-missing", "proc-itself", "sys-read-only", "file-in-the-way"])
def test_unwritable_checkpoint_dir_is_bad_input_before_anything_starts(tmp_path, capsys, monkeypatch, target,
                                                                       reason):
    import hybridflow.cli as cli

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a job whose checkpointDir cannot be written")

    monkeypatch.setattr(cli, "start_local_ray", no_ray)
    where = target(tmp_path)
    p = _write(tmp_path, {"trainer": {"checkpointDir": str(where)}})
    for cmd in ("validate", "run"):
        assert main([cmd, str(p)]) == 2
        err = capsys.readouterr().err
        assert f"spec.trainer.checkpointDir: '{where}' is not writable (" in err and reason in err, err
        assert "choose a directory you can write" in err and "job failed" not in err


def test_a_failure_carrying_a_remote_traceback_still_names_itself_in_the_pods_termination_message(
        tmp_path, capsys, monkeypatch):
    """A job that fails with a Ray task's error (its message carries the remote traceback, tens of lines): the
    error printed last is bounded, so the tail of the log a pod's termination message keeps (FallbackToLogsOnError:
    the last 2048 bytes, 80 lines) holds the line that says the job failed and what failed at the bottom, and the
    operator's reading of it (api.errors.last_error) is not empty."""
    import hybridflow.cli as cli
    from hybridflow.api.errors import last_error

    frames = [f'  File "/opt/venv/lib/python3.12/site-packages/hybridflow/roles/m{i}.py", line {i}, in call_{i}\n'
              f"    return self.step_{i}(batch, version, deadline)" for i in range(40)]
    remote = "\n".join(["rollout generation failed: ray::WorkerHost.execute() (pid=4242, ip=10.244.0.5)", *frames,
                        "WeightStreamError: rollout rank 0: unknown dtype 'fp7' in a weight stream header"])

    def failing_ray(*args, **kwargs):
        raise RuntimeError(remote)

    monkeypatch.setattr(cli, "start_local_ray", failing_ray)
    assert main(["run", str(_write(tmp_path, {"trainer": {"checkpointDir": str(tmp_path / "run")}}))]) == 1
    err = capsys.readouterr().err
    tail = "\n".join(err.encode()[-2048:].decode(errors="ignore").splitlines()[-80:])
    reported = last_error(tail)
    assert reported.startswith("job failed: RuntimeError: rollout generation failed: ray::WorkerHost.execute()"), tail
    assert "unknown dtype 'fp7'" in reported, reported


def test_an_unwritable_data_cache_dir_is_bad_input(tmp_path, capsys):
    spec = _files_job(tmp_path, {"cacheDir": "/proc/hybridflow-cache"})
    assert main(["validate", str(_write(tmp_path, spec))]) == 2
    assert "spec.data.cacheDir: '/proc/hybridflow-cache' is not writable" in capsys.readouterr().err


def test_the_writability_check_leaves_nothing_behind(tmp_path, capsys):
    """`hybridflow validate` makes no directory: not the checkpointDir, not its missing parents, no probe."""
    before = set(tmp_path.iterdir())
    p = _write(tmp_path, {"trainer": {"checkpointDir": str(tmp_path / "a" / "b" / "ckpt")}})
    assert main(["validate", str(p)]) == 0, capsys.readouterr().err
    assert set(tmp_path.iterdir()) == before | {p}
    (tmp_path / "ckpt").mkdir()
    assert main(["validate", str(_write(tmp_path, {"trainer": {"checkpointDir": str(tmp_path / "ckpt")}}))]) == 0
    assert list((tmp_path / "ckpt").iterdir()) == []


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
    code = "import sys, hybridflow.api, hybridflow.api.crd; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_round_trip_through_yaml_keeps_the_spec():
    job = RLHFJob()
    again = parse_job(yaml.safe_load(yaml.safe_dump(job.model_dump(by_alias=True, mode="json", exclude_none=True))))
    assert again.spec == job.spec
    assert isinstance(again.spec, JobSpec)


# --- bad YAML is bad input (exit 2), however it is bad ---------------------------------------------------------------

LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("text,expected", [
    (LAUGHS + "kind: RLHFJob\n", "refused: more than 100000 values once its aliases are expanded"),
    ("kind: RLHFJob\nspec: " + "[" * 100 + "]" * 100 + "\n", "refused: nested deeper than 64 levels"),
    ("kind: RLHFJob\nspec: " + "[" * 100_000 + "]" * 100_000 + "\n", "refused: nested deeper than 64 levels"),
    ("kind: RLHFJob\nspec: &s {x: [*s]}\n", "nested deeper than 64 levels once its aliases are expanded"),
    ("a: &a [[[[[[[[[[1]]]]]]]]]]\nb: &b [[[[[[[[[[*a]]]]]]]]]]\nc: &c [[[[[[[[[[*b]]]]]]]]]]\n"
     "d: &d [[[[[[[[[[*c]]]]]]]]]]\ne: &e [[[[[[[[[[*d]]]]]]]]]]\nf: &f [[[[[[[[[[*e]]]]]]]]]]\n"
     "g: [[[[[[[[[[*f]]]]]]]]]]\n", "nested deeper than 64 levels once its aliases are expanded"),
    (b"kind: RLHFJob\nmetadata: {name: \xff}\n", "not UTF-8 text"),
    ("kind: RLHFJob\n" + "#" * (3 << 20), "more than the 3145728 a Kubernetes request may hold"),
], ids=["billion-laughs", "deep", "very-deep", "recursive-anchor", "deep-through-aliases", "not-utf8", "too-big"])
def test_manifests_past_the_limits_are_bad_input(tmp_path, capsys, text, expected):
    p = tmp_path / "bomb.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    for cmd in ("validate", "run"):
        assert main([cmd, str(p)]) == 2
        err = capsys.readouterr().err
        assert f"{p}: " in err and expected in err, err
        assert "Traceback" not in err and "job failed" not in err


def test_ordinary_aliases_still_load(tmp_path):
    doc = ("apiVersion: hybridflow.io/v1alpha1\nkind: RLHFJob\nmetadata: {name: anchors}\nspec:\n"
           "  resourcePools:\n  - {name: a, nodeSelector: &zone {zone: z1}}\n  - {name: b, nodeSelector: *zone}\n")
    p = tmp_path / "job.yaml"
    p.write_text(doc)
    assert load_job(p).spec.resource_pools[1].node_selector == {"zone": "z1"}


# --- every child the operator names fits, and no two jobs name a child alike ---------------------------------------

def test_the_longest_job_and_pool_names_give_valid_child_names():
    import re

    from hybridflow_operator.manifests import head_pod_name, names, worker_pod_name

    from hybridflow.api import DNS1035_LABEL, DNS1123_SUBDOMAIN, MAX_BACKOFF, MAX_JOB_NAME, MAX_NODES

    job, pool = "j" * MAX_JOB_NAME, "p" * 63
    parse_job({"kind": "RLHFJob", "metadata": {"name": job}, "spec": {
        "resourcePools": [{"name": pool, "nodes": MAX_NODES, "devicesPerNode": 1}], "trainer": {"promptsPerStep": 1024},
        "runPolicy": {"backoffLimit": MAX_BACKOFF}}})
    service = names(job)["service"]
    assert len(service) <= 63 and re.fullmatch(DNS1035_LABEL, service)  # a Service name is a DNS-1035 label
    children = [*names(job).values(), head_pod_name(job, MAX_BACKOFF), worker_pod_name(job, pool, MAX_NODES - 1,
                                                                                        MAX_BACKOFF)]
    for name in children:
        assert len(name) <= 253 and re.fullmatch(DNS1123_SUBDOMAIN, name), name
    assert len(job) <= 63  # the value of the label hybridflow.io/job
    with pytest.raises(SpecError, match="at most 58 characters"):
        parse_job({"kind": "RLHFJob", "metadata": {"name": "j" * (MAX_JOB_NAME + 1)}})


def test_pod_names_of_two_jobs_never_collide():
    """Exhaustively over short names with dashes where they are allowed (job names), digits and the word `head`:
    distinct (job, pod) pairs give distinct names. Pool names without '-' are what makes this hold."""
    import itertools
    import re

    from hybridflow_operator.manifests import head_pod_name, worker_pod_name

    from hybridflow.api import DNS1035_LABEL, POOL_NAME

    words = ["a", "b", "0", "1", "g0", "head", "a-b", "a-0", "b-1", "a-head", "a-b-0", "a-g0", "a-0-g1"]
    jobs = [w for w in words if re.fullmatch(DNS1035_LABEL, w)]
    pools = [w for w in words if re.fullmatch(POOL_NAME, w)]
    seen: dict[str, tuple] = {}
    for job, gen in itertools.product(jobs, (0, 1, 10)):
        pods = {("head", gen): head_pod_name(job, gen)}
        pods.update({(pool, i, gen): worker_pod_name(job, pool, i, gen) for pool in pools for i in (0, 1, 10)})
        for key, name in pods.items():
            assert seen.setdefault(name, (job, key)) == (job, key), f"{name}: {(job, key)} and {seen[name]}"
    # ...and the collision that a dash in a pool name would allow:
    assert worker_pod_name("a", "b-c", 0, 0) == worker_pod_name("a-b", "c", 0, 0)
    assert not re.fullmatch(POOL_NAME, "b-c")


# --- `hybridflow run` refuses what this machine cannot hold ----------------------------------------------------------

GIB = 1 << 30


def _machine(gib: float = 23, gpus: int = 0):
    from hybridflow.capacity import Machine

    return Machine(memory_bytes=int(gib * GIB), gpus=gpus)


LOCAL_EXAMPLES = [p for p in EXAMPLES if all(
    pool.device == "cpu" and pool.nodes == 1 for pool in load_job(p).spec.resource_pools)]


@pytest.mark.parametrize("path", LOCAL_EXAMPLES, ids=lambda p: p.name)
def test_every_local_example_fits_the_project_machine(path):
    """`make run` (tiny-grpo) and every single-node CPU example the tests run, on the 24 GiB machines (23 usable)."""
    from hybridflow.capacity import local_capacity_problems

    assert local_capacity_problems(load_job(path).spec, _machine(23)) == []


def test_sixteen_local_devices_do_not_fit_24_gib():
    """The job that used to start 16 workers on a 24 GiB machine and die of OOM two minutes later."""
    from hybridflow.capacity import local_capacity_problems

    job = load_job(ROOT / "examples" / "tiny-grpo.yaml")
    job.spec.resource_pools[0].devices_per_node = 16
    job.spec.rollout.kv_cache_gib = 1.0  # a fixed cache; sized from the job (0, the default) it is a few MiB here
    [problem] = local_capacity_problems(job.spec, _machine(24))
    assert problem.startswith("spec.resourcePools: the job needs at least 29.5 GiB of memory here and this machine "
                              "has 24.0 GiB: spec.resourcePools[0] ('default'): 16 devices x 1.8 GiB (process 0.8 GiB, "
                              "vLLM KV cache (spec.rollout.kvCacheGib) 1.0 GiB"), problem
    assert "lower devicesPerNode" in problem
    job.spec.rollout.engine = "hf"  # no KV cache: 16 processes of 0.75 GiB fit
    assert local_capacity_problems(job.spec, _machine(24)) == []


def test_the_model_counts_toward_each_rank():
    from hybridflow.capacity import SMOLLM2_PARAMS, local_capacity_problems, rank_floor, tiny_params

    job = load_job(ROOT / "examples" / "gsm8k-style.yaml")
    parts = rank_floor(job.spec, job.spec.resource_pools[0], _machine())
    assert parts["the actor's generation weights"] == SMOLLM2_PARAMS * 2  # auto: generation may run in bf16
    job.spec.training.compute_dtype, job.spec.rollout.kv_cache_gib = "float32", 1.0
    parts = rank_floor(job.spec, job.spec.resource_pools[0], _machine())
    assert parts["the actor's generation weights"] == SMOLLM2_PARAMS * 4
    [problem] = local_capacity_problems(job.spec, _machine(5))
    assert "2 devices x 2.3 GiB" in problem and "the actor's generation weights 0.5 GiB" in problem, problem
    tiny = load_job(ROOT / "examples" / "tiny-grpo.yaml").spec.models.actor.tiny
    assert tiny_params(tiny) == 16 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 64 + 64 + 3 * 64 * 128 + 2 * 64) + 64


def test_gpus_and_nodes_the_machine_lacks_are_named():
    from hybridflow.capacity import local_capacity_problems

    spec = load_job(ROOT / "examples" / "gpu-grpo-7b.yaml").spec
    assert local_capacity_problems(spec, _machine(gpus=16)) == [
        "spec.resourcePools[0].nodes = 2: more than one node needs a Ray cluster: use `hybridflow driver --address` "
        "(or the operator)"]
    spec.resource_pools[0].nodes = 1
    assert local_capacity_problems(spec, _machine(gpus=0)) == [
        "spec.resourcePools: the job asks for 8 GPUs (spec.resourcePools[0] ('gpus') 8) and this machine has 0; lower "
        "devicesPerNode, or run the job on a cluster (the operator)"]
    assert local_capacity_problems(spec, _machine(gpus=8)) == []


def test_run_refuses_before_starting_anything(tmp_path, capsys, monkeypatch):
    import hybridflow.cli as cli

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a job this machine cannot hold")

    monkeypatch.setattr(cli, "machine_facts", lambda job: _machine(24))
    monkeypatch.setattr(cli, "start_local_ray", no_ray)
    p = _write(tmp_path, {"resourcePools": [{"devicesPerNode": 32}], "trainer": {"checkpointDir": str(tmp_path)}})
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err
    assert f"{p}: cannot run on this machine" in err and "spec.resourcePools[0] ('default'): 32 devices" in err, err
    assert main(["validate", str(p)]) == 0  # fine for a cluster


def test_machine_facts_read_this_machine():
    from hybridflow.capacity import machine_facts

    facts = machine_facts(RLHFJob())
    assert 1 * GIB < facts.memory_bytes < 1 << 50 and facts.gpus == 0


def test_a_placement_key_is_bounded_and_never_quoted_whole():
    """Issue 24 N9: a placement key is a role name; a 200 KB one is refused with its length and its start, so the
    message (which reaches the job's status) stays short."""
    with pytest.raises(SpecError) as err:
        parse_job({"spec": {"placement": {"k" * 200_000: "default"}}})
    assert len(str(err.value)) < 400
    assert "spec.placement: role names (actor, rollout" in str(err.value)
    assert "are at most 63 characters; got one of 200000 starting 'kkkkkkkkkkkkkkkkkkkk'" in str(err.value)
    with pytest.raises(SpecError, match=r"spec.placement.kkk+: unknown role"):  # within the bound: the usual message
        parse_job({"spec": {"placement": {"k" * 63: "default"}}})


# Rollout on a pool of its own (issue 26): what the spec accepts and what it refuses, and why.
TWO_POOLS = {"resourcePools": [{"name": "trainer", "devicesPerNode": 1}, {"name": "rollout", "devicesPerNode": 1}],
             "placement": {"actor": "trainer", "rollout": "rollout"}}


def _two_pools(**rollout) -> dict:
    return {"spec": {**TWO_POOLS, "rollout": rollout}}


@pytest.mark.parametrize("rollout", [{"mode": "sync"}, {"mode": "one_step_off"}, {"mode": "async", "maxStaleness": 3},
                                     {"mode": "async", "partialRolloutTokens": 4, "queuePrompts": 64, "engine": "hf"}])
def test_a_rollout_pool_of_its_own_is_accepted_in_every_mode(rollout):
    job = parse_job(_two_pools(**rollout))
    assert job.spec.pool("rollout").name == "rollout" and job.spec.rollout.mode == rollout["mode"]
    assert parse_job(dump_job(job)).spec == job.spec  # a dumped spec (every field set) reads back


@pytest.mark.parametrize("doc,message", [
    ({"spec": {"rollout": {"mode": "one_step_off"}}}, "spec.rollout.mode = one_step_off generates while the actor "
                                                      "trains, so rollout needs devices of its own"),
    ({"spec": {"rollout": {"mode": "async"}}}, "spec.rollout.mode = async generates while the actor trains"),
    (_two_pools(tensorParallel=2), "spec.rollout.tensorParallel = 2: a rollout pool of its own holds one replica"),
    ({"spec": {**TWO_POOLS, "training": {"engine": "megatron"}, "rollout": {"engine": "megatron"}}},
     "spec.placement.rollout: megatron generation runs on the actor's own processes"),
    (_two_pools(maxStaleness=3), "spec.rollout.maxStaleness applies to mode async only (mode is sync)"),
    (_two_pools(mode="one_step_off", partialRolloutTokens=2), "spec.rollout.partialRolloutTokens applies to mode "
                                                              "async only"),
    ({"spec": {**TWO_POOLS, "resourcePools": [{"name": "trainer", "devicesPerNode": 1},
                                              {"name": "rollout", "devicesPerNode": 3}]}},
     "responses a step do not split evenly over the rollout pool's 3 replicas"),
    ({"spec": {**TWO_POOLS, "algorithm": {"name": "remax"}, "rollout": {"mode": "async"}}},
     "spec.rollout.mode = async: remax's baseline is a greedy response of the policy being trained"),
    ({"spec": {**TWO_POOLS, "resourcePools": [{"name": "trainer", "devicesPerNode": 1},
                                              {"name": "rollout", "devicesPerNode": 2}],
               "algorithm": {"name": "remax"}, "rollout": {"responsesPerPrompt": 2}, "trainer": {"promptsPerStep": 1}}},
     "spec.rollout.responsesPerPrompt (+1 greedy baseline per prompt: remax) = 3 responses a step do not split"),
])
def test_what_a_rollout_pool_refuses_names_the_field_and_the_way_out(doc, message):
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_every_algorithm_runs_in_every_mode_or_is_refused_saying_why(mode):
    """Issue 26 item 5: each registered algorithm, on two pools, is accepted or refused by a message about the mode
    (not by some unrelated rule: its other needs are met the way its example meets them)."""
    from hybridflow.algorithms import ALGORITHMS

    refused = {}
    for name in ALGORITHMS.names():
        spec = {**TWO_POOLS, "algorithm": {"name": name}, "rollout": {"mode": mode}}
        if ALGORITHMS[name].cost:
            spec["models"] = {"cost": {"type": "rule", "rule": "top_ids"}}
        try:
            parse_job({"spec": spec})
        except SpecError as e:
            refused[name] = str(e)
    assert all("spec.rollout.mode" in msg for msg in refused.values()), refused
    assert set(refused) == ({"remax"} if mode == "async" else set())


def test_every_tracking_field_is_a_registered_tracker():
    """spec.tracking's fields name TRACKERS' entries: a field without a tracker would be accepted and do nothing."""
    from hybridflow.api.schema import Tracking
    from hybridflow.trainer.tracking import TRACKERS

    assert sorted(Tracking.model_fields) == TRACKERS.names()


def test_an_offline_wandb_run_needs_a_checkpoint_dir_on_a_file_system():
    doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    doc["spec"]["tracking"] = {"wandb": {"project": "p", "mode": "offline"}}
    doc["spec"]["trainer"]["checkpointDir"] = "s3://bucket/runs"
    with pytest.raises(SpecError, match="spec.tracking.wandb.mode: offline runs are written beside the checkpoints"):
        parse_job(doc)
    doc["spec"]["tracking"]["wandb"]["mode"] = "online"
    assert parse_job(doc).spec.tracking.wandb.mode == "online"
    doc["spec"]["tracking"]["wandb"]["project"] = "a/b"
    with pytest.raises(SpecError, match="spec.tracking.wandb.project"):
        parse_job(doc)
