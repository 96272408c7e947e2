"""Atomic checkpoints, corrupt-checkpoint fallback, step-log rewinding, whose checkpoint it is, full disks and
hostile files (no models needed)."""
import errno
import json
import logging
import os
import shutil
import sys

import pytest

from hybridflow import checkpoint as ck
from hybridflow.api.storage import job_checkpoint_dir
from hybridflow.checkpoint import checkpointer, sealing, store


def _make(root, step):
    st = ck.staging_dir(root, step)
    (st / "actor.pt").write_bytes(bytes([step]) * 1000)
    return ck.seal(root, st, step, {"data_position": step}, keep=3)


def test_seal_lists_and_verifies(tmp_path):
    for s in (1, 2):
        _make(tmp_path, s)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    path, state = ck.latest_good(tmp_path)
    assert path.name == "step_00000002" and state == {"step": 2, "data_position": 2}
    assert not list(tmp_path.glob(".step_*")), "staging directories must not survive a seal"


def test_corrupt_latest_falls_back_with_a_warning(tmp_path, caplog):
    _make(tmp_path, 1)
    p2 = _make(tmp_path, 2)
    (p2 / "actor.pt").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="hybridflow.checkpoint"):
        path, state = ck.latest_good(tmp_path)
    assert path.name == "step_00000001" and state["step"] == 1
    assert "does not match its checksum" in caplog.text


def test_half_written_checkpoint_is_ignored(tmp_path):
    _make(tmp_path, 1)
    st = ck.staging_dir(tmp_path, 2)  # a crash before seal leaves only a hidden staging dir
    (st / "actor.pt").write_bytes(b"x")
    (tmp_path / "step_00000003").mkdir()  # or a step dir without manifest
    assert ck.latest_good(tmp_path)[0].name == "step_00000001"


def test_pruning_keeps_the_newest(tmp_path):
    for s in range(1, 6):
        _make(tmp_path, s)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004", "step_00000005"]


def test_no_checkpoint(tmp_path):
    assert ck.latest_good(tmp_path) is None
    assert ck.latest_good(tmp_path / "absent") is None


def test_step_log_rewind_and_torn_line(tmp_path):
    for s in range(1, 6):
        ck.append_step_log(tmp_path, {"step": s})
    with open(tmp_path / ck.STEP_LOG, "a") as f:
        f.write('{"step": 6, "trunc')  # torn by kill -9
    assert [r["step"] for r in ck.read_step_log(tmp_path)] == [1, 2, 3, 4, 5]
    assert ck.rewind_step_log(tmp_path, 3) == 2
    assert [r["step"] for r in ck.read_step_log(tmp_path)] == [1, 2, 3]


# --- whose checkpoint: per-job directories, identity checks on resume and save --------------------------------

def _ident(job="job-a", hidden=64, namespace="team"):
    from hybridflow.api import ModelSource

    src = ModelSource(tiny={"hidden_size": hidden})
    return ck.identity(job, namespace, {"actor": ck.model_architecture(src)})


def _make_for(root, step, ident, keep=3):
    st = ck.staging_dir(root, step)
    (st / "actor.pt").write_bytes(bytes([step]) * 1000)
    return ck.seal(root, st, step, {"data_position": step}, keep=keep, ident=ident)


def test_job_checkpoint_dir_is_one_directory_per_job():
    root = "/var/lib/hybridflow/checkpoints"
    assert job_checkpoint_dir(root, "team", "job-a") == f"{root}/team/job-a"
    assert job_checkpoint_dir(root, None, "job-a") == f"{root}/job-a"
    assert job_checkpoint_dir(root, "team", "job-b") != job_checkpoint_dir(root, "team", "job-a")
    assert job_checkpoint_dir(root, "other", "job-a") != job_checkpoint_dir(root, "team", "job-a")
    for bad in ("..", "", "a/b"):
        with pytest.raises(ValueError):
            job_checkpoint_dir(root, "team", bad)


