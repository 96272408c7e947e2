"""The registered tools and environments, by name: the spec validates `rollout.agent.tools` and
`rollout.agent.environment` against these tables. An entry names its code lazily ("module:attribute") because that
code runs inside a sandbox, never in the process that reads the table; adding one is a module of standard-library
code and one `add` here (or from a plug-in)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.registry import Registry


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model is offered it (name, description, JSON-schema parameters: the `tools` a chat template
    renders) and where its code is: a built-in's "module:function", or a user's tools file and function."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)
    target: str = ""  # "module:function" of a built-in
    path: str | None = None  # a user's tools file
    line: int | None = None  # its line there, for messages

    def offered(self) -> dict[str, Any]:
        """The OpenAI/HF function form that chat templates' `tools` take."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def _string_parameter(name: str, what: str) -> dict[str, Any]:
    return {"type": "object", "properties": {name: {"type": "string", "description": what}}, "required": [name]}


TOOLS: Registry[ToolSpec] = Registry("tool")
TOOLS.add("calculator", ToolSpec(
    "calculator", "Evaluate an arithmetic expression exactly (numbers, + - * / // % ** and parentheses).",
    _string_parameter("expression", "e.g. 123 * 45"), "hybridflow.agents.builtin_tools:calculator"))
TOOLS.add("python", ToolSpec(
    "python", "Run Python code and see what it prints (no network, no files outside its own /tmp).",
    _string_parameter("code", "Python source, e.g. print(123 * 45)"), "hybridflow.agents.builtin_tools:python"))

# Environments: name -> "module:class" of a class with reset(sample) -> str and step(action) -> (observation,
# reward, done, info), in standard-library code (it runs in the sandbox).
ENVIRONMENTS: Registry[str] = Registry("environment")
ENVIRONMENTS.add("guess_number", "hybridflow.agents.envs.guess_number:GuessNumber")
