"""The protocol between the driver and a sandboxed worker (a reward, tool or environment worker): one JSON object
per line, each way. JSON, not pickle: the worker runs user code, which can write anything onto the pipe, and the
driver must only ever parse plain data from it (unpickling what user code wrote would run code in the driver).
Standard library only: the workers import it inside the sandbox."""
from __future__ import annotations

import json
import os
import select
import time
from typing import IO, Any

MAX_LINE = 1 << 20  # a reply longer than this is the worker's error, not the driver's memory


class WireError(RuntimeError):
    """The other side closed the pipe, or sent something that is not one JSON object."""


class WireTimeout(WireError):
    """No whole reply before the deadline."""


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (a data set's ground truth) as the Python values they hold; anything else as text."""
    to_list = getattr(value, "tolist", None)
    return to_list() if callable(to_list) else str(value)


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), default=_plain).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    try:
        out = json.loads(line)
    except (ValueError, RecursionError) as err:  # RecursionError: JSON nested deeper than the parser goes
        raise WireError(f"the worker sent something that is not JSON: {type(err).__name__}: {err}") from None
    if not isinstance(out, dict):
        raise WireError(f"the worker sent {type(out).__name__}, not an object")
    return out


def send(stream: IO[bytes], message: dict[str, Any]) -> None:
    stream.write(encode(message))
    stream.flush()


def receive(stream: IO[bytes]) -> dict[str, Any]:
    """The next message, blocking (the worker's side: the driver is always there)."""
    line = stream.readline(MAX_LINE + 1)
    if not line:
        raise WireError("the other side closed the pipe")
    return decode(line)


class LineReader:
    """The driver's side: whole lines from a worker's pipe, each waited for no longer than its deadline, so that
    a worker that hangs (or writes half a line and hangs) costs one deadline."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""
        self._poll = select.poll()  # not select.select: it fails for an fd >= 1024 (a driver holding many)
        self._poll.register(fd, select.POLLIN)

    def receive(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_LINE:
                raise WireError(f"the worker sent a reply over {MAX_LINE} bytes")
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(max(1, int(left * 1000 + 0.999))):
                raise WireTimeout(f"no reply within {timeout:g} s")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise WireError("the worker closed its pipe")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return decode(line)
