"""`hybridflow run` as a user runs it: real Ray, vLLM, FSDP2 on two CPU ranks, real processes and signals."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from support.jobs import job_variant, run_cli, save_readme_own_data_job
from support.learning import LEARNED_GAIN, LEARNED_MIN  # "clearly learned"
from support.paths import ROOT
from support.processes import kill_processes_mentioning
from mlflow_server import mlflow_server

from hybridflow.checkpoint import list_checkpoints, read_step_log, verify

pytestmark = pytest.mark.slow

TINY = ROOT / "examples" / "tiny-grpo.yaml"


def _steps(ckpt_dir):
    return read_step_log(ckpt_dir)


# All a default run may print on stderr: hybridflow's own warnings and errors, one line each (cli.KeyValueFormatter),
# which say what went wrong. Anything else is noise: info or debug lines, Python warnings, chatter from Ray, vLLM,
# torch or transformers, worker output forwarded to the driver.
_OWN_WARNING = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d (warning|error) hybridflow(\.\w+)*: ")


# What the driver itself prints on stdout for a run (its progress and summary lines), told apart from noise in a
# log holding both streams (a client.local run's driver.log).
_DRIVER_LINE = re.compile(r"(job \S+: |prompts: |workers ready in |held-out reward|step \d+/\d+ |done: \d+ steps)")


def _noise(stderr, with_stdout=False):
    return [line for line in stderr.splitlines() if line.strip() and not _OWN_WARNING.match(line)
            and not (with_stdout and _DRIVER_LINE.match(line))]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tiny_example_learns(tiny_example_run):
    ckpt, out = tiny_example_run  # examples/tiny-grpo.yaml as it is (conftest); test_export exports this run too
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 40/40" in out.stdout and "ETA" in out.stdout and "tok/s" in out.stdout
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["eval_after"] >= LEARNED_MIN, summary
    assert summary["eval_after"] - summary["eval_before"] >= LEARNED_GAIN, summary
    records = _steps(ckpt)
    assert [r["step"] for r in records] == list(range(1, 41))
    last = records[-1]
    for stage in ("generate", "reference", "reward", "advantages", "actor_update", "reshard"):
        assert last["stages"][stage] > 0, stage
    assert "old_log_prob" not in last["stages"]  # on-policy (one epoch, one mini-batch): the update's forward gave them
    assert last["throughput_tokens_per_s"] > 0 and last["actor_peak_memory_bytes"] > 0
    assert last["reward_mean"] > records[0]["reward_mean"]
    noise = _noise(out.stderr, with_stdout=True)  # (the client's run keeps both streams in one log)
    assert not noise, f"logs should be quiet by default; {len(noise)} line(s) of noise:\n" + "\n".join(noise[:40])


def test_ppo_with_hf_generation_and_a_reward_model(tmp_path, run_here):
    """examples/tiny-ppo.yaml with plain torch/HF generation (`--engine hf`) and its responses scored by a (random)
    tiny reward model: the critic computes values and trains, writes its own shards, and the rewards are the model's
    real-valued scores."""
    ckpt = tmp_path / "run"
    job = job_variant(tmp_path, ROOT / "examples" / "tiny-ppo.yaml", models__reward={"type": "model", "model": {
        "source": "tiny", "tiny": {"vocabSize": 16, "hiddenSize": 64, "numHeads": 2, "numKvHeads": 1}}})
    rc, printed = run_here(job, {"spec.rollout.engine": "hf", "spec.trainer.steps": 2,
                                 "spec.trainer.checkpointDir": str(ckpt), "spec.trainer.profileSteps": [2]},
                           cwd=tmp_path)
    assert rc == 0, printed[-3000:]
    records = _steps(ckpt)
    assert len(records) == 2
    # step 2 profiled (spec.trainer.profileSteps): the actor's update, the generation and the transition, by kind
    assert not any(k.startswith("profile_") for k in records[0])
    for stage in ("update", "generate", "reshard"):
        assert records[1][f"profile_{stage}_wall_s"] > 0, stage
        assert f"| {stage}: kind | seconds |" in printed, printed[-3000:]
    assert records[1]["profile_update_matmul_s"] > 0 and records[1]["profile_generate_matmul_s"] > 0
    for r in records:
        assert r["stages"]["values"] > 0 and r["stages"]["critic_update"] > 0
        assert "critic_vf_loss" in r and "kl_mean" in r
    assert (ckpt / "step_00000002" / "critic" / ".metadata").is_file()  # the critic's own shards
    # A (random) reward model gives real-valued scores; the counting rule can only give each of a step's responses
    # (32 prompts x 4, 6 tokens each: no stop token) a multiple of 1/6, so their mean a multiple of 1/(6*128).
    assert any(abs(r["reward_mean"] * 6 * 128 - round(r["reward_mean"] * 6 * 128)) > 1e-3 for r in records), records


def _kill_session(proc, ray_tmp):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # Ray daemons started by the run must not outlive it; anything left is found by its session dir and ended.
    return kill_processes_mentioning(ray_tmp, grace=20)


def _staged_step(staging):
    return int(staging.name[len(".step_"):-len(".tmp")])


def _metric(body, name, job):
    """The value of `name{rlhfjob="<job>"}` in a Prometheus text exposition, or None."""
    for line in body.splitlines():
        if line.startswith(f'{name}{{rlhfjob="{job}"}} '):
            return float(line.split()[-1])
    return None


def test_kill_9_during_a_save_loses_nothing_sealed_and_repeats_no_step(tmp_path, model_cache, ray_tmp):
    """The job logs to TensorBoard and to a real MLflow server too: both keep one run across the kill."""
    with mlflow_server(tmp_path / "mlflow") as tracking_uri:
        _kill_9_during_a_save(tmp_path, model_cache, ray_tmp, tracking_uri)


def _kill_9_during_a_save(tmp_path, model_cache, ray_tmp, tracking_uri):
    """The run is killed while a checkpoint is being written (its staging directory holds shards) once two are
    sealed; while it ran, its Prometheus endpoint reported progress. The newest sealed checkpoint is then corrupted
    too (a rank's actor shard overwritten): the resume says it skips that one, discards the torn save, goes on from
    the one before, and the step log lists every step exactly once. A wider model than the example's makes each
    write last long enough to be caught in the middle; a save every step gives several chances to catch one.
    The save is asynchronous (trainer.asyncSave: the shards are written while the next step runs), the case where
    a kill finds the most in flight; a synchronous save writes into the same staging directory and seals it the
    same way. Generation is vLLM: its processes too must not outlive the kill.
    (One run, not one per save mode: each costs ~60-80 s of the test budget.)"""
    ckpt = tmp_path / "run"
    steps = 6
    job = job_variant(tmp_path, TINY, trainer__steps=steps, trainer__saveFreq=1, trainer__promptsPerStep=16,
                   trainer__asyncSave=True, trainer__checkpointDir=str(ckpt), data__evalPrompts=8,
                   models__actor__tiny__hiddenSize=256, models__actor__tiny__numLayers=4, rollout__engine="vllm",
                   tracking__tensorboard=True, tracking__mlflow={"trackingUri": tracking_uri},
                   tracking__wandb={"project": "hybridflow-tests", "mode": "offline"})
    port = _free_port()
    # unbuffered: what it printed before the kill is in the file
    env = {**os.environ, "HYBRIDFLOW_MODEL_CACHE": str(model_cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "hybridflow.cli", "run", str(job), "--metrics-port", str(port),
           "--ray-temp-dir", ray_tmp]
    with open(tmp_path / "killed-run.out", "w") as stdout:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True, stdout=stdout,
                                stderr=subprocess.DEVNULL)
    writing, body = None, None
    deadline = time.time() + 400
    try:
        while time.time() < deadline and writing is None:
            assert proc.poll() is None, "the run ended before it could be killed"
            if body is None and len(_steps(ckpt)) >= 2:  # the step gauge is set just after a step is logged
                # While it runs, its Prometheus endpoint reports progress.
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            # a save caught while its shards are being written, once two checkpoints are sealed
            if len(list_checkpoints(ckpt)) >= 2:
                staged = [p for p in ckpt.glob(".step_*.tmp") if any(p.rglob("*.distcp"))]
                writing = staged[0] if staged else None
            time.sleep(0.002)
    finally:
        leftovers = _kill_session(proc, ray_tmp)
    assert writing is not None, "no save was caught in progress"
    assert leftovers == 0, f"{leftovers} process(es) outlived the killed run"
    assert body is not None, "the run was killed before its metrics were read"
    assert (_metric(body, "hybridflow_step", "tiny-grpo") or 0) >= 1, body
    assert (_metric(body, "hybridflow_throughput_tokens_per_second", "tiny-grpo") or 0) > 0, body
    assert "held-out reward before" in (tmp_path / "killed-run.out").read_text()
    killed_at = _staged_step(writing)
    sealed = [c for c in list_checkpoints(ckpt) if verify(c) is None]
    assert len(sealed) >= 2 and all(int(c.name[5:]) < killed_at for c in sealed), (writing, sealed)
    corrupt, resumed = sealed[-1], int(sealed[-2].name[5:])
    logged = [r["step"] for r in _steps(ckpt)]
    assert max(logged) >= int(corrupt.name[5:]) > resumed, logged  # logged steps past the one resumed: dropped
    # The newest sealed checkpoint gets corrupted too: resume must fall back to the one before and say so.
    with open(corrupt / "actor" / "__1_0.distcp", "r+b") as f:  # rank 1's actor shard
        f.seek(100)
        f.write(b"\x00" * 64)

    # -v: its start-up says what it discarded (a later save of the torn step would replace the directory anyway)
    out = run_cli(["-v", "run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert any("skipping corrupt checkpoint" in line and corrupt.name in line for line in out.stderr.splitlines()), \
        out.stderr[-3000:]
    assert "removed the unsealed checkpoint(s) of a save that was interrupted" in out.stderr, out.stderr[-3000:]
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["start_step"] == resumed, "the newest intact checkpoint is the one resumed"
    assert summary["steps_done"] == steps - resumed
    assert [r["step"] for r in _steps(ckpt)] == list(range(1, steps + 1)), "each step exactly once"
    assert not list(ckpt.glob(".step_*.tmp")), "the torn save is cleaned up"
    assert verify(ckpt / f"step_{steps:08d}") is None
    assert "held-out reward before" not in out.stdout  # a resumed job does not pretend to start over
    before = float(re.search(r"held-out reward before training: ([0-9.]+)",
                             (tmp_path / "killed-run.out").read_text()).group(1))
    _check_one_tensorboard_run(ckpt, steps, before, summary["eval_after"])
    _check_one_mlflow_run(tracking_uri, ckpt, steps)
    _check_one_wandb_run(ckpt, steps, resumed)


def _check_one_wandb_run(ckpt, steps, resumed):
    """spec.tracking.wandb (offline) across the kill: the killed run and the resumed one are one W&B run (the id in
    <checkpointDir>/wandb-run.json), its config the resolved spec; the resumed part logs every step from the
    checkpoint it resumed from on, each value the step log's, against hybridflow_step."""
    from support.wandb_records import run

    parts = sorted((ckpt / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(parts) == 2, parts  # the killed run's, the resumed run's
    killed, resumed_run = (run(p) for p in parts)
    run_id = json.loads((ckpt / "wandb-run.json").read_text())["run_id"]
    assert killed["id"] == resumed_run["id"] == run_id and resumed_run["project"] == "hybridflow-tests"
    assert resumed_run["config"]["spec"]["trainer"]["steps"] == steps
    rows = [r for r in resumed_run["history"] if "hybridflow_reward_mean" in r]
    assert [r["hybridflow_step"] for r in rows] == list(range(resumed, steps + 1)), rows
    by_step = {r["step"]: r for r in _steps(ckpt)}
    for row in rows:
        assert row["hybridflow_reward_mean"] == pytest.approx(by_step[row["hybridflow_step"]]["reward_mean"],
                                                              rel=1e-6, abs=1e-7)
    assert any("hybridflow_reward_mean" in r for r in killed["history"]), "the killed run logged its steps too"


def _check_one_tensorboard_run(ckpt, steps, eval_before, eval_after):
    """spec.tracking.tensorboard across the kill: one run in <checkpointDir>/tensorboard where every step has one
    point, the resumed run's (the killed run's points of the steps done again are purged), under the Prometheus
    names, equal to the step log; the held-out reward before training at step 0 and after it at the last step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(ckpt / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    points = {tag: [(e.step, e.value) for e in board.Scalars(tag)] for tag in board.Tags()["scalars"]}
    assert points["hybridflow_step"] == [(s, float(s)) for s in range(1, steps + 1)], points["hybridflow_step"]
    records = _steps(ckpt)
    assert [s for s, _ in points["hybridflow_reward_mean"]] == list(range(1, steps + 1))
    for (step, value), rec in zip(points["hybridflow_reward_mean"], records):
        assert value == pytest.approx(rec["reward_mean"], rel=1e-6, abs=1e-7), (step, value, rec["reward_mean"])
    assert {"hybridflow_throughput_tokens_per_second", "hybridflow_stage_duration_seconds/generate",
            "hybridflow_grad_norm"} <= set(points), sorted(points)
    assert points["hybridflow_eval_reward_mean/before"] == [(0, pytest.approx(eval_before, abs=5e-4))]  # printed
    assert points["hybridflow_eval_reward_mean/after"] == [(steps, pytest.approx(eval_after))]
    for tag, series in points.items():  # one point per step: none repeated, none left from the killed run
        assert [s for s, _ in series] == sorted({s for s, _ in series}), (tag, series)


@pytest.mark.parametrize("example", ["word-problems.yaml", "README.md"])
def test_smollm2_on_prompt_files(tmp_path, model_cache, ray_tmp, run_here, word_problems, example):
    """Two file jobs for two steps, with relative paths as a user runs them: examples/word-problems.yaml (JSONL in
    the user's own columns, a user's reward file whose extra key reaches the step log), and README.md's own-data job
    exactly as printed (verl's Parquet layout with its nested ground truth, one path for train and eval, the reward
    type following from `function`), the one by `hybridflow run` in a process of its own, the other by its code here
    (run_here). The `math` scorer is covered by tests/rewards/test_reward_scorers.py."""
    if example == "README.md":
        cwd = tmp_path / "repo"
        (cwd / "examples").mkdir(parents=True)
        (cwd / "examples" / "data").symlink_to(word_problems)
        job, ckpt = save_readme_own_data_job(cwd)
    else:
        cwd, ckpt = word_problems, tmp_path / "run"
        reward = ROOT / "examples" / "rewards" / "word_problem_reward.py"
        job = job_variant(tmp_path, ROOT / "examples" / example, data__train=["word_problems/train.jsonl"],
                       data__evalPrompts=8, trainer__steps=2, trainer__promptsPerStep=4,
                       trainer__checkpointDir=str(ckpt), rollout__maxResponseLength=24,
                       models__reward__function={"path": str(reward)})
    if example == "README.md":
        out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=cwd,
                      env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
        assert out.returncode == 0, out.stderr[-3000:]
        printed = out.stdout
    else:
        rc, printed = run_here(job, cwd=cwd)
        assert rc == 0, printed[-3000:]
    # an eval file (README): all 200 rows train; none: 8 of them are held out
    assert f"prompts: {200 if example == 'README.md' else 192} for training, 8 held out" in printed, printed
    records = _steps(ckpt)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["reward_errors"] == 0 for r in records)
    summary = json.loads((ckpt / "summary.json").read_text())
    # SmolLM2 answers some of these greedily (0.25-0.35 on the full held-out sets): the data reached the model
    # through the chat template and the reward read the right ground truth.
    assert summary["eval_before"] > 0 and summary["eval_after"] is not None, summary
    assert any(0 < r["reward_mean"] for r in records), records
    assert list((ckpt / "data-cache").glob("prompts-*.arrow")), "tokenized prompts were not cached"
    if example == "word-problems.yaml":  # `level` reached the function through extra_info
        assert any("reward_product_correct_mean" in r for r in records), records


def test_the_judge_example_scores_with_a_served_smollm2_beside_the_actor(tmp_path, run_here):
    """examples/smollm2-arithmetic-judge.yaml for one step: the judge role's vLLM is built beside the actor's (two
    vLLM engines in one process), the combined reward asks it through the controller, and its costs
    and agreement with the task's rule reach the step log and the progress line."""
    ckpt = tmp_path / "run"
    job = job_variant(tmp_path, ROOT / "examples" / "smollm2-arithmetic-judge.yaml", trainer__steps=1,
                      trainer__promptsPerStep=4, trainer__eval=False, trainer__checkpointDir=str(ckpt))
    rc, printed = run_here(job, cwd=tmp_path)
    assert rc == 0, printed[-3000:]
    assert re.search(r"pool default: actor, rollout, reference, judge", printed), printed[-3000:]
    assert re.search(r"judge \d+\.\d\ds, agrees with the rule \d+%", printed), printed[-3000:]
    (record,) = _steps(ckpt)
    assert 0 < record["judge_requests"] <= 16 and record["judge_tokens_per_s"] > 0, record
    assert record["judge_rule_agreement"] >= 0.5, record  # measured 0.91-0.94 in the example's runs


def test_a_reward_function_that_fails_stops_the_job_naming_the_sample(tmp_path, model_cache, ray_tmp):
    reward = tmp_path / "bad_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    return int(solution_str) / 0\n")
    job = job_variant(tmp_path, ROOT / "examples" / "smollm2-arithmetic-reward.yaml", trainer__steps=1,
                   trainer__promptsPerStep=4, data__evalPrompts=8, trainer__eval=False,
                   trainer__checkpointDir=str(tmp_path / "run"), models__reward__function={"path": str(reward)})
    # plain HF generation: it starts ~10 s sooner than vLLM, and how a reward failure is reported does not depend on it
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp, "--engine", "hf"], cwd=tmp_path,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)}, timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    err = out.stderr
    assert "RewardFailure" in err and f"{reward}:compute_score" in err and "maxErrorFraction" in err, err[-3000:]
    assert "sample 0 (ground truth" in err and ("ValueError" in err or "ZeroDivisionError" in err), err[-3000:]
    assert "bad_reward.py:2" in err, err[-3000:]


