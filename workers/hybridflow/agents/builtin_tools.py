"""The built-in tools' code: what runs inside a tool sandbox (standard library only). Each takes its JSON arguments
by keyword and returns text; what it raises becomes the tool's error, which the model reads as the answer."""
from __future__ import annotations

import ast
import contextlib
import io
import operator
import traceback

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 1000  # 9**1000 has 955 digits: big enough for arithmetic, far from a memory blow-up


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of numbers, + - * / // % ** and parentheses (no names, no calls)."""
    tree = ast.parse(str(expression), mode="eval")

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value,
                                                                                                      bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    result = value(tree.body)
    if isinstance(result, float) and result.is_integer() and abs(result) < 2**53:
        result = int(result)
    return str(result)


def python(code: str) -> str:
    """Runs Python code and returns what it printed (and the value of a last bare expression, as a REPL shows it).
    An exception is part of the answer: its traceback's last lines."""
    tree = ast.parse(str(code), mode="exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    out = io.StringIO()
    scope: dict = {"__name__": "__main__"}
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(tree, "<tool>", "exec"), scope)  # noqa: S102 - the model's code, in its sandbox
            if last is not None:
                shown = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)  # noqa: S307
                if shown is not None:
                    print(repr(shown))
        except Exception:  # noqa: BLE001 - the model sees its own error, as a REPL shows it
            lines = traceback.format_exc().strip().splitlines()
            print("\n".join(lines[-3:]))
    return out.getvalue()
