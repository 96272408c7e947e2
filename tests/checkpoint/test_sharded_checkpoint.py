"""The DCP layer under every role's checkpoint: an asynchronous save writes the state as it was when the save began,
and reading a checkpoint never runs code that its files name."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybridflow.checkpoint import dcp as sc
from hybridflow.checkpoint import CheckpointError
from hybridflow.checkpoint.store import LinkRefused


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), value)},
            "optimizer": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.full((64, 64), -value)}},
                          "param_groups": [{"lr": 0.25, "betas": (0.9, 0.95), "params": ["w"]}]}}


def test_an_async_save_writes_the_state_as_it_was_when_it_began(tmp_path, one_rank):
    state = _state(1.0)
    pending = sc.save_async(state, tmp_path / "actor", tmp_path)
    state["model"]["w"].fill_(7.0)  # training goes on while the copy is written
    state["optimizer"]["state"]["w"]["exp_avg"].fill_(7.0)
    digests = pending.result(timeout=60)
    assert set(digests) == {"actor/.metadata", "actor/__0_0.distcp"}
    assert digests["actor/__0_0.distcp"] == sc.sha256(tmp_path / "actor" / "__0_0.distcp")
    back = sc.read_full(tmp_path / "actor")
    assert torch.equal(back["model"]["w"], torch.full((64, 64), 1.0))
    assert torch.equal(back["optimizer"]["state"]["w"]["exp_avg"], torch.full((64, 64), -1.0))
    assert back["optimizer"]["param_groups"] == [{"lr": 0.25, "betas": (0.9, 0.95), "params": ["w"]}]
    assert set(sc.read_full(tmp_path / "actor", keys={"model"})) == {"model"}  # export reads the weights only


def test_a_sync_save_loads_back_in_place(tmp_path, one_rank):
    digests = sc.save(_state(2.0), tmp_path / "critic", tmp_path)
    assert set(digests) == {"critic/.metadata", "critic/__0_0.distcp"}
    into = _state(0.0)
    sc.load(into, tmp_path / "critic")
    assert torch.equal(into["model"]["w"], torch.full((64, 64), 2.0))
    assert into["optimizer"]["param_groups"][0]["lr"] == 0.25


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_metadata_index_that_names_code_is_refused_and_never_runs(tmp_path, one_rank):
    sc.save(_state(1.0), tmp_path / "actor", tmp_path)
    marker = tmp_path / "pwned"
    (tmp_path / "actor" / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(CheckpointError, match=r"^refusing to load .*actor: its .metadata names (posix|os).system"):
        sc.load(_state(0.0), tmp_path / "actor")
    with pytest.raises(CheckpointError, match="refusing to load"):
        sc.read_full(tmp_path / "actor")
    assert not marker.exists(), "reading a checkpoint ran code from it"


def test_a_value_that_names_code_is_refused_and_never_runs(tmp_path, one_rank):
    marker = tmp_path / "pwned"
    dcp.save({"model": {"w": torch.ones(2)}, "evil": _Exploit(marker)}, checkpoint_id=str(tmp_path / "actor"))
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"refusing to load .*actor: it holds a value .*(posix|os).system"):
        sc.read_full(tmp_path / "actor")
    with pytest.raises(CheckpointError, match="refusing to load"):
        sc.load({"model": {"w": torch.zeros(2)}, "evil": None}, tmp_path / "actor")
    assert not marker.exists(), "reading a checkpoint ran code from it"
    dcp.load(state := {"model": {"w": torch.zeros(2)}, "evil": None}, checkpoint_id=str(tmp_path / "actor"))
    assert marker.exists(), "the file is a real exploit: DCP's own loader runs it"
    assert state["evil"] == 0


def test_a_metadata_index_cannot_change_classes_for_the_whole_process(tmp_path, one_rank):
    """BUILD on a class (here: pathlib.PosixPath.is_file = OrderedDict) would alter every later path check of the
    worker, e.g. the ones that decide which checkpoints are intact and which are pruned."""
    import pathlib

    sc.save(_state(1.0), tmp_path / "actor", tmp_path)
    is_file = pathlib.PosixPath.is_file
    (tmp_path / "actor" / ".metadata").write_bytes(
        b"\x80\x02cpathlib\nPosixPath\nN}X\x07\x00\x00\x00is_fileccollections\nOrderedDict\ns\x86b.")
    with pytest.raises(CheckpointError, match=r"refusing to load .*attributes set on type"):
        sc.load(_state(0.0), tmp_path / "actor")
    assert pathlib.PosixPath.is_file is is_file


def test_a_metadata_index_may_only_point_at_its_own_shard_files(tmp_path, one_rank):
    sc.save(_state(1.0), tmp_path / "other" / "actor", tmp_path / "other")
    sc.save(_state(1.0), tmp_path / "mine" / "actor", tmp_path / "mine")
    index = tmp_path / "mine" / "actor" / ".metadata"
    metadata = pickle.loads(index.read_bytes())  # the test's own file: trusted here
    for info in metadata.storage_data.values():
        info.relative_path = "../../other/actor/__0_0.distcp"  # another job's shards on the same volume
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"points at '../../other/actor/__0_0.distcp', not at a shard file"):
        sc.read_full(tmp_path / "mine" / "actor")


def _rewritten_index(tmp_path, change) -> None:
    """Save a checkpoint, then change its `.metadata` index with `change(metadata)` (the test's own file)."""
    sc.save(_state(1.0), tmp_path / "actor", tmp_path)
    index = tmp_path / "actor" / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    change(metadata)
    index.write_bytes(pickle.dumps(metadata))


def _model_w(metadata):
    return next(m for fqn, m in metadata.state_dict_metadata.items() if fqn.endswith("w") and hasattr(m, "chunks"))


@pytest.mark.parametrize("change,refusal", [
    (lambda m: setattr(_model_w(m), "size", torch.Size([1 << 30, 1 << 30])), "more than its shard files hold"),
    (lambda m: setattr(_model_w(m), "size", torch.Size([-1, 64])), "the shape"),
    (lambda m: setattr(_model_w(m).chunks[0], "sizes", torch.Size([65, 64])), "outside its shape"),
    (lambda m: [setattr(i, "length", 1 << 40) for i in m.storage_data.values()], "which has"),
], ids=["huge-tensor", "negative-dim", "chunk-outside", "slice-past-its-file"])
def test_an_index_claiming_more_than_its_files_hold_is_refused_before_anything_is_allocated(
        tmp_path, one_rank, change, refusal):
    """A crafted index could make the reader allocate a tensor of 2^60 bytes (export reads into an empty state,
    sized from the index) or read past its files: what it claims must fit the shard files on disk."""
    _rewritten_index(tmp_path, change)
    with pytest.raises(CheckpointError, match=f"refusing to load .*actor: its .metadata .*{refusal}"):
        sc.read_full(tmp_path / "actor")
    with pytest.raises(CheckpointError, match=refusal):
        sc.load(_state(0.0), tmp_path / "actor")


def test_an_oversized_or_unreadable_index_is_refused(tmp_path, one_rank, monkeypatch):
    sc.save(_state(1.0), tmp_path / "actor", tmp_path)
    index = tmp_path / "actor" / ".metadata"
    monkeypatch.setattr(sc, "MAX_METADATA_BYTES", index.stat().st_size - 1)  # rather than writing 256 MB
    with pytest.raises(CheckpointError, match=r"its .metadata is over"):
        sc.read_full(tmp_path / "actor")
    monkeypatch.undo()
    index.write_bytes(index.read_bytes()[:40])  # truncated
    with pytest.raises(CheckpointError, match=r"its .metadata is not a readable index"):
        sc.read_full(tmp_path / "actor")


def _fail_to_copy_model_files() -> None:
    raise ValueError("the model files could not be copied")  # not an OSError: e.g. a storage client's own error


def _save_with_one_rank_unable_to_write(rank: int, store: str, root: str, asynchronous: bool, failure: str,
                                        out: str) -> None:
    import json
    import time
    from pathlib import Path

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        checkpoint = Path(root)
        # rank 1's part of the checkpoint cannot be written: its directory's parent is a file, or what it writes
        # besides its shards (rank 0's model files, here done by rank 1) fails
        target = checkpoint / "blocked" / "actor" if rank == 1 and failure == "mkdir" else checkpoint / "actor"
        prepare = _fail_to_copy_model_files if rank == 1 and failure == "prepare" else None
        t0 = time.monotonic()
        try:
            if asynchronous:
                sc.save_async(_state(1.0), target, checkpoint, prepare).result(timeout=300)
            else:
                sc.save(_state(1.0), target, checkpoint, prepare)
            outcome = "saved"
        except Exception as err:  # noqa: BLE001 - what this rank saw is the test's result
            outcome = f"{type(err).__name__}: {err}"
        Path(out).with_suffix(f".{rank}").write_text(json.dumps([outcome, time.monotonic() - t0]))
        # like a role's worker, a rank stays up after its error (exiting would close its connections and wake the
        # others): until every rank has an outcome
        while not all(Path(out).with_suffix(f".{r}").exists() for r in range(2)):
            time.sleep(0.2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("asynchronous, failure", [(False, "mkdir"), (True, "mkdir"), (True, "prepare")],
                         ids=["sync", "async", "async-not-an-oserror"])
def test_a_rank_that_cannot_start_writing_fails_every_rank_at_once(tmp_path, asynchronous, failure):
    """Without an agreement first, the other ranks would wait in DCP's first gather for the missing one until the
    process group's timeout (30 minutes) while the job looks alive; here every rank fails within seconds, and the
    others' error names the rank and keeps its errno (a full disk anywhere reads as a full disk)."""
    import json

    import torch.multiprocessing as mp

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "blocked").write_text("a file where rank 1 wants a directory")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_save_with_one_rank_unable_to_write,
                         args=(r, str(tmp_path / "store"), str(tmp_path / "ckpt"), asynchronous, failure,
                               str(tmp_path / "out")))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=120)
        assert not any(p.is_alive() for p in procs), "a rank is still waiting for the one that could not write"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    outcomes = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    if failure == "mkdir":
        assert outcomes[1][0].startswith(("FileExistsError", "NotADirectoryError")), outcomes
        assert outcomes[0][0].startswith(f"{outcomes[1][0].split(':')[0]}: [Errno ") \
            and "rank 1 could not start writing" in outcomes[0][0], outcomes  # the same OSError subclass and errno
    else:
        assert outcomes[1][0] == "ValueError: the model files could not be copied", outcomes
        assert outcomes[0][0].startswith("CheckpointError: rank 1 could not start writing") \
            and "ValueError: the model files could not be copied" in outcomes[0][0], outcomes
    assert outcomes[0][1] < 60, outcomes


