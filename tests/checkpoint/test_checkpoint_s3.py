"""Checkpoints, step log and summary on object storage (`trainer.checkpointDir: s3://bucket/prefix`), against a
real S3-compatible server (SeaweedFS, tests/s3_server.py) reached through the AWS_* environment variables only."""
from __future__ import annotations

import json
import os

import pytest
import torch
from support.jobs import run_cli
from support.paths import ROOT

from hybridflow import checkpoint as ck
from hybridflow.api.storage import job_checkpoint_url
from hybridflow.checkpoint import dcp as sc
from hybridflow.checkpoint import steplog, store


def _ident():
    return ck.identity("job", "ns", {"actor": {"source": "tiny", "hidden_size": 8}})


def _write(root, step: int, payload: bytes) -> object:
    with ck.writing(root, step, _ident()) as staging:
        (staging / "actor").mkdir(parents=True, exist_ok=True)
        (staging / "actor" / "__0_0.distcp").write_bytes(payload)
        return ck.seal(root, staging, step, {"data_position": step * 8}, keep=2, ident=_ident())


def test_checkpoints_seal_verify_prune_and_fall_back_on_object_storage(s3_server, monkeypatch):
    s3_server.use(monkeypatch)
    root = ck.storage_path(job_checkpoint_url(f"{s3_server.url}/ckpt", "ns", "job"))
    assert str(root) == f"{s3_server.url}/ckpt/ns/job" and ck.is_remote(root)
    downloaded = []  # hashing an object reads it whole: pruning must not download the kept checkpoints again
    real_sha256 = ck.sha256
    monkeypatch.setattr(store, "sha256", lambda p: downloaded.append(str(p)) or real_sha256(p))
    for step in (2, 4, 6):
        sealed = _write(root, step, bytes([step]) * 1000)
        assert not [p for p in downloaded if f"step_{step:08d}" not in p], downloaded  # only what it seals
        assert sealed.name == f"step_{step:08d}" and ck.verify(sealed) is None
        downloaded.clear()
    assert [c.name for c in ck.list_checkpoints(root)] == ["step_00000004", "step_00000006"]  # keep=2
    assert ck.size_bytes(root / "step_00000006") > 1000
    manifest = json.loads((root / "step_00000006" / ck.MANIFEST).read_text())
    assert "actor/__0_0.distcp" in manifest["files"]

    # An unsealed save (killed before its manifest) and a corrupted newest one are both skipped.
    (root / "step_00000008" / "actor").mkdir(parents=True, exist_ok=True)
    (root / "step_00000008" / "actor" / "__0_0.distcp").write_bytes(b"half")
    (root / "step_00000006" / "actor" / "__0_0.distcp").write_bytes(b"bit rot")
    path, state = ck.latest_good(root)
    assert path.name == "step_00000004" and state["data_position"] == 32
    # issue 24 N3: named as another job's trainer.resumeFrom, it is refused to a job of another namespace from its
    # identity on the store, before any weights are read; a job of its own namespace may resume from it
    models = _ident()["models"]
    ck.check_compatible(path, ck.identity("job-2", "ns", models), other_job_ok=True)
    with pytest.raises(ck.CheckpointError, match=r"spec\.trainer\.resumeFrom: .* of namespace ns, not to this job's "
                                                 r"namespace team-b"):
        ck.check_compatible(path, ck.identity("job-2", "team-b", models), other_job_ok=True)

    # the step log: in parts (here of 3 records), so that a step's write stays small however long the job runs
    monkeypatch.setattr(steplog, "STEP_LOG_PART_RECORDS", 3)
    for step in range(1, 8):
        ck.append_step_log(root, {"step": step})
    assert [p.name for p in steplog._log_parts(root)] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    assert [r["step"] for r in ck.read_step_log(root)] == list(range(1, 8))
    assert ck.rewind_step_log(root, 4) == 3
    assert [r["step"] for r in ck.read_step_log(root)] == [1, 2, 3, 4]
    assert [p.name for p in steplog._log_parts(root)] == ["part-00000.jsonl", "part-00001.jsonl"]
    for step in (5, 6):
        ck.append_step_log(root, {"step": step})
    assert [r["step"] for r in ck.read_step_log(root)] == [1, 2, 3, 4, 5, 6]
    assert ck.rewind_step_log(root, 6) == 0 and ck.rewind_step_log(root, 3) == 3  # back to a part's end
    assert [p.name for p in steplog._log_parts(root)] == ["part-00000.jsonl"]
    for step in range(4, 7):
        ck.append_step_log(root, {"step": step})
    assert [r["step"] for r in ck.read_step_log(root)] == [1, 2, 3, 4, 5, 6]
    assert ck.rewind_step_log(root, 4) == 2

    # steps that go backwards (a `resume: never` run went on with the log): a rewind keeps the order, as locally
    backwards = root / "backwards"
    for s in (1, 2, 3, 4, 5, 1, 2, 3, 4):
        ck.append_step_log(backwards, {"step": s})
    assert ck.rewind_step_log(backwards, 2) == 5
    assert [r["step"] for r in ck.read_step_log(backwards)] == [1, 2, 1, 2]
    _write(root, 6, b"redone")  # the redone step replaces the torn ones after the one resumed from
    assert [c.name for c in ck.list_checkpoints(root)] == ["step_00000004", "step_00000006"]


