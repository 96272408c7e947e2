"""One tool call, inside its own sandbox (`python -m hybridflow.agents.tool_worker`): reads the call (the tool's code
and its arguments) as one JSON line, answers one JSON line, exits. A fresh sandbox per call, so that a call that
hangs, forks or fills memory takes nothing with it when it is killed at its deadline. Standard library only."""
from __future__ import annotations

import re

from hybridflow import wire
from hybridflow.agents._user_code import describe, load, protocol_streams

MAX_OUTPUT = 4000
_CUT_NOTE = re.compile(r"\n\[\.\.\. \d+ more characters cut\]")


def cut(text: str) -> str:
    """At most MAX_OUTPUT characters of a tool's answer, saying how many were cut. Applied here and again by the
    driver (the tool's code can write its own reply onto the protocol pipe, past this worker's cut), hence
    idempotent: an answer cut once passes unchanged."""
    if len(text) <= MAX_OUTPUT or _CUT_NOTE.fullmatch(text, MAX_OUTPUT):
        return text
    return text[:MAX_OUTPUT] + f"\n[... {len(text) - MAX_OUTPUT} more characters cut]"


def main() -> None:
    proto_in, proto_out = protocol_streams()
    request = wire.receive(proto_in)
    try:
        fn = load(request, "function")
        arguments = request.get("arguments") or {}
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be an object, got {type(arguments).__name__}")
        result = fn(**arguments)
        wire.send(proto_out, {"ok": cut(result if isinstance(result, str) else repr(result))})
    except BaseException as err:  # noqa: BLE001 - the tool's failure is its answer
        wire.send(proto_out, {"error": describe(err)})


if __name__ == "__main__":
    main()
