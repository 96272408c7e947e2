"""The C heap allocators a pool may ask for by name (spec.resourcePools[].allocator), beside the two keywords
`auto` (the first of AUTO_ORDER the node has, else the C library's) and `system` (the C library's malloc).

A table of facts only, so the spec validates the name and the CRD lists it without torch or ctypes; finding the
library on a machine and preloading it is hybridflow.single_controller.allocator's. Adding one is a `register_allocator`
call here (and its image's apt package)."""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.registry import Registry


@dataclass(frozen=True)
class AllocatorKind:
    name: str
    libraries: tuple[str, ...]  # the library names to find (the first one present wins)
    package: str  # the Debian package that installs them, for the message when none is


ALLOCATORS: Registry[AllocatorKind] = Registry("allocator")
AUTO_ORDER = ("tcmalloc",)  # what "auto" takes, first found first
KEYWORDS = ("auto", "system")  # the settings that name no registered allocator


def register_allocator(kind: AllocatorKind) -> AllocatorKind:
    ALLOCATORS.add(kind.name, kind)
    return kind


register_allocator(AllocatorKind("tcmalloc", ("tcmalloc_minimal", "tcmalloc"), "libtcmalloc-minimal4"))


def allocator_choices() -> list[str]:
    """What spec.resourcePools[].allocator accepts, in the CRD's order: auto, the registered ones, system."""
    return [KEYWORDS[0], *ALLOCATORS.names(), KEYWORDS[1]]


def allocator_setting(value: str) -> str:
    """spec.resourcePools[].allocator checked against the registry (a keyword, or a registered allocator)."""
    if value in KEYWORDS or value in ALLOCATORS:
        return value
    raise ValueError(f"unknown allocator '{value}'; use auto, system or a registered allocator: "
                     f"{', '.join(ALLOCATORS.names())}")
