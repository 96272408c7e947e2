"""What the image tests read from Dockerfiles and locks: each RUN line's shell commands as word lists, and a lock's
pins (constraints/<name>.txt) under normalised package names. Shared by tests/operator/test_images.py and
tests/cli/test_gpu_constraints.py."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]


def norm(name: str) -> str:
    """A package name as pip compares them: extras dropped, runs of -_. as one -, lower case."""
    return re.sub(r"[-_.]+", "-", re.sub(r"\[.*\]", "", name)).lower()


def lock_pins(name: str) -> dict[str, str]:
    """normalised package name -> pinned version, from constraints/<name>.txt (comments and markers dropped)."""
    pins = {}
    for line in (ROOT / "constraints" / f"{name}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        if line:
            package, version = line.split("==")
            pins[norm(package)] = version.strip()
    return pins


def run_commands(df: DockerfileParser) -> list[list[str]]:
    """Every shell command of the RUN lines, as its words (split at &&, ;, ||, | and parentheses)."""
    commands = []
    for ins in df.structure:
        if ins["instruction"] != "RUN":
            continue
        lexer = shlex.shlex(ins["value"], posix=True, punctuation_chars="&|;()")
        lexer.whitespace_split = True
        words: list[str] = []
        for tok in lexer:
            if tok in ("&&", ";", "||", "|", "(", ")"):
                commands.append(words)
                words = []
            else:
                words.append(tok)
        commands.append(words)
    return [c for c in commands if c]
