"""`hybridflow run` as a user runs it: real Ray, vLLM, FSDP2 on two CPU ranks, real processes and signals."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from conftest import ROOT, kill_processes_mentioning, run_cli, save_readme_own_data_job

from hybridflow.checkpoint import list_checkpoints, read_step_log, verify

pytestmark = pytest.mark.slow

TINY = ROOT / "examples" / "tiny-grpo.yaml"
# Threshold for "clearly learned": greedy held-out reward (fraction of correct continuation tokens) must reach
# 0.6 and gain at least 0.4 over the untrained policy (random guessing scores about 1/15).
LEARNED_MIN, LEARNED_GAIN = 0.6, 0.4


def _steps(ckpt_dir):
    return read_step_log(ckpt_dir)


def _variant(tmp_path, src, **spec_changes):
    doc = yaml.safe_load(src.read_text())
    for dotted, value in spec_changes.items():
        node = doc["spec"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    out = tmp_path / src.name
    out.write_text(yaml.safe_dump(doc))
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tiny_example_learns(tmp_path, model_cache, ray_tmp):
    ckpt = tmp_path / "run"
    t0 = time.time()
    out = run_cli(["run", str(TINY), "--checkpoint-dir", str(ckpt), "--metrics-port", "0", "--ray-temp-dir", ray_tmp],
                  cwd=tmp_path, env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert time.time() - t0 < 600
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
    assert out.stderr.count("\n") < 40, "logs should be quiet by default:\n" + out.stderr[-3000:]


def test_ppo_with_hf_generation(tmp_path, model_cache, ray_tmp):
    ckpt = tmp_path / "run"
    out = run_cli(["run", str(ROOT / "examples" / "tiny-ppo.yaml"), "--engine", "hf", "--steps", "6",
                   "--checkpoint-dir", str(ckpt), "--metrics-port", "0", "--ray-temp-dir", ray_tmp],
                  cwd=tmp_path, env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    records = _steps(ckpt)
    assert len(records) == 6
    for r in records:
        assert r["stages"]["values"] > 0 and r["stages"]["critic_update"] > 0
        assert "critic_vf_loss" in r and "kl_mean" in r
    assert (ckpt / "step_00000006" / "critic" / ".metadata").is_file()  # the critic's own shards


def _kill_session(proc, ray_tmp):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # Ray daemons started by the run must not outlive it; anything left is found by its session dir and ended.
    return kill_processes_mentioning(ray_tmp, grace=20)


def test_kill_9_then_resume_loses_and_repeats_no_step(tmp_path, model_cache, ray_tmp):
    job = _variant(tmp_path, TINY, trainer__steps=12, trainer__saveFreq=3, trainer__promptsPerStep=16,
                   trainer__checkpointDir=str(tmp_path / "run"))
    ckpt = tmp_path / "run"
    port = _free_port()
    env = {**os.environ, "HYBRIDFLOW_MODEL_CACHE": str(model_cache)}
    cmd = [sys.executable, "-m", "hybridflow.cli", "run", str(job), "--metrics-port", str(port),
           "--ray-temp-dir", ray_tmp]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 400
    try:
        while time.time() < deadline and not any(r["step"] >= 7 for r in _steps(ckpt)):
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.2)
        # While it runs, its Prometheus endpoint reports progress.
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'hybridflow_step{rlhfjob="tiny-grpo"}' in body
        assert "hybridflow_throughput_tokens_per_second" in body
    finally:
        leftovers = _kill_session(proc, ray_tmp)
    assert leftovers == 0, f"{leftovers} process(es) outlived the killed run"
    logged = [r["step"] for r in _steps(ckpt)]
    assert max(logged) >= 7
    assert (ckpt / "step_00000006").is_dir()
    # The newest checkpoint gets corrupted too: resume must fall back to step 3 and say so.
    with open(ckpt / "step_00000006" / "actor" / "__1_0.distcp", "r+b") as f:  # rank 1's actor shard
        f.seek(100)
        f.write(b"\x00" * 64)

    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skipping corrupt checkpoint" in out.stderr and "step_00000006" in out.stderr
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["start_step"] == 3 and summary["steps_done"] == 9
    assert [r["step"] for r in _steps(ckpt)] == list(range(1, 13)), "each step exactly once"
    assert "held-out reward before" not in out.stdout  # a resumed job does not pretend to start over


def _staged_step(staging):
    return int(staging.name[len(".step_"):-len(".tmp")])


@pytest.mark.parametrize("async_save", [False, True], ids=["sync-save", "async-save"])
def test_kill_9_during_a_save_loses_nothing_sealed_and_repeats_no_step(tmp_path, model_cache, ray_tmp, async_save):
    """The run is killed while a checkpoint is being written (its staging directory exists): the unsealed one is
    discarded, the job resumes from the newest sealed one, and the step log lists every step exactly once. A wider
    model than the example's makes each write last long enough to be caught in the middle."""
    ckpt = tmp_path / "run"
    job = _variant(tmp_path, TINY, trainer__steps=10, trainer__saveFreq=2, trainer__promptsPerStep=16,
                   trainer__asyncSave=async_save, trainer__checkpointDir=str(ckpt), trainer__eval=False,
                   models__actor__tiny__hiddenSize=256, models__actor__tiny__numLayers=4)
    env = {**os.environ, "HYBRIDFLOW_MODEL_CACHE": str(model_cache)}
    cmd = [sys.executable, "-m", "hybridflow.cli", "run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    writing = None
    deadline = time.time() + 400
    try:
        while time.time() < deadline and writing is None:
            assert proc.poll() is None, "the run ended before it could be killed"
            # a save after the first sealed one, caught while its shards are being written
            staged = [p for p in ckpt.glob(".step_*.tmp") if _staged_step(p) > 2 and any(p.rglob("*.distcp"))]
            writing = staged[0] if staged else None
            time.sleep(0.002)
    finally:
        leftovers = _kill_session(proc, ray_tmp)
    assert writing is not None, "no save was caught in progress"
    assert leftovers == 0, f"{leftovers} process(es) outlived the killed run"
    killed_at = _staged_step(writing)
    sealed = [c for c in list_checkpoints(ckpt) if verify(c) is None]
    assert sealed and all(int(c.name[5:]) < killed_at for c in sealed), (writing, sealed)
    newest = int(sealed[-1].name[5:])
    assert max(r["step"] for r in _steps(ckpt)) >= newest

    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["start_step"] == newest, "the newest sealed checkpoint is the one resumed"
    assert [r["step"] for r in _steps(ckpt)] == list(range(1, 11)), "each step exactly once"
    assert not list(ckpt.glob(".step_*.tmp")), "the torn save is cleaned up"
    assert verify(ckpt / "step_00000010") is None


def test_smollm2_arithmetic_smoke(tmp_path, model_cache, ray_tmp):
    ckpt = tmp_path / "run"
    job = _variant(tmp_path, ROOT / "examples" / "smollm2-arithmetic.yaml", trainer__steps=1,
                   trainer__promptsPerStep=4, data__evalPrompts=8, trainer__checkpointDir=str(ckpt))
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = _steps(ckpt)
    assert 0 < rec["response_length_mean"] <= 12
    assert 0.0 <= rec["reward_mean"] <= 1.0 and rec["grad_norm"] > 0
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["eval_before"] is not None and summary["eval_before"] > 0, "SmolLM2 answers some sums greedily"


def test_smollm2_with_a_users_reward_function(tmp_path, model_cache, ray_tmp):
    """examples/smollm2-arithmetic-reward.yaml for one step: the user's file scores every response in its sandboxed
    workers, and the extra key it returns reaches the step log."""
    ckpt = tmp_path / "run"
    reward = ROOT / "examples" / "rewards" / "arithmetic_reward.py"
    job = _variant(tmp_path, ROOT / "examples" / "smollm2-arithmetic-reward.yaml", trainer__steps=1,
                   trainer__promptsPerStep=4, data__evalPrompts=8, trainer__checkpointDir=str(ckpt),
                   models__reward__function={"path": str(reward)})
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = _steps(ckpt)
    assert rec["reward_errors"] == 0
    assert 0 <= rec["reward_answered_mean"] <= 1
    # the file's rule: 1 right, 0.1 wrong but a number, 0 no number; so the mean reward is bounded by `answered`
    assert rec["reward_mean"] <= rec["reward_answered_mean"] + 1e-6
    assert rec["reward_mean"] >= 0.1 * rec["reward_answered_mean"] - 1e-6


@pytest.mark.parametrize("example", ["word-problems.yaml", "README.md"])
def test_smollm2_on_prompt_files(tmp_path, model_cache, ray_tmp, word_problems, example):
    """Two file jobs for two steps, with relative paths as a user runs them: examples/word-problems.yaml (JSONL in
    the user's own columns, a user's reward file whose extra key reaches the step log), and README.md's own-data job
    exactly as printed (verl's Parquet layout with its nested ground truth, one path for train and eval, the reward
    type following from `function`). The `math` scorer is covered by tests/test_reward_scorers.py."""
    if example == "README.md":
        cwd = tmp_path / "repo"
        (cwd / "examples").mkdir(parents=True)
        (cwd / "examples" / "data").symlink_to(word_problems)
        job, ckpt = save_readme_own_data_job(cwd)
    else:
        cwd, ckpt = word_problems, tmp_path / "run"
        reward = ROOT / "examples" / "rewards" / "word_problem_reward.py"
        job = _variant(tmp_path, ROOT / "examples" / example, data__train=["word_problems/train.jsonl"],
                       data__evalPrompts=8, trainer__steps=2, trainer__promptsPerStep=4,
                       trainer__checkpointDir=str(ckpt), rollout__maxResponseLength=24,
                       models__reward__function={"path": str(reward)})
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=cwd,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    # an eval file (README): all 200 rows train; none: 8 of them are held out
    assert f"prompts: {200 if example == 'README.md' else 192} for training, 8 held out" in out.stdout, out.stdout
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


def test_a_reward_function_that_fails_stops_the_job_naming_the_sample(tmp_path, model_cache, ray_tmp):
    reward = tmp_path / "bad_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                      "    return int(solution_str) / 0\n")
    job = _variant(tmp_path, ROOT / "examples" / "smollm2-arithmetic-reward.yaml", trainer__steps=1,
                   trainer__promptsPerStep=4, data__evalPrompts=8, trainer__eval=False,
                   trainer__checkpointDir=str(tmp_path / "run"), models__reward__function={"path": str(reward)})
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path,
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
    job = _variant(tmp_path, TINY, models__actor={"source": "path", "path": str(bad)},
                   trainer__checkpointDir=str(tmp_path / "run"))
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path,
                  env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)}, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "error: job failed" in out.stderr and "Traceback" not in out.stderr


