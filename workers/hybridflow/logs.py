"""What the runtime's logs share: a warning given once per process, so that a fallback taken on every call (an
attention backend without custom masks, a profiler that cannot start) is said once and the logs stay quiet."""
from __future__ import annotations

import logging

_said: set[tuple[str, str]] = set()


def say_once(log: logging.Logger, reason: str) -> None:
    """`reason` as a warning on `log`, the first time this process gives it there."""
    if (log.name, reason) not in _said:
        _said.add((log.name, reason))
        log.warning(reason)