def test_identity_is_recorded_and_restore_refuses_another_job(tmp_path):
    ckpt = _make_for(tmp_path, 1, _ident("job-a"))
    assert ck.read_identity(ckpt)["job"] == "job-a"
    ck.check_compatible(ckpt, _ident("job-a"))  # its own job resumes
    with pytest.raises(ck.CheckpointError) as err:
        ck.check_compatible(ckpt, _ident("job-b"))
    msg = str(err.value)
    assert str(ckpt) in msg and "team/job-a" in msg and "team/job-b" in msg and "spec.trainer.checkpointDir" in msg


def test_resume_from_takes_another_job_of_the_namespace_never_another_namespaces(tmp_path):
    """Issue 24 N3: trainer.resumeFrom (other_job_ok) opens another job's checkpoint to this one, but only within
    its namespace (the tenant); the check comes before any weights are read (checkpointer.restore)."""
    ckpt = _make_for(tmp_path, 1, _ident("job-a", namespace="team-b"))
    ck.check_compatible(ckpt, _ident("job-c", namespace="team-b"), other_job_ok=True)  # same namespace: resumes
    for job in ("job-c", "job-a"):  # another namespace's job of any name
        with pytest.raises(ck.CheckpointError) as err:
            ck.check_compatible(ckpt, _ident(job, namespace="team-a"), other_job_ok=True)
        msg = str(err.value)
        assert msg.startswith("spec.trainer.resumeFrom: ") and str(ckpt) in msg, msg
        assert "of namespace team-b, not to this job's namespace team-a" in msg, msg
    ck.check_compatible(ckpt, _ident("job-c", namespace=None), other_job_ok=True)  # `hybridflow run`: no namespace


def test_restore_refuses_an_incompatible_model(tmp_path):
    ckpt = _make_for(tmp_path, 1, _ident(hidden=64))
    with pytest.raises(ck.CheckpointError) as err:
        ck.check_compatible(ckpt, _ident(hidden=128))
    msg = str(err.value)
    assert str(ckpt) in msg and "hidden_size 64 there, 128 here" in msg
    assert "spec.trainer.checkpointDir" in msg and "spec.trainer.resume: never" in msg


def test_a_lora_checkpoint_resumes_only_a_job_training_the_same_adapters(tmp_path):
    """The adapters' settings are part of the actor's identity (checkpointer.checkpoint_identity): a LoRA checkpoint
    holds no base weights, so a full fine-tune (or another rank) resuming from it is refused before any read."""
    from types import SimpleNamespace

    from hybridflow.api import parse_job

    def ident(lora):
        training = {"lora": lora} if lora else {}
        job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "job-a"},
                         "spec": {"training": training}})
        return checkpointer.checkpoint_identity(job, SimpleNamespace(roles={"actor": None}))

    ckpt = _make_for(tmp_path, 1, ident({"rank": 8}))
    ck.check_compatible(ckpt, ident({"rank": 8}))
    for other in (None, {"rank": 16}):
        with pytest.raises(ck.CheckpointError, match="actor: lora"):
            ck.check_compatible(ckpt, ident(other))


def test_model_architecture_is_shapes_not_dtype(tmp_path):
    from hybridflow.api import ModelSource

    arch = ck.model_architecture
    assert arch(ModelSource(dtype="bfloat16")) == arch(ModelSource(dtype="float32"))  # load_state_dict casts
    assert arch(ModelSource(tiny={"num_layers": 3})) != arch(ModelSource())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 576, "rope_theta": 1.0}))
    assert arch(ModelSource(source="path", path=str(tmp_path))) == {"source": "path", "model_type": "llama",
                                                                     "hidden_size": 576}


def test_old_checkpoint_without_identity_is_accepted_with_a_warning(tmp_path, caplog):
    ckpt = _make(tmp_path, 1)  # written without identity, as before
    with caplog.at_level(logging.WARNING, logger="hybridflow.checkpoint"):
        ck.check_compatible(ckpt, _ident())
    assert "records no model" in caplog.text
    st = ck.staging_dir(tmp_path, 2)  # older versions named the job in the trainer state: still checked
    old = ck.seal(tmp_path, st, 2, {"data_position": 2, "job": "job-b"}, keep=3)
    with pytest.raises(ck.CheckpointError, match="job-b"):
        ck.check_compatible(old, _ident("job-a"))


