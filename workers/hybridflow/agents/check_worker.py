"""A user's tools file, environment file or agent program loaded as its workers will load it, inside a sandbox of its
own, to find what would fail every call or every episode (`python -m hybridflow.agents.check_worker`): reads one JSON
line, answers one JSON line {"problems": [{"line": int | None, "message": str}]}, exits. Standard library only.

The request: {"path", "source", "tools": {name: {"line", "parameters"}}} (the tools and schema parameters the driver
read from the file without running it), {"path", "source", "class": name} or {"path", "source", "program": true}.
Checked: the file loads (its top-level code runs: an import the sandbox lacks fails here); each tool is still a plain
function once loaded and takes the parameters its schema offers (a decorator may change both); the environment class
exists, is made with no arguments, and has reset(sample) and step(action), each callable with its one argument and
not async; the program defines `run`, an `async def` called as run(client, sample)."""
from __future__ import annotations

import ast
import inspect
import traceback
from typing import Any

from hybridflow import wire
from hybridflow.agents._user_code import describe, load_module, protocol_streams

Problem = dict[str, Any]


def _line(obj: Any) -> int | None:
    """The first line of a function's (or method's) code, through decorators and static/class methods."""
    obj = getattr(obj, "__func__", obj)
    code = getattr(inspect.unwrap(obj), "__code__", None) if callable(obj) else None
    return getattr(code, "co_firstlineno", None)


def _tools(module: Any, tools: dict[str, dict[str, Any]]) -> list[Problem]:
    out: list[Problem] = []
    for name, read in tools.items():
        fn, line = getattr(module, name, None), read.get("line")
        if not callable(fn):
            out.append({"line": line, "message": f"tool '{name}' is defined here, but once the file has run '{name}' "
                        f"is {type(fn).__name__}, not a function (later code rebinds it)"})
        elif inspect.iscoroutinefunction(inspect.unwrap(fn)):
            out.append({"line": line, "message": f"tool '{name}' is async once loaded; a tool is a plain function"})
        else:
            try:
                sig = inspect.signature(fn)
                sig.bind_partial(**{p: None for p in read.get("parameters", ())})
            except ValueError:
                continue  # no signature to read (a builtin): its calls say what is wrong
            except TypeError as err:
                out.append({"line": line, "message": f"tool '{name}' as loaded takes {sig}, not the parameters its "
                            f"schema offers the model ({', '.join(read.get('parameters', ()))}): {err}"})
    return out


def _arity(cls: type, name: str, argument: str) -> str | None:
    """Why an instance's `name`(argument) cannot be called, or None."""
    raw = inspect.getattr_static(cls, name, None)
    if raw is None:
        return f"has no method {name}({argument})"
    method = getattr(cls, name)
    if not callable(method):
        return f"has {name} = {type(method).__name__}, not a method {name}({argument})"
    if inspect.iscoroutinefunction(inspect.unwrap(getattr(method, "__func__", method))):
        return f"has an async {name}(); it is called, never awaited"
    try:
        sig = inspect.signature(method)
    except (TypeError, ValueError):
        return None
    try:
        if inspect.isfunction(raw):
            sig.bind(None, argument)  # self, then the one argument
        else:  # a static or class method, or another callable: bound already
            sig.bind(argument)
    except TypeError:
        return f"has {name}{sig}, but it is called with one argument, {name}({argument})"
    return None


def _environment(module: Any, name: str, source: str) -> list[Problem]:
    tree = ast.parse(source)
    line = next((n.lineno for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    cls = getattr(module, name, None)
    if cls is None:
        classes = sorted(k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        return [{"line": None, "message": f"no class '{name}' (spec.rollout.agent.environmentClass) once it has run; "
                 f"the classes it defines: {', '.join(classes) or 'none'}"}]
    if not isinstance(cls, type):
        return [{"line": line, "message": f"'{name}' is {type(cls).__name__}, not a class"}]
    out: list[Problem] = []
    try:
        inspect.signature(cls).bind()
    except TypeError:
        out.append({"line": _line(cls.__init__) or line, "message": f"class '{name}' takes {inspect.signature(cls)}, "
                    f"but it is made with no arguments (one instance per episode)"})
    except ValueError:
        pass
    for method, argument in (("reset", "sample"), ("step", "action")):
        why = _arity(cls, method, argument)
        if why:
            out.append({"line": _line(inspect.getattr_static(cls, method, None)) or line,
                        "message": f"class '{name}' {why}"})
    return out


def _binds(node: ast.stmt, name: str) -> bool:
    """Whether a top-level statement defines or assigns `name`."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == name
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def _program(module: Any, source: str) -> list[Problem]:
    """An agent program's `run`: there once the file has run, an async function, called as run(client, sample)."""
    binds = [n.lineno for n in ast.parse(source).body if _binds(n, "run")]
    line = binds[-1] if binds else None  # the last top-level line that binds it
    fn = getattr(module, "run", None)
    if fn is None:
        functions = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        return [{"line": None, "message": "defines no `async def run(client, sample)` once it has run; its "
                 f"functions: {', '.join(functions) or 'none'}"}]
    line = _line(fn) or line
    if not callable(fn):
        return [{"line": line, "message": f"run is {type(fn).__name__}, not `async def run(client, sample)`"}]
    if not inspect.iscoroutinefunction(inspect.unwrap(fn)):
        return [{"line": line, "message": "run is a plain function; it must be `async def run(client, sample)` "
                 "(it is awaited, and its client's calls are awaited in it)"}]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    try:
        sig.bind("client", "sample")
    except TypeError:
        return [{"line": line, "message": f"run takes {sig}, but it is called as run(client, sample)"}]
    return []


def check(request: dict[str, Any]) -> list[Problem]:
    try:
        module = load_module(str(request["path"]), str(request["source"]))
    except BaseException as err:  # noqa: BLE001 - the file's own error, at its line
        path = str(request["path"])
        lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
        return [{"line": lines[-1] if lines else None, "message": f"loading it raised {type(err).__name__}: {err}"}]
    if "tools" in request:
        return _tools(module, dict(request["tools"]))
    if request.get("program"):
        return _program(module, str(request["source"]))
    return _environment(module, str(request["class"]), str(request["source"]))


def main() -> None:
    proto_in, proto_out = protocol_streams()
    request = wire.receive(proto_in)
    try:
        problems = check(request)
    except BaseException as err:  # noqa: BLE001 - e.g. inspecting an object whose attributes raise
        problems = [{"line": None, "message": f"inspecting it raised {describe(err)}"}]
    wire.send(proto_out, {"problems": problems})


if __name__ == "__main__":
    main()
