"""Loading code inside a sandbox (standard library only): a built-in's "module:attribute", or a user's file from the
source the driver sent (the file itself may be out of the sandbox's reach), and describing an error in one line."""
from __future__ import annotations

import importlib
import linecache
import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any


def load(request: dict[str, Any], attribute_key: str) -> Any:
    """request: {"target": "module:attr"} or {"source", "path", attribute_key: name}."""
    if request.get("target"):
        module, _, attr = str(request["target"]).partition(":")
        return getattr(importlib.import_module(module), attr)
    path, name = str(request["path"]), str(request[attribute_key])
    found = getattr(load_module(path, str(request["source"])), name, None)
    if found is None:
        raise NameError(f"{Path(path).name} defines no '{name}'")
    return found


def load_module(path: str, source: str) -> types.ModuleType:
    """The user's file run as a module from `source` (what the driver read), under its own path's name."""
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)  # tracebacks read lines from here
    module = types.ModuleType("hybridflow_user_code")
    module.__file__ = path
    sys.modules[module.__name__] = module
    exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102 - the user's file, in its sandbox
    return module


def describe(err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(os.path.dirname(__file__))]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def protocol_streams() -> tuple[Any, Any]:
    """The pipes to the driver, kept on the original stdin/stdout; what user code prints goes to stderr, and it
    reads nothing (stdin is /dev/null for it)."""
    proto_in, proto_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    return proto_in, proto_out