def test_a_sharded_checkpoint_is_loaded_without_following_a_link(tmp_path, one_rank):
    """Issue 51 L2: DCP's reader opens the index and the shards with store.open_tail: a shard replaced by a link
    after the checkpoint was verified is refused when the ranks read it, not read through."""
    state = {"model": {"w": torch.ones(4)}}
    sc.save(state, tmp_path / "step_00000001" / "actor", tmp_path / "step_00000001")
    assert torch.equal(sc.read_full(tmp_path / "step_00000001" / "actor")["model"]["w"], torch.ones(4))
    shard = tmp_path / "step_00000001" / "actor" / "__0_0.distcp"
    shutil.move(shard, tmp_path / "elsewhere.distcp")
    shard.symlink_to(tmp_path / "elsewhere.distcp")
    with pytest.raises(LinkRefused, match="__0_0.distcp is a symbolic link"):
        sc.read_full(tmp_path / "step_00000001" / "actor")
    shard.unlink()
    shutil.move(tmp_path / "elsewhere.distcp", shard)
    index = tmp_path / "step_00000001" / "actor" / sc.METADATA  # the index, read through DCP's file system
    shutil.move(index, tmp_path / "elsewhere.metadata")
    index.symlink_to(tmp_path / "elsewhere.metadata")
    with pytest.raises(LinkRefused, match=r"\.metadata is a symbolic link"):
        sc.load({"model": {"w": torch.zeros(4)}}, tmp_path / "step_00000001" / "actor")
    (tmp_path / "step_00000001" / "actor").rename(tmp_path / "actor-elsewhere")  # the role's directory a link
    (tmp_path / "step_00000001" / "actor").symlink_to(tmp_path / "actor-elsewhere")
    index = tmp_path / "actor-elsewhere" / sc.METADATA
    index.unlink()
    shutil.move(tmp_path / "elsewhere.metadata", index)
    with pytest.raises(LinkRefused, match="step_00000001/actor is a symbolic link"):
        sc.read_full(tmp_path / "step_00000001" / "actor")
