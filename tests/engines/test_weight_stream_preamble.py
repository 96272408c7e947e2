"""A weight stream's receiver refuses a preamble that announces a bucket header over its cap (issue 51, L6) before it
allocates or receives anything for it, and breaks the stream naming the sender (a group double: no processes)."""
from __future__ import annotations

import pytest
import torch

from hybridflow.engines.bridge import stream
from hybridflow.engines.bridge.stream import MAX_HEADER_BYTES, WeightReceiver, WeightStreamError


class _Done:
    def wait(self, timeout=None):
        return True


class GroupDouble:
    """Rank 1 of 2; every broadcast it is asked for is recorded, the first filled with `preamble`, any other fails
    (it would be the header the test says must never be received)."""

    def __init__(self, preamble: list[int]) -> None:
        self.preamble, self.sizes, self.aborted = preamble, [], False

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 2

    def broadcast(self, tensors, opts):
        (t,) = tensors
        self.sizes.append(t.numel())
        if len(self.sizes) > 1:
            raise AssertionError(f"a {t.numel()}-element broadcast after a refused preamble")
        t.copy_(torch.tensor(self.preamble, dtype=torch.int64))
        return _Done()

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("header_len,nbytes,n", [(MAX_HEADER_BYTES + 1, 8, 1), (1 << 40, 8, 1), (-5, 8, 1),
                                                 (64, -8, 1), (64, 8, -1)])
def test_a_preamble_over_the_header_cap_is_refused_before_anything_is_allocated(header_len, nbytes, n, monkeypatch):
    group = GroupDouble([stream._MAGIC, 3, 0, header_len, nbytes, n])
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(stream.torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    receiver = WeightReceiver(group, src=0, peers=["trainer rank 0", "rollout rank 0"])
    with pytest.raises(WeightStreamError, match="trainer rank 0 announces a .*-byte header .*: refused"):
        list(receiver.receive())
    assert group.sizes == [stream._PREAMBLE] and allocated == []
    assert group.aborted and receiver.broken  # the stream is broken on this rank: a new group before the next sync
