"""Atomic checkpoints, corrupt-checkpoint fallback and step-log rewinding (no models needed)."""
import logging

from hybridflow import checkpoint as ck


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
