"""How a manifest problem reaches the user: one exception type, and pydantic's errors rewritten to name each field
in the manifest's own (camelCase, dotted) spelling with what to do."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class SpecError(ValueError):
    """A manifest problem a user can fix; `str()` names the field and what to do."""


def last_error(log_tail: str) -> str:
    """A driver's error from the tail of its log (the pod's termination message, a local run's log): from the last
    line starting 'error:' to the end, else the last line. The driver prints its errors so (`hybridflow` exits)."""
    lines = [ln.rstrip() for ln in log_tail.strip().splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("error:")]
    picked = lines[starts[-1]:] if starts else lines[-1:]
    return " ".join(ln.strip() for ln in picked).removeprefix("error: ")[:1000]


UNION_TAGS = ("union-roles", "union-auto")  # spec.placement's tags (schema.JobSpec.placement): not the user's keys


def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for x in loc:
        if isinstance(x, int):
            parts[-1:] = [f"{parts[-1]}[{x}]"] if parts else [f"[{x}]"]
        elif str(x).startswith("function-") or x in UNION_TAGS:  # a validator's or a tagged union's own step
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