def test_loop_restore_refuses_before_loading_weights(tmp_path):
    from types import SimpleNamespace

    from hybridflow.api import RLHFJob

    _make_for(tmp_path, 1, _ident("job-a"))
    loaded = []
    actor = SimpleNamespace(load_checkpoint=loaded.append)
    w = SimpleNamespace(roles={"actor": actor}, sync_weights=lambda version: {})
    other, root = RLHFJob(metadata={"name": "job-b", "namespace": "team"}), ck.CheckpointRoot(tmp_path)
    with pytest.raises(ck.CheckpointError, match="belongs to job 'team/job-a'"):
        checkpointer.restore(w, root, SimpleNamespace(load=lambda s: None), job=other)
    assert loaded == []
    own = RLHFJob(metadata={"name": "job-a", "namespace": "team"})
    assert checkpointer.restore(w, root, SimpleNamespace(load=lambda s: None), job=own) == (1, 1)
    assert loaded == [str(tmp_path / "step_00000001")]


def test_resume_from_is_used_only_without_own_checkpoints_and_a_wrong_one_is_bad_input(tmp_path):
    """trainer.resumeFrom names another job's checkpointDir or one step_* of it. A job uses it only while it has no
    checkpoint of its own (a restart continues from its own). One that names nothing is bad input (exit 2, which
    the operator does not retry), found before Ray starts when it is a path that does not exist."""
    from hybridflow.api import RLHFJob, SpecError
    from hybridflow.trainer.preflight import check_runtime_paths

    old, own = tmp_path / "old-job", tmp_path / "new-job"
    _make_for(old, 3, _ident("old-job"))
    _make_for(old, 6, _ident("old-job"))
    own_root = ck.CheckpointRoot(own)

    def job(resume_from):
        return RLHFJob(metadata={"name": "new-job", "namespace": "team"},
                       spec={"trainer": {"checkpointDir": str(own), "resumeFrom": resume_from}})

    path, state, other = checkpointer.resume_point(job(str(old)), own_root)
    assert (path.name, state["step"], other) == ("step_00000006", 6, True)  # the old job's newest
    path, _, other = checkpointer.resume_point(job(str(old / "step_00000003")), own_root)
    assert (path.name, other) == ("step_00000003", True)
    for missing in (tmp_path / "no-such-job", old / "step_00000009", old / "actor.pt"):
        with pytest.raises(SpecError, match=r"^spec.trainer.resumeFrom: .* holds no checkpoint; name the old job"):
            checkpointer.resume_point(job(str(missing)), own_root)
    for missing in (tmp_path / "no-such-job", old / "step_00000009"):
        assert [p for p in check_runtime_paths(job(str(missing))) if "spec.trainer.resumeFrom" in p
                and "does not exist" in p]
    # one that is there but cannot be read intact: a failure (retried: it may be the storage, for now), not input
    (old / "step_00000006" / "actor.pt").write_bytes(b"torn")
    with pytest.raises(ck.CheckpointError, match=r"step_00000006 is not an intact checkpoint"):
        checkpointer.resume_point(job(str(old / "step_00000006")), own_root)
    assert checkpointer.resume_point(job(str(old)), own_root)[0].name == "step_00000003"  # the newest intact one

    _make_for(own, 9, _ident("new-job"))  # once the job has its own, resumeFrom no longer matters
    path, _, other = checkpointer.resume_point(job(str(tmp_path / "no-such-job")), own_root)
    assert (path.name, other) == ("step_00000009", False)
    assert not check_runtime_paths(job(str(tmp_path / "no-such-job")))


def test_save_refuses_a_directory_of_another_job_and_leaves_it_alone(tmp_path):
    theirs = _make_for(tmp_path, 5, _ident("job-a"))
    with pytest.raises(ck.CheckpointError, match="holds checkpoints of job 'team/job-a'"):
        with ck.writing(tmp_path, 1, _ident("job-b")):
            raise AssertionError("nothing may be written")
    assert ck.list_checkpoints(tmp_path) == [theirs] and ck.verify(theirs) is None
    assert not list(tmp_path.glob(".step_*"))
    _make_for(tmp_path, 1, _ident("job-b"), keep=1)  # even a direct seal never prunes another job's checkpoint
    assert theirs.is_dir()


