"""The reward worker: the process that runs inside each sandbox (`python -m hybridflow.rewards.worker PATH NAME`),
loads the user's reward file from the source the driver sends, and answers calls over a pipe, one JSON line each way
(hybridflow.wire). It runs in bwrap with a clean environment and only the read-only machine to import from, so it
imports only the standard library, hybridflow.wire and this package's stdlib-only reward_file; it turns the user's
results into plain floats and strings here, inside the sandbox. JSON, not pickle: the user's code runs in this same
process and can write anything onto the pipe, and the driver only ever parses plain data from it."""
from __future__ import annotations

import inspect
import linecache
import math
import numbers
import os
import resource
import sys
import traceback
import types
from pathlib import Path
from typing import Any

from hybridflow import wire
from hybridflow.rewards.reward_file import SIGNATURE

MAX_ERROR = 4000  # characters of an error message sent back: a reply stays well under wire.MAX_LINE


def _score_of(value: Any) -> tuple[float, dict[str, float]]:
    """A result -> (score, extra metrics); ValueError says what was wrong with it. Any real number counts,
    bools and numpy scalars included (`return answer == truth` is a score of 0 or 1)."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys: {sorted(map(str, value))})")
        for k, v in value.items():
            if k != "score" and _is_real(v):
                extras[str(k)] = float(v)
        value = value["score"]
    if not _is_real(value):
        raise ValueError(f"returned {type(value).__name__} {value!r:.80}, not a number")
    if not math.isfinite(float(value)):
        raise ValueError(f"returned {value}, not a finite number")
    return float(value), extras


def _is_real(v: Any) -> bool:
    if isinstance(v, numbers.Real):
        return True
    try:  # numpy and torch scalars
        return getattr(v, "ndim", None) == 0 or (hasattr(v, "item") and isinstance(v.item(), numbers.Real))
    except Exception:  # noqa: BLE001 - not a scalar
        return False


def _call_style(fn: Any) -> str:
    """'keyword' when the function names verl's four parameters (verl calls them by keyword), else 'position'.
    Raises TypeError when it can take them neither way."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "position"  # a builtin or C function: try it
    try:
        sig.bind(**dict.fromkeys(SIGNATURE))
        return "keyword"
    except TypeError:
        pass
    try:
        sig.bind(*SIGNATURE)
        return "position"
    except TypeError:
        raise TypeError(f"it must accept ({', '.join(SIGNATURE)}); its signature is {sig}") from None


def _worker_main(path: str, name: str) -> None:
    """The reward worker (`python -m hybridflow.rewards.worker PATH NAME`): load the source the driver sends
    (as PATH), then answer calls until the driver closes the pipe. The protocol runs on the original stdin/stdout;
    the user's prints go to stderr. Each reply carries its request's id (the driver takes only the reply with the id
    it sent, whatever else the user's code writes onto the pipe), plain floats or error strings, and the worker's CPU
    seconds so far, against its RLIMIT_CPU."""
    proto_in, proto_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)

    def request() -> dict[str, Any] | None:
        """The driver's next request; None once it closed the pipe. Read without wire.MAX_LINE: a batch can be
        larger, and the driver is trusted (the limit protects the driver from the worker)."""
        line = proto_in.readline()
        return wire.decode(line) if line else None

    def reply(call: dict[str, Any], kind: str, value: Any) -> None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        wire.send(proto_out, {"id": call.get("id"), "kind": kind, "value": value, "cpu": r.ru_utime + r.ru_stime})

    load = request()
    if load is None:
        return
    try:
        source = str(load["source"])
        code = compile(source, path, "exec")
        # The file itself may be out of the sandbox's reach: tracebacks read its lines from here.
        linecache.cache[path] = (len(source), None, source.splitlines(True), path)
        module = types.ModuleType("hybridflow_user_reward")
        module.__file__ = path
        sys.modules[module.__name__] = module  # so that what the file defines can be pickled (e.g. its own pools)
        exec(code, module.__dict__)  # noqa: S102 - the user's reward file, in its sandbox
        fn = getattr(module, name, None)
        if fn is None or not callable(fn):
            raise TypeError(f"'{name}' is not a function in the file")
        style = _call_style(fn)
        reply(load, "ready", None)
    except BaseException as err:  # noqa: BLE001 - whatever the file does at import is reported, not raised here
        reply(load, "load-error", _describe(err))
        return
    while (call := request()) is not None:
        args = call["args"]
        try:
            result = fn(**dict(zip(SIGNATURE, args))) if style == "keyword" else fn(*args)
        except BaseException as err:  # noqa: BLE001 - a user's exception is a result, reported with its sample
            reply(call, "error", _describe(err))
            continue
        try:
            if isinstance(args[1], list):  # batched: one result per sample, each a score or its error
                if not isinstance(result, (list, tuple)) or len(result) != len(args[1]):
                    raise ValueError(f"a batched function must return a list of {len(args[1])} scores, got "
                                     f"{type(result).__name__}")
                reply(call, "ok", [_checked(r) for r in result])
            else:
                reply(call, "ok", _score_of(result))
        except ValueError as err:
            reply(call, "error", str(err)[:MAX_ERROR])


def _checked(value: Any) -> tuple[float, dict[str, float]] | str:
    try:
        return _score_of(value)
    except ValueError as err:
        return str(err)


def _describe(err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != __file__]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(err).__name__}: {err}"[:MAX_ERROR] + where


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2])
