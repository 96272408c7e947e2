"""One tool call, inside its own sandbox (`python -m hybridflow.agents.tool_worker`): reads the call (the tool's code
and its arguments) as one JSON line, answers {"loaded": true} once the code has loaded, then the call's answer, and
exits (a file that does not load answers its error instead). A fresh sandbox per call, so that a call that hangs,
forks or fills memory takes nothing with it when it is killed at its deadline. Standard library only.

What this process says is only as good as the code it runs (the model's, through the python built-in or a user's
tool that runs code, can write onto the protocol pipe): the driver decides whether a call crashed
(hybridflow.agents.local.LocalTools) from the order of the lines and for a user's tool only."""
from __future__ import annotations

import re
import traceback
from typing import Any

from hybridflow import wire
from hybridflow.agents._user_code import describe, load, protocol_streams

MAX_OUTPUT = 4000
BROKEN_CODE = (NameError, ImportError)  # raised by the tools file's own lines: broken whatever the model passed
_CUT_NOTE = re.compile(r"\n\[\.\.\. \d+ more characters cut\]")


def cut(text: str) -> str:
    """At most MAX_OUTPUT characters of a tool's answer, saying how many were cut. Applied here and again by the
    driver (the tool's code can write its own reply onto the protocol pipe, past this worker's cut), hence
    idempotent: an answer cut once passes unchanged."""
    if len(text) <= MAX_OUTPUT or _CUT_NOTE.fullmatch(text, MAX_OUTPUT):
        return text
    return text[:MAX_OUTPUT] + f"\n[... {len(text) - MAX_OUTPUT} more characters cut]"


def broken(err: BaseException, path: Any) -> bool:
    """Whether `err` says the tools file at `path` is broken: NameError, or ImportError at an import statement,
    raised by a line of that file itself (innermost frame), not by code it ran (eval, exec, a library) nor by a
    name or module the model passed (getattr, importlib)."""
    frames = traceback.extract_tb(err.__traceback__)
    if not path or not isinstance(err, BROKEN_CODE) or not frames or frames[-1].filename != str(path):
        return False
    return isinstance(err, NameError) or (frames[-1].line or "").lstrip().startswith(("import ", "from "))


def main() -> None:
    proto_in, proto_out = protocol_streams()
    request = wire.receive(proto_in)
    try:
        fn = load(request, "function")
    except BaseException as err:  # noqa: BLE001 - the tool's file does not load: no call of it can answer
        wire.send(proto_out, {"error": f"the tool's code did not load: {describe(err)}"})
        return
    wire.send(proto_out, {"loaded": True})
    try:
        arguments = request.get("arguments") or {}
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be an object, got {type(arguments).__name__}")
        result = fn(**arguments)
        wire.send(proto_out, {"ok": cut(result if isinstance(result, str) else repr(result))})
    except BaseException as err:  # noqa: BLE001 - the tool's failure is its answer
        # and, when the file is broken whatever the model passed (a name it never defined, a module the sandbox
        # lacks), a crash too for a user's tool: the driver counts it against spec.rollout.agent.maxFailedFraction
        wire.send(proto_out, {"error": describe(err), "broken": broken(err, request.get("path"))})


if __name__ == "__main__":
    main()
