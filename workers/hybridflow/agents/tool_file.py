"""A user's tools file, read without running it: each top-level function with a docstring is a tool, its JSON
schema made from its parameters' annotations (str, int, float, bool, list, dict, list[...] and dict[...] or
List/Dict, and `X | None`, Optional[X] or Union[X, None] of those; typing's names bare or as `typing.List`, `t.List`)
and its docstring's first paragraph. Like the reward file, what can be checked is checked on
the driver, naming the file and line, before any sandbox starts; the code itself only ever runs in a sandbox (where
`hybridflow validate` and `run` also load it: hybridflow.agents.file_check)."""
from __future__ import annotations

import ast
from pathlib import Path

from hybridflow.agents.registry import ToolSpec
from hybridflow.user_files import UserFileError, parse_user_file

JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
              "dict": "object"}
_GENERIC = {"list": "list", "List": "list", "dict": "dict", "Dict": "dict"}  # list[str], typing.List[str], ...
_TYPING = {"List": "list", "Dict": "dict"}  # bare, without parameters


def _name(node: ast.expr) -> str | None:
    """`List` or a module's `typing.List` / `t.List` -> "List"."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.attr
    return None


def _none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None
MAX_NAME = 64  # a function name the OpenAI/HF tool form accepts


class ToolFileError(UserFileError):
    """The tools file cannot be used: missing, not Python, no tool in it, or a tool the model could not call."""


def _schema(node: ast.expr | None, where: str) -> dict[str, str]:
    """The JSON schema of an annotation; raises ToolFileError (`where` names the file, line, tool and parameter)
    for one the model could not be shown: what the schema would say is undefined."""
    if node is None:
        return {}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # "int", or any under `from __future__`
        try:
            return _schema(ast.parse(node.value, mode="eval").body, where)
        except SyntaxError:
            pass
    if isinstance(node, ast.Name) and node.id in JSON_TYPES:
        return {"type": JSON_TYPES[node.id]}
    if _name(node) in _TYPING:
        return {"type": JSON_TYPES[_TYPING[str(_name(node))]]}
    if isinstance(node, ast.Subscript) and (name := _name(node.value)) is not None:
        if name in _GENERIC:
            return {"type": JSON_TYPES[_GENERIC[name]]}
        if name == "Optional":
            return _schema(node.slice, where)
        if name == "Union" and isinstance(node.slice, ast.Tuple):  # Union[X, None]
            sides = [s for s in node.slice.elts if not _none(s)]
            if len(sides) == 1 and len(node.slice.elts) == 2:
                return _schema(sides[0], where)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
        sides = [s for s in (node.left, node.right) if not _none(s)]
        if len(sides) == 1:
            return _schema(sides[0], where)
    raise ToolFileError(f"{where} is annotated {ast.unparse(node)}; use one of {', '.join(JSON_TYPES)} (or "
                        "list[...], dict[...], X | None), or no annotation")


def read_tools_file(path: str | Path) -> dict[str, ToolSpec]:
    p = Path(path)
    tree = parse_user_file(p, "tools file not found (spec.rollout.agent.toolsFile)", ToolFileError)
    tools: dict[str, ToolSpec] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("_"):
            continue
        doc = ast.get_docstring(fn)
        if not doc:
            continue
        where = f"{p}:{fn.lineno}: tool '{fn.name}'"
        if isinstance(fn, ast.AsyncFunctionDef):
            raise ToolFileError(f"{where} is async; a tool is a plain function (it is called, never awaited)")
        if fn.name in tools:
            raise ToolFileError(f"{where} is defined again (first at line {tools[fn.name].line}): the model would "
                                "be shown the first and call the second; rename or remove one")
        if len(fn.name) > MAX_NAME:
            raise ToolFileError(f"{where}: a tool's name has at most {MAX_NAME} characters")
        if fn.args.posonlyargs:
            raise ToolFileError(f"{p}:{fn.lineno}: tool '{fn.name}': parameter '{fn.args.posonlyargs[0].arg}' is "
                                "positional-only, but a tool is called with keyword arguments; drop the '/'")
        props, required = {}, []
        args = fn.args.args + fn.args.kwonlyargs
        defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + list(fn.args.defaults) + list(
            fn.args.kw_defaults)
        for a, default in zip(args, defaults):
            props[a.arg] = _schema(a.annotation, f"{p}:{a.lineno}: tool '{fn.name}': parameter '{a.arg}'")
            if default is None:
                required.append(a.arg)
        description = doc.strip().split("\n\n")[0].replace("\n", " ")
        tools[fn.name] = ToolSpec(fn.name, description, {"type": "object", "properties": props,
                                                         "required": required}, path=str(p.resolve()),
                                  line=fn.lineno)
    if not tools:
        raise ToolFileError(f"{p}: no tool found: a tool is a top-level function with a docstring")
    return tools
