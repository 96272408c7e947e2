"""A user's tools file, read without running it: each top-level function with a docstring is a tool, its JSON
schema made from its parameters' annotations (str, int, float, bool, list, dict) and its docstring's first
paragraph. Like the reward file, what can be checked is checked on the driver, naming the file and line, before
any sandbox starts; the code itself only ever runs in a tool sandbox."""
from __future__ import annotations

import ast
from pathlib import Path

from hybridflow.agents.registry import ToolSpec
from hybridflow.user_files import UserFileError, parse_user_file

JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
              "dict": "object"}


class ToolFileError(UserFileError):
    """The tools file cannot be used: missing, not Python, or no tool in it."""


def read_tools_file(path: str | Path) -> dict[str, ToolSpec]:
    p = Path(path)
    tree = parse_user_file(p, "tools file not found (spec.rollout.agent.toolsFile)", ToolFileError)
    tools: dict[str, ToolSpec] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        doc = ast.get_docstring(fn)
        if not doc:
            continue
        props, required = {}, []
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        defaults = [None] * (len(fn.args.posonlyargs + fn.args.args) - len(fn.args.defaults)) + list(
            fn.args.defaults) + list(fn.args.kw_defaults)
        for a, default in zip(args, defaults):
            kind = a.annotation.id if isinstance(a.annotation, ast.Name) else None
            if kind is not None and kind not in JSON_TYPES:
                raise ToolFileError(f"{p}:{fn.lineno}: tool '{fn.name}': parameter '{a.arg}' is annotated {kind}; "
                                    f"use one of {', '.join(JSON_TYPES)}")
            props[a.arg] = {"type": JSON_TYPES[kind]} if kind else {}
            if default is None:
                required.append(a.arg)
        description = doc.strip().split("\n\n")[0].replace("\n", " ")
        tools[fn.name] = ToolSpec(fn.name, description, {"type": "object", "properties": props,
                                                         "required": required}, path=str(p.resolve()))
    if not tools:
        raise ToolFileError(f"{p}: no tool found: a tool is a top-level function with a docstring")
    return tools