# --- pruning counts only intact checkpoints ----------------------------------------------------------------------

def test_pruning_never_counts_corrupt_checkpoints(tmp_path):
    ident = _ident()
    _make_for(tmp_path, 1, ident, keep=2)
    p2 = _make_for(tmp_path, 2, ident, keep=2)
    (p2 / "actor.pt").write_bytes(b"bit rot")
    (tmp_path / "step_00000003").mkdir()  # half-written, no manifest
    _make_for(tmp_path, 4, ident, keep=2)
    names = [p.name for p in ck.list_checkpoints(tmp_path)]
    assert names == ["step_00000001", "step_00000004"], "the corrupt ones must not push out the last good one"


class _ReadsOf:
    """The checkpoint shard files (actor.pt) this process opens for reading while the block runs, by the name of
    the directory holding them, as Python's `open` audit event reports them: what a save reads, however it
    reads it."""

    active: "_ReadsOf | None" = None

    def __init__(self, root):
        self.root, self.dirs = str(root), []

    def __enter__(self):
        _ReadsOf.active = self
        return self.dirs

    def __exit__(self, *_):
        _ReadsOf.active = None


def _audit(event, args):
    reads = _ReadsOf.active
    if reads is None or event != "open" or not isinstance(args[0], (str, os.PathLike)):
        return
    path, mode = os.fspath(args[0]), str(args[1] or "r")
    if path.startswith(reads.root) and path.endswith("actor.pt") and not set(mode) & set("wax+"):
        reads.dirs.append(os.path.basename(os.path.dirname(path)))


sys.addaudithook(_audit)  # audit hooks stay for the process; it records only inside a `_ReadsOf` block

_SAVE_IN_A_NEW_PROCESS = """
import json, os, sys
from hybridflow import checkpoint as ck
from hybridflow.api import ModelSource
root, step = sys.argv[1], int(sys.argv[2])
read = []
def audit(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and os.fspath(args[0]).endswith("actor.pt") \
            and not set(str(args[1] or "r")) & set("wax+"):
        read.append(os.path.basename(os.path.dirname(os.fspath(args[0]))))
sys.addaudithook(audit)
ident = ck.identity("job-a", "team", {"actor": ck.model_architecture(ModelSource(tiny={"hidden_size": 64}))})
st = ck.staging_dir(ck.storage_path(root), step)
(st / "actor.pt").write_bytes(bytes([step]) * 1000)
ck.seal(ck.storage_path(root), st, step, {"data_position": step}, keep=3, ident=ident)
print(json.dumps(read))
"""


def test_pruning_does_not_hash_the_kept_checkpoints_again_at_every_save(tmp_path):
    """Each save prunes, and pruning counts only intact checkpoints; a checkpoint this process sealed or verified is
    not read again while its files are unchanged (with big checkpoints, or on object storage, re-hashing the kept
    ones at every save would read or download them all). Another process (a restarted job) reads each once. Files
    read are seen through Python's `open` audit event, whatever function reads them."""
    import subprocess

    ident = _ident()
    with _ReadsOf(tmp_path) as read:
        for step in range(1, 6):
            _make_for(tmp_path, step, ident, keep=3)
    # only each save's own new files, while it was being sealed (its staging directory)
    assert set(read) == {f".step_{s:08d}.tmp" for s in range(1, 6)}, read
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004", "step_00000005"]

    restarted = subprocess.run([sys.executable, "-c", _SAVE_IN_A_NEW_PROCESS, str(tmp_path), "6"],
                               capture_output=True, text=True, timeout=120)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    read = json.loads(restarted.stdout.strip().splitlines()[-1])
    assert sorted(set(read) - {".step_00000006.tmp"}) == ["step_00000004", "step_00000005"], read
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005", "step_00000006"]

    (tmp_path / "step_00000005" / "actor.pt").write_bytes(b"rewritten")  # a file changed since: read, and refused
    with _ReadsOf(tmp_path) as read:
        _make_for(tmp_path, 7, ident, keep=3)
    assert "step_00000005" in read and "step_00000004" not in read, read
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000004", "step_00000006", "step_00000007"]
    shard = tmp_path / "step_00000006" / "actor.pt"  # sealed by the other process: this one read it once, above
    shard.write_bytes(bytes([99]) * shard.stat().st_size)  # the same size, other bytes: read again, and refused
    with _ReadsOf(tmp_path) as read:
        _make_for(tmp_path, 8, ident, keep=3)
    assert "step_00000006" in read and "step_00000007" not in read, read
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000004", "step_00000007", "step_00000008"]