def test_failure_exits_non_zero_and_keeps_checkpoints(tmp_path, model_cache, ray_tmp):
    # A path model with a config but broken weights: the job starts, then fails while loading.
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 16}))
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    job = job_variant(tmp_path, TINY, models__actor={"source": "path", "path": str(bad)},
                   trainer__checkpointDir=str(tmp_path / "run"))
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)}, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "error: job failed" in out.stderr and "Traceback" not in out.stderr


def _check_one_mlflow_run(tracking_uri, ckpt, steps):
    """spec.tracking.mlflow across the kill, read back through MLflow's client: one run in the job's experiment,
    FINISHED, the spec as its parameters; the latest point of each step equals the step log (the steps done again
    have a second point: MLflow keeps both)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("tiny-grpo")
    (run,) = client.search_runs([experiment.experiment_id])
    assert json.loads((ckpt / "mlflow-run.json").read_text())["run_id"] == run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny-grpo"
    assert run.data.params["spec.algorithm.name"] == "grpo" and run.data.params["spec.trainer.steps"] == "6"
    latest = {}
    for m in sorted(client.get_metric_history(run.info.run_id, "hybridflow_reward_mean"), key=lambda m: m.timestamp):
        latest[m.step] = m.value
    records = _steps(ckpt)
    assert sorted(latest) == list(range(1, steps + 1)), sorted(latest)
    for rec in records:
        assert latest[rec["step"]] == pytest.approx(rec["reward_mean"], rel=1e-9), rec["step"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "hybridflow_eval_reward_mean/after")] == [steps]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "hybridflow_eval_reward_mean/before")] == [0]