def test_each_rank_writes_its_shards_to_object_storage_and_loads_them_as_data(s3_server, monkeypatch, one_rank):
    s3_server.use(monkeypatch)
    checkpoint = ck.storage_path(f"{s3_server.url}/run/step_00000001")
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "optimizer": {"param_groups": [{"lr": 0.5}]}}
    digests = sc.save_async(state, checkpoint / "actor", checkpoint).result(timeout=120)
    assert set(digests) == {"actor/.metadata", "actor/__0_0.distcp"}
    assert digests["actor/__0_0.distcp"] == sc.sha256(checkpoint / "actor" / "__0_0.distcp")
    into = {"model": {"w": torch.zeros(3, 4)}, "optimizer": {"param_groups": [{"lr": 0.0}]}}
    sc.load(into, checkpoint / "actor")
    assert torch.equal(into["model"]["w"], state["model"]["w"]) and into["optimizer"]["param_groups"][0]["lr"] == 0.5
    assert torch.equal(sc.read_full(checkpoint / "actor", keys={"model"})["model"]["w"], state["model"]["w"])


@pytest.mark.slow
def test_a_job_checkpoints_logs_and_resumes_on_object_storage(s3_server, tmp_path, model_cache, ray_tmp):
    """`hybridflow run` with an s3:// checkpointDir, asynchronous saves: stopped after 4 steps (as a restart would),
    resumed to 6; the step log, summary and checkpoints are all in the bucket, and the export reads from it.
    Generation is plain HF (`rollout.engine: hf`, whose start is ~10 s sooner than vLLM's): where checkpoints go does
    not depend on the engine, and resumes with vLLM are run in tests/trainer/test_end_to_end.py."""
    import yaml

    url = f"{s3_server.url}/jobs/tiny"
    doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    doc["spec"]["trainer"].update(steps=4, saveFreq=2, asyncSave=True, checkpointDir=url, eval=False)
    doc["spec"]["rollout"]["engine"] = "hf"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    env = {**s3_server.env(), "HYBRIDFLOW_MODEL_CACHE": str(model_cache)}
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path, env_extra=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not any(tmp_path.rglob("steps.jsonl")), "nothing is written locally"

    doc["spec"]["trainer"]["steps"] = 6
    job.write_text(yaml.safe_dump(doc))
    out = run_cli(["run", str(job), "--metrics-port", "0", "--ray-temp-dir", ray_tmp], cwd=tmp_path, env_extra=env)
    assert out.returncode == 0, out.stderr[-3000:]

    for k, v in s3_server.env().items():
        os.environ.setdefault(k, v)  # this process reads the bucket too (the keys are the test server's own)
    root = ck.storage_path(url)
    assert [r["step"] for r in ck.read_step_log(root)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((root / "summary.json").read_text())["start_step"] == 4
    assert [c.name for c in ck.list_checkpoints(root)] == ["step_00000004", "step_00000006"]
    assert all(ck.verify(c) is None for c in ck.list_checkpoints(root))
    assert sorted(p.name for p in (root / "step_00000006" / "actor").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks wrote their own shards

    out = run_cli(["export", url, "--to", str(tmp_path / "hf")], cwd=tmp_path, env_extra=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_refused_credentials_are_a_clear_error_naming_the_field(s3_server, tmp_path):
    """Checked in a fresh process, as a job starts: fsspec caches filesystems with the credentials they were made with."""
    import subprocess
    import sys

    code = ("import sys\nfrom hybridflow import checkpoint as ck\ntry:\n    ck.open_root(sys.argv[1])\n"
            "except ck.CheckpointError as e:\n    print(e)\n")
    for change in ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, {"AWS_ACCESS_KEY_ID": ""}):
        env = {**os.environ, **s3_server.env(), **change}
        out = subprocess.run([sys.executable, "-c", code, f"{s3_server.url}/x"], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.startswith(f"spec.trainer.checkpointDir: cannot use {s3_server.url}/x ("), out
        assert "AWS_SECRET_ACCESS_KEY" in out.stdout and "kubernetes.checkpointSecret" in out.stdout
