"""What can be known of a user's reward file without running it: that it exists, parses, binds the function, and
(for a plain `def`) takes verl's four arguments. `hybridflow validate` and the job's start call it on the driver,
before any sandbox is made, so that a typo fails in a second with the file and line rather than in a worker."""
from __future__ import annotations

import ast
from pathlib import Path

from hybridflow.user_files import UserFileError, parse_user_file

SIGNATURE = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFileError(UserFileError):
    """The reward file cannot be used: missing, not Python, no such function, or the wrong signature."""


def check_reward_file(path: str | Path, name: str, batched: bool = False) -> None:
    """What can be checked without running the user's code: the file exists and parses, and `name` is bound at its
    top level; when it is a plain `def`, that it can take verl's four arguments (data_source, solution_str,
    ground_truth, extra_info). Anything else (a decorated, assigned or imported function) is checked when a worker
    loads the file. Raises RewardFileError naming the file (and line)."""
    p = Path(path)
    tree = parse_user_file(p, "reward file not found", RewardFileError)
    fns = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if name not in fns:
        if name in _other_top_level_names(tree):
            return  # bound by an assignment, import, or inside if/try: the worker checks it at load
        found = ", ".join(sorted(fns)) or "none"
        raise RewardFileError(f"{p}: no top-level function '{name}' (functions found: {found})")
    fn = fns[name]
    if isinstance(fn, ast.AsyncFunctionDef):
        raise RewardFileError(f"{p}:{fn.lineno}: '{name}' is async; write a plain function")
    if fn.decorator_list:
        return  # a decorator may change the signature: checked at load
    a = fn.args
    positional = [x.arg for x in a.posonlyargs + a.args]
    required = len(positional) - len(a.defaults)
    required_kwonly = [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    by_name = set(SIGNATURE) <= set(positional[len(a.posonlyargs):]) | {x.arg for x in a.kwonlyargs} or a.kwarg
    by_position = len(positional) >= len(SIGNATURE) or a.vararg is not None
    if not (by_name or by_position) or required > len(SIGNATURE) or (required_kwonly and not by_name):
        raise RewardFileError(
            f"{p}:{fn.lineno}: '{name}' must accept ({', '.join(SIGNATURE)})"
            + (" as lists (batched: true)" if batched else "") + f"; it takes ({', '.join(positional)})")


def _other_top_level_names(tree: ast.Module) -> set[str]:
    """Names the module binds at its top level other than by a plain `def`: assignments, imports, and anything
    bound inside top-level if/try/with/for blocks; not the names inside function or class bodies."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            return  # its body binds names of its own scope
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        if not isinstance(node, ast.Lambda):
            for child in ast.iter_child_nodes(node):
                visit(child)

    for stmt in tree.body:
        visit(stmt)
    return names