def test_seal_makes_the_role_directories_durable_before_the_rename(tmp_path, monkeypatch):
    """The ranks fsync the shards they write, but a shard's name is durable only once `<role>/` is fsync'd; that
    happens at the seal, before the rename makes the checkpoint count."""
    synced = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    renamed_at = []
    monkeypatch.setattr(os, "replace", lambda a, b: renamed_at.append((str(b), len(synced))) or real_replace(a, b))
    st = ck.staging_dir(tmp_path, 1)
    (st / "actor").mkdir()
    (st / "actor" / "__0_0.distcp").write_bytes(b"shard")  # what a rank wrote (and fsync'd), with its digest
    shard_digest = ck.sha256(st / "actor" / "__0_0.distcp")
    final = ck.seal(tmp_path, st, 1, {}, keep=1, digests={"actor/__0_0.distcp": shard_digest})
    sealed_at = next(n for target, n in renamed_at if target == str(final))
    assert {str(st / "actor"), str(st)} <= set(synced[:sealed_at]), synced
    assert ck.verify(final) is None


def test_a_fresh_run_replaces_later_and_other_model_checkpoints(tmp_path):
    """resume: never in a directory of this job: a checkpoint of its old model, and a later one of its old run,
    neither count nor stay (else a later `resume: auto` would pick up the abandoned run)."""
    _make_for(tmp_path, 1, _ident(hidden=64), keep=3)
    _make_for(tmp_path, 9, _ident(hidden=128), keep=3)
    _make_for(tmp_path, 2, _ident(hidden=128), keep=3)
    _make_for(tmp_path, 3, _ident(hidden=128), keep=3)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert ck.latest_good(tmp_path)[0].name == "step_00000003"


# --- a full disk keeps the previous checkpoints -------------------------------------------------------------------

def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_while_a_role_writes_keeps_the_previous_checkpoint(tmp_path):
    ident = _ident()
    prev = _make_for(tmp_path, 2, ident)
    with pytest.raises(ck.CheckpointError) as err:
        with ck.writing(tmp_path, 3, ident) as st:
            (st / "actor.pt.tmp").write_bytes(b"half")
            _enospc()
    msg = str(err.value)
    assert "no space left on device" in msg and "step 3" in msg and str(tmp_path) in msg
    assert "step_00000002 is kept" in msg
    assert isinstance(err.value.__cause__, OSError)
    assert ck.list_checkpoints(tmp_path) == [prev] and ck.verify(prev) is None
    assert not list(tmp_path.glob(".step_*")), "the partial checkpoint must be removed"


def test_full_disk_while_sealing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ident = _ident()
    prev = _make_for(tmp_path, 2, ident)
    monkeypatch.setattr(store, "write_json", _enospc)  # the trainer state or manifest write hits ENOSPC
    with pytest.raises(ck.CheckpointError, match="no space left on device while saving checkpoint step 3"):
        with ck.writing(tmp_path, 3, ident) as st:
            (st / "actor.pt").write_bytes(b"x" * 100)
            ck.seal(tmp_path, st, 3, {}, keep=1, ident=ident)
    assert ck.list_checkpoints(tmp_path) == [prev] and ck.verify(prev) is None
    assert not list(tmp_path.glob(".step_*"))