def test_reward_model_scores_responses(tmp_path, model_cache, ray_tmp):
    ckpt = tmp_path / "run"
    job = _variant(tmp_path, TINY, models__reward={"type": "model", "model": {"source": "tiny",
                   "tiny": {"vocabSize": 16, "hiddenSize": 64, "numHeads": 2, "numKvHeads": 1}}},
                   trainer__steps=2, trainer__checkpointDir=str(ckpt), trainer__eval=False)
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp, "--engine", "hf"],
                  cwd=tmp_path, env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    records = _steps(ckpt)
    assert len(records) == 2
    # A (random) reward model gives real-valued scores; the counting rule can only give multiples of 1/6.
    assert any(abs(r["reward_mean"] * 6 * 256 - round(r["reward_mean"] * 6 * 256)) > 1e-3 for r in records)


def test_driver_joins_an_existing_ray_cluster(tmp_path, model_cache, ray_tmp):
    """What the head pod runs: a Ray head started apart from the driver, then `hybridflow driver --address`."""
    import secrets

    port = _free_port()
    # As in the pods: head, workers and driver share a token (the operator puts it in a Secret).
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.run(
        [ray_bin, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         '--resources={"hybridflow_pool_default": 2}', f"--temp-dir={ray_tmp}", "--include-dashboard=false",
         "--object-store-memory=200000000", "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert head.returncode == 0, head.stderr[-2000:]
    try:
        ckpt = tmp_path / "run"
        job = _variant(tmp_path, TINY, trainer__steps=3, trainer__checkpointDir=str(ckpt), trainer__eval=False)
        out = run_cli(["driver", str(job), "--address", f"127.0.0.1:{port}", "--metrics-port", "0"], cwd=tmp_path,
                      env_extra={"HYBRIDFLOW_MODEL_CACHE": str(model_cache), **env}, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert [r["step"] for r in _steps(ckpt)] == [1, 2, 3]
    finally:
        kill_processes_mentioning(ray_tmp, grace=0)
