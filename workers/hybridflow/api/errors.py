"""How a manifest problem reaches the user: one exception type, and pydantic's errors rewritten to name each field
in the manifest's own (camelCase, dotted) spelling with what to do."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class SpecError(ValueError):
    """A manifest problem a user can fix; `str()` names the field and what to do."""


def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for x in loc:
        if isinstance(x, int):
            parts[-1:] = [f"{parts[-1]}[{x}]"] if parts else [f"[{x}]"]
        elif x in ("function-after", "function-before") or str(x).startswith("function-"):
            continue
        else:
            parts.append(str(x))
    return ".".join(parts)


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid RLHFJob ({err.error_count()} problem{'s' if err.error_count() > 1 else ''})"]
    for e in err.errors():
        where = _loc(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling (fields are camelCase, see `kubectl explain rlhfjob.spec`)"
        elif e["type"] == "literal_error":
            msg = f"{msg}, got {e.get('input')!r}"
        elif e["type"].endswith("_parsing") or e["type"].endswith("_type"):
            msg = f"{msg}, got {e.get('input')!r}"
        lines.append(f"  {where or '(top level)'}: {msg}")
    return "\n".join(lines)