def test_full_disk_in_a_worker_is_recognised_through_rays_wrapping(tmp_path):
    from ray import exceptions
    remote = exceptions.RayTaskError("save_checkpoint", "traceback", OSError(errno.ENOSPC, "No space left on "
                                     "device")).as_instanceof_cause()
    with pytest.raises(ck.CheckpointError, match="no space left on device"):
        with ck.writing(tmp_path, 1, _ident()):
            raise remote
    with pytest.raises(ValueError):  # anything else passes through unchanged (and still cleans up)
        with ck.writing(tmp_path, 1, _ident()):
            raise ValueError("not a disk problem")
    assert not list(tmp_path.glob(".step_*"))


def test_a_rank_that_stops_answering_mid_save_is_not_taken_for_the_disk(tmp_path):
    """A save whose rank stopped (SIGSTOP, a hung node) ends in a RankFailure over Ray's GetTimeoutError, and a
    TimeoutError is an OSError: the failure passes as the rank's (recovery names it), not as a disk's."""
    from ray import exceptions

    from hybridflow.single_controller.failures import RankFailure

    timeout = exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")
    failure = RankFailure("actor.save_checkpoint", [], ["pool default rank 1 (10.0.0.2)"], [], timeout)
    with pytest.raises(RankFailure, match="pool default rank 1 .* did not answer"):
        with ck.writing(tmp_path, 1, _ident()):
            raise failure from timeout
    assert not list(tmp_path.glob(".step_*"))


def test_a_full_disk_that_torch_reports_as_an_iostream_error_is_named(tmp_path, monkeypatch):
    """torch.save on a full volume raises RuntimeError('... iostream error'), not ENOSPC (seen on a real full disk):
    with the volume nearly out of space at that moment, the failure is still reported as a full disk."""
    prev = _make_for(tmp_path, 2, _ident())
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(sealing.shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(ck.CheckpointError, match="no space left on device while saving checkpoint step 3") as err:
        with ck.writing(tmp_path, 3, _ident()):
            raise RuntimeError("basic_ios::clear: iostream error")
    assert "step_00000002 is kept" in str(err.value) and ck.verify(prev) is None
    monkeypatch.setattr(sealing.shutil, "disk_usage", lambda p: usage._replace(free=100 << 30))
    with pytest.raises(RuntimeError, match="iostream error"):  # with space to spare it is not a disk problem
        with ck.writing(tmp_path, 3, _ident()):
            raise RuntimeError("basic_ios::clear: iostream error")


# --- no pickle from shared storage --------------------------------------------------------------------------------

class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path):
    import torch

    from hybridflow.checkpoint.role import CheckpointMixin

    marker = tmp_path / "pwned"
    st = ck.staging_dir(tmp_path, 1)
    torch.save({"model": _Exploit(marker)}, st / "actor.pt")
    ckpt = ck.seal(tmp_path, st, 1, {"data_position": 0}, keep=2, ident=_ident())
    assert ck.verify(ckpt) is None  # the digests match: only the loader can stop it
    with pytest.raises(ck.CheckpointError, match="refusing to load .*actor.pt"):
        ck.load_tensors(ckpt / "actor.pt")
    role = type("Role", (CheckpointMixin,), {"checkpoint_name": "actor"})()
    with pytest.raises(ck.CheckpointError):
        role.load_checkpoint(str(ckpt))
    assert not marker.exists(), "loading a checkpoint ran code from it"
    torch.load(ckpt / "actor.pt", weights_only=False)  # the file is a real exploit: a full unpickle runs it
    assert marker.exists()


def test_model_and_optimizer_state_load_as_plain_data(tmp_path):
    import torch

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "optimizer_tp": [opt.state_dict()],
                "tensor_parallel": 1}, tmp_path / "actor.pt")
    state = ck.load_tensors(tmp_path / "actor.pt")
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_redoing_a_step_replaces_it_without_leftovers(tmp_path):
    _make_for(tmp_path, 2, _ident())
    st = ck.staging_dir(tmp_path, 2)  # step 2 again, after a fallback to step 1
    (st / "actor.pt").write_bytes(b"new")
    ck.seal(tmp_path, st, 2, {"data_position": 2}, keep=3, ident=_ident())
    assert (tmp_path / "step_00000002" / "actor.pt").read_bytes() == b"new"
    assert ck.verify(tmp_path / "step_00000002") is None and not list(tmp_path.glob(".step_*"))


