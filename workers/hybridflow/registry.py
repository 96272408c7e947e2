"""A name -> object table (algorithms, their pieces, tools, environments), filled by one decorator per entry (verl's `core_algos` style).

The spec validates names against these tables and the CRD's enums are generated from them, so the modules that fill
them stay importable without torch (the operator image has none): numeric code uses tensor methods only.
"""
from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._info: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **info: Any) -> Callable[[T], T]:
        """Decorator: `@ESTIMATORS.register("grpo", needs={"groups"})`; `info` is what the spec checks."""
        def deco(obj: T) -> T:
            self.add(name, obj, **info)
            return obj
        return deco

    def add(self, name: str, obj: T, **info: Any) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self._entries[name] = obj
        self._info[name] = info

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} '{name}'; registered: {', '.join(self.names())}") from None

    def info(self, name: str) -> dict[str, Any]:
        self[name]  # the same error for an unknown name
        return self._info[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)
