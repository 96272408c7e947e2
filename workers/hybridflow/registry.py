"""A name -> object table (algorithms, their pieces, tools, environments, roles, reward rules and scorers, heap
allocators), filled by one decorator or `add` per entry (verl's `core_algos` style).

The spec validates names against these tables and the CRD's enums are generated from them, so the modules that fill
them stay importable without torch (the operator image has none): numeric code uses tensor methods only.
"""
from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """`kind` names one entry in messages ("unknown {kind} 'x'"); `plural`, when given, names the list of the
    registered ones ("registered {plural}: ..."), else "registered: ...". Iterating gives the names in the order
    they were registered (as a dict does); `names()` sorts them."""

    def __init__(self, kind: str, plural: str | None = None) -> None:
        self.kind = kind
        self.plural = plural
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

    def unknown(self, name: str) -> str:
        """The message for a name that is not registered: the name and the registered ones."""
        listed = f"registered {self.plural}" if self.plural else "registered"
        return f"unknown {self.kind} '{name}'; {listed}: {', '.join(self.names())}"

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self.unknown(name)) from None

    def info(self, name: str) -> dict[str, Any]:
        self[name]  # the same error for an unknown name
        return self._info[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def items(self) -> list[tuple[str, T]]:
        """(name, entry) in registration order."""
        return list(self._entries.items())

    def names(self) -> list[str]:
        return sorted(self._entries)