def test_a_step_sealed_but_not_yet_logged_gets_its_record_back_on_resume(tmp_path):
    """kill -9 between a checkpoint's seal and its step's log line: the job resumes after that step, so without the
    record the checkpoint carries, the log would lack it forever."""
    from types import SimpleNamespace


    for step in (1, 2):
        ck.append_step_log(tmp_path, {"step": step, "reward_mean": 0.1 * step})
    st = ck.staging_dir(tmp_path, 3)
    (st / "actor.pt").write_bytes(b"w")
    record = {"step": 3, "reward_mean": 0.3, "stages": {"generate": 1.0}}
    sealed = ck.seal(tmp_path, st, 3, {"data_position": 3, "step_record": record}, keep=3)
    actor = SimpleNamespace(load_checkpoint=lambda d: None)
    w = SimpleNamespace(roles={"actor": actor}, sync_weights=lambda version: {})
    root = ck.CheckpointRoot(tmp_path)
    assert checkpointer.restore(w, root, SimpleNamespace(load=lambda s: None)) == (3, 3)
    logged = ck.read_step_log(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert logged[-1] == {**record, "checkpoint": str(sealed)}
    assert checkpointer.restore(w, root, SimpleNamespace(load=lambda s: None)) == (3, 3)  # a second adds nothing
    assert [r["step"] for r in ck.read_step_log(tmp_path)] == [1, 2, 3]


def test_the_checkpointers_cadence_is_a_pure_decision_every_save_freq_steps_and_the_last(tmp_path):
    """`fit` asks the checkpointer after every step; whether the step is saved depends on the step alone."""
    from types import SimpleNamespace

    from hybridflow.api import RLHFJob

    def cadence(save_freq: int) -> list[int]:
        job = RLHFJob(metadata={"name": "job-a"},
                      spec={"trainer": {"checkpointDir": str(tmp_path), "steps": 7, "saveFreq": save_freq}})
        c = checkpointer.Checkpointer(job, SimpleNamespace(roles={}), SimpleNamespace(state=dict, load=print))
        return [step for step in range(1, 8) if c.after_step(step)]

    assert cadence(3) == [3, 6, 7] and cadence(7) == [7] and cadence(0) == [7] and cadence(1) == list(range(1, 8))
    assert not ck.list_checkpoints(tmp_path)  # deciding writes nothing


# --- issue 51 L2: step directories and their files are never opened through a symbolic link ------------------------

def test_a_step_directory_that_is_a_link_is_refused_naming_it(tmp_path, caplog):
    """A `step_N` planted as a link in a job's directory (or in the directory of the job a resumeFrom names) could
    make the job read another job's checkpoint, another namespace's, or a path of the node: never followed. Named
    as resumeFrom it is refused, naming it; in a checkpointDir it is skipped with a warning naming it, the newest
    real checkpoint is used, and pruning removes the link itself, never what it points to."""
    from hybridflow.api import RLHFJob

    victim = tmp_path / "other-team" / "their-job"
    theirs = _make_for(victim, 9, _ident("their-job", namespace="other-team"))
    old, own = tmp_path / "team" / "old-job", tmp_path / "team" / "new-job"
    own_root = ck.CheckpointRoot(own)
    _make_for(old, 3, _ident("old-job"))
    (old / "step_00000009").symlink_to(theirs)  # planted by whoever may write the old job's directory

    job = RLHFJob(metadata={"name": "new-job", "namespace": "team"},
                  spec={"trainer": {"checkpointDir": str(own), "resumeFrom": str(old / "step_00000009")}})
    with pytest.raises(ck.CheckpointError) as err:
        checkpointer.resume_point(job, own_root)
    assert str(err.value).startswith(f"spec.trainer.resumeFrom: {old / 'step_00000009'} is a symbolic link (to "
                                     f"'{theirs}')"), err.value
    assert "never opened through a link" in str(err.value)
    with pytest.raises(ck.CheckpointError, match=r"step_00000009 is a symbolic link \(to '"):
        ck.checkpoint_at(old / "step_00000009")
    with caplog.at_level(logging.WARNING, logger="hybridflow.checkpoint"):
        path, state = ck.latest_good(old)  # the old job's directory: its newest real checkpoint
    assert (path.name, state["step"]) == ("step_00000003", 3)
    assert f"{old / 'step_00000009'} is a symbolic link" in caplog.text
    job.spec.trainer.resume_from = str(old)
    assert checkpointer.resume_point(job, own_root)[0] == old / "step_00000003"
    assert "is a symbolic link" in ck.verify(old / "step_00000009")
    # in the job's own directory, pruning at its next save removes the link, and the target stays whole
    _make_for(old, 4, _ident("old-job"))
    assert not os.path.lexists(old / "step_00000009") and ck.verify(theirs) is None
    assert [p.name for p in ck.list_checkpoints(old)] == ["step_00000003", "step_00000004"]


@pytest.mark.parametrize("planted", ["file", "directory"])
def test_a_link_inside_a_checkpoint_is_refused_and_never_read(tmp_path, planted):
    """A checkpoint holding a link (a shard, or the role's directory, linked to a path of the node or another job's
    files) is not intact, whatever the link's target holds; the files are read with O_NOFOLLOW from the directory
    above each, so a link swapped in after the check is refused when read, too."""
    secret = tmp_path / "node" / "secret"
    secret.parent.mkdir()
    st = ck.staging_dir(tmp_path / "ck", 1)
    (st / "actor").mkdir()
    (st / "actor" / "__0_0.distcp").write_bytes(b"weights")
    ckpt = ck.seal(tmp_path / "ck", st, 1, {"data_position": 1}, keep=2)
    assert ck.verify(ckpt) is None
    if planted == "file":  # the link's target holds the very bytes sealed: the digest alone would pass it
        secret.write_bytes(b"weights")
        (ckpt / "actor" / "__0_0.distcp").unlink()
        (ckpt / "actor" / "__0_0.distcp").symlink_to(secret)
        link = ckpt / "actor" / "__0_0.distcp"
    else:
        shutil.copytree(ckpt / "actor", tmp_path / "node" / "actor")
        shutil.rmtree(ckpt / "actor")
        (ckpt / "actor").symlink_to(tmp_path / "node" / "actor")
        link = ckpt / "actor"
    problem = ck.verify(ckpt)
    assert problem is not None and problem.startswith(f"{link} is a symbolic link"), problem
    with pytest.raises(store.LinkRefused, match=f"^{link} is a symbolic link"):
        store.open_in(ckpt, "actor/__0_0.distcp").close()
    with pytest.raises(store.LinkRefused, match=f"^{link} is a symbolic link"):
        store.open_tail(ckpt / "actor" / "__0_0.distcp", 3).close()
    with pytest.raises(ck.CheckpointError, match="is not an intact checkpoint"):
        ck.checkpoint_at(ckpt)
    assert ck.latest_good(tmp_path / "ck") is None


def test_files_are_opened_below_their_directory_without_following_links(tmp_path):
    """store.open_below: a regular file is read; a link at any component, a FIFO (which would hang the reader) and
    a path that climbs are refused."""
    (tmp_path / "step_00000001" / "actor").mkdir(parents=True)
    (tmp_path / "step_00000001" / "actor" / "f").write_bytes(b"x")
    with store.open_below(tmp_path, "step_00000001/actor/f") as f:
        assert f.read() == b"x"
    os.mkfifo(tmp_path / "step_00000001" / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        store.open_below(tmp_path, "step_00000001/fifo")
    for bad in ("../x", "/etc/passwd", ""):
        with pytest.raises(ValueError):
            store.open_below(tmp_path, bad)
    (tmp_path / "step_00000002").symlink_to(tmp_path / "step_00000001")
    with pytest.raises(store.LinkRefused, match="step_00000002 is a symbolic link"):
        store.open_below(tmp_path, "step_00000002/actor/f")
    assert store.links_in(tmp_path / "step_00000002") == [tmp_path / "step_00000002"]
    assert store.links_in(tmp_path / "step_00000001") == []

