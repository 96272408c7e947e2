"""The batch that flows between worker groups: equal-length tensor and non-tensor columns plus free-form meta.

Kept deliberately plain (two dicts and a dict) so that pickling it for Ray costs one pass over the tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {k: _as_object_array(v) for k, v in self.non_tensors.items()}
        sizes = {k: len(v) for k, v in {**self.tensors, **self.non_tensors}.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch columns differ in length: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return len(v)
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> Any:
        return self.tensors[key] if key in self.tensors else self.non_tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def select(self, *keys: str, meta: bool = True) -> "Batch":
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no column(s) {missing}; it has {sorted([*self.tensors, *self.non_tensors])}")
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.non_tensors.items() if k in keys},
            dict(self.meta) if meta else {},
        )

    def index(self, idx: torch.Tensor | np.ndarray | slice) -> "Batch":
        if isinstance(idx, torch.Tensor):
            idx_np = idx.numpy()
        else:
            idx_np = idx
        return Batch(
            {k: v[idx] for k, v in self.tensors.items()},
            {k: v[idx_np] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def chunk(self, n: int) -> list["Batch"]:
        if len(self) % n:
            raise ValueError(f"cannot split a batch of {len(self)} into {n} equal chunks")
        size = len(self) // n
        return [self.index(slice(i * size, (i + 1) * size)) for i in range(n)]

    def split(self, size: int) -> list["Batch"]:
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(parts: Iterable["Batch"]) -> "Batch":
        parts = list(parts)
        if not parts:
            return Batch()
        keys_t, keys_n = parts[0].tensors.keys(), parts[0].non_tensors.keys()
        for p in parts[1:]:
            if p.tensors.keys() != keys_t or p.non_tensors.keys() != keys_n:
                raise ValueError("cannot concat batches with different columns")
        meta: dict[str, Any] = {}
        for p in parts:
            meta.update(p.meta)
        return Batch(
            {k: torch.cat([p.tensors[k] for p in parts]) for k in keys_t},
            {k: np.concatenate([p.non_tensors[k] for p in parts]) for k in keys_n},
            meta,
        )

    def union(self, other: "Batch") -> "Batch":
        """Columns of both; a column present in both must be equal (it is the same data computed twice)."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        tensors = dict(self.tensors)
        for k, v in other.tensors.items():
            if k in tensors and not torch.equal(tensors[k], v):
                raise ValueError(f"union: column '{k}' differs between the batches")
            tensors[k] = v
        non_tensors = dict(self.non_tensors)
        for k, v in other.non_tensors.items():
            if k in non_tensors and not np.array_equal(non_tensors[k], v):
                raise ValueError(f"union: column '{k}' differs between the batches")
            non_tensors[k] = v
        return Batch(tensors, non_tensors, {**self.meta, **other.meta})

    def with_columns(self, **tensors: torch.Tensor) -> "Batch":
        """A copy with these tensor columns added or replaced; the original stays as it was."""
        return Batch({**self.tensors, **tensors}, dict(self.non_tensors), dict(self.meta))

    def repeat(self, n: int, interleave: bool = True) -> "Batch":
        """Each row n times: [a, a, b, b] when interleaved (GRPO groups stay adjacent), else [a, b, a, b]."""
        if interleave:
            t = {k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()}
            nt = {k: np.repeat(v, n, axis=0) for k, v in self.non_tensors.items()}
        else:
            t = {k: v.repeat(n, *([1] * (v.dim() - 1))) for k, v in self.tensors.items()}
            nt = {k: np.tile(v, n) for k, v in self.non_tensors.items()}
        return Batch(t, nt, dict(self.meta))

    def to(self, device: str | torch.device) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.non_tensors), dict(self.meta))


def _as_object_array(v: Any) -> np.ndarray:
    if isinstance(v, np.ndarray):
        return v
    arr = np.empty(len(v), dtype=object)
    arr[:] = list(v)
    return arr
