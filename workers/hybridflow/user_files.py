"""A user's Python file (a reward function, tools, an environment) read on the driver without running it: there,
text, Python. Each kind checks more of its own on the tree this returns; one reader, so a missing, binary or broken
file of any kind fails the same way, naming the file (and line), before any sandbox starts."""
from __future__ import annotations

import ast
from pathlib import Path


class UserFileError(ValueError):
    """A user's file cannot be used; the message names the file, and the line where there is one."""


def parse_user_file(path: str | Path, missing: str, error: type[UserFileError] = UserFileError) -> ast.Module:
    """The file's syntax tree; raises `error`: "`path`: `missing`" when it is not a file, and the line of a syntax
    error or that it is not text."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: {missing}")
    try:
        return ast.parse(p.read_text(), filename=str(p))
    except SyntaxError as err:
        raise error(f"{p}:{err.lineno}: syntax error: {err.msg}") from None
    except UnicodeDecodeError as err:
        raise error(f"{p}: not a text file ({err})") from None
