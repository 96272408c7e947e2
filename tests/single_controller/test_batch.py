"""The batch container and the data-parallel transfer protocol's pure parts."""
import pickle

import numpy as np
import pytest
import torch

from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.protocol import DPRank, collect_dp, split_for_dp, validate_dp_layout
from hybridflow.data.packing import pack_rollout, unpack_prompts, unpack_responses


def _batch(n=6):
    return Batch({"x": torch.arange(n * 2).view(n, 2)}, {"name": [f"r{i}" for i in range(n)]}, {"step": 3})


def test_chunk_concat_round_trip():
    b = _batch()
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and list(back["name"]) == list(b["name"]) and back.meta == {"step": 3}


def test_chunk_refuses_uneven_split():
    with pytest.raises(ValueError, match="6 into 4"):
        _batch().chunk(4)


def test_columns_must_have_equal_length():
    with pytest.raises(ValueError, match="differ in length"):
        Batch({"a": torch.zeros(3)}, {"b": [1, 2]})


def test_union_adds_columns_and_rejects_conflicts():
    b = _batch()
    u = b.union(Batch({"y": torch.ones(6)}))
    assert set(u.tensors) == {"x", "y"}
    with pytest.raises(ValueError, match="'x' differs"):
        b.union(Batch({"x": torch.zeros(6, 2, dtype=torch.long)}))


def test_repeat_interleaved_keeps_groups_adjacent():
    b = Batch({"x": torch.tensor([1, 2])}, {"s": ["a", "b"]})
    r = b.repeat(3)
    assert r["x"].tolist() == [1, 1, 1, 2, 2, 2] and list(r["s"]) == ["a", "a", "a", "b", "b", "b"]
    t = b.repeat(2, interleave=False)
    assert t["x"].tolist() == [1, 2, 1, 2] and list(t["s"]) == ["a", "b", "a", "b"]


def test_select_and_index():
    b = _batch()
    s = b.select("x")
    assert "name" not in s and "x" in s
    with pytest.raises(KeyError, match="nope"):
        b.select("nope")
    assert b.index(torch.tensor([5, 0]))["name"].tolist() == ["r5", "r0"]


def test_pickle_cost_is_close_to_the_raw_tensor_bytes():
    b = Batch({"x": torch.zeros(4096, 256)})
    raw = 4096 * 256 * 4
    assert len(pickle.dumps(b)) < raw * 1.05


def test_dp_split_and_collect_under_a_3d_layout():
    # 4 ranks, TP=2 within each DP rank: ranks 0,1 -> dp 0; ranks 2,3 -> dp 1; only the first of each collects.
    layout = [DPRank(0, 2, True), DPRank(0, 2, False), DPRank(1, 2, True), DPRank(1, 2, False)]
    shards = split_for_dp(_batch(4), layout)
    assert [s["name"].tolist() for s in shards] == [["r0", "r1"], ["r0", "r1"], ["r2", "r3"], ["r2", "r3"]]
    assert collect_dp(["a", "dup", "b", "dup"], layout) == ["a", "b"]


def test_dp_layout_validation():
    assert validate_dp_layout([DPRank(1, 2, True), DPRank(0, 2, True)]) == 2
    with pytest.raises(ValueError, match="exactly one collecting rank"):
        validate_dp_layout([DPRank(0, 2, True), DPRank(0, 2, True)])
    with pytest.raises(ValueError, match="disagree"):
        validate_dp_layout([DPRank(0, 2, True), DPRank(0, 1, True)])


def test_pack_and_unpack_rollout():
    prompts, responses = [[5, 6], [7, 8, 9]], [[1], [2, 3, 4]]
    t = pack_rollout(prompts, responses, prompt_width=4, response_width=3)
    assert t["prompts"].tolist() == [[0, 0, 5, 6], [0, 7, 8, 9]]
    assert t["responses"].tolist() == [[1, 0, 0], [2, 3, 4]]
    assert t["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]]
    b = Batch(t)
    assert unpack_prompts(b) == prompts and unpack_responses(b) == responses
    with pytest.raises(ValueError, match="maxPromptLength=2"):
        pack_rollout([[1, 2, 3]], [[1]], 2, 1)


def test_non_tensor_columns_are_object_arrays():
    b = Batch(non_tensors={"p": [[1, 2], [3]]})
    assert isinstance(b["p"], np.ndarray) and b["p"][1] == [3]
