"""A judge's verdict: the question it is asked (a template filled with the prompt, the response and the reference
answer) and how its answer becomes a score (a registered parser). Pure and torch-free: the spec validates a
template's fields and a parser's name here, and hybridflow.rewards.judge asks the judge's engine.

Adding a parser is one function with `@register("name")` (VERDICT_PARSERS.register): it takes the judge's decoded
answer, the job's settings and the sample's reference answer, and returns a score in [0, 1], or raises `Unparsed`
saying what it expected.
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hybridflow.registry import Registry

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")

DEFAULT_TEMPLATE = (
    "Here is a question, a reference answer and a student's answer.\n\n"
    "Question: {prompt}\n"
    "Reference answer: {ground_truth}\n"
    "Student's answer: {response}\n\n"
    "Does the student's answer agree with the reference answer? Reply with one word: yes or no."
)


class Unparsed(ValueError):
    """The judge's answer holds no verdict the parser can read."""


@dataclass(frozen=True)
class ParserSettings:
    """What a parser reads of spec.models.reward.judge."""

    pattern: str | None = None  # regex: the verdict's number is group 1
    max_score: float = 10.0  # number, regex: the verdict's number divided by it


Parser = Callable[[str, ParserSettings, str], float]
VERDICT_PARSERS: Registry[Parser] = Registry("verdict parser", plural="parsers")


def register(name: str) -> Callable[[Parser], Parser]:
    return VERDICT_PARSERS.register(name)


@register("yes_no")
def yes_no(answer: str, settings: ParserSettings, ground_truth: str) -> float:
    """1 for an answer whose first word is yes (or true, correct), 0 for no (false, incorrect)."""
    words = re.findall(r"[a-z]+", answer.lower())
    first = words[0] if words else ""
    if first in ("yes", "true", "correct"):
        return 1.0
    if first in ("no", "false", "incorrect", "wrong"):
        return 0.0
    raise Unparsed(f"expected an answer starting with yes or no, got {answer[:80]!r}")


def _scaled(number: str, settings: ParserSettings, answer: str) -> float:
    value = float(number)
    if not 0 <= value <= settings.max_score:
        raise Unparsed(f"the verdict {value:g} is outside 0..maxScore {settings.max_score:g}: {answer[:80]!r}")
    return value / settings.max_score


@register("number")
def number(answer: str, settings: ParserSettings, ground_truth: str) -> float:
    """The first number of the answer (e.g. `8/10`, `Score: 8`), divided by maxScore."""
    found = re.search(r"-?\d+(?:\.\d+)?", answer)
    if found is None:
        raise Unparsed(f"expected a number from 0 to {settings.max_score:g}, got {answer[:80]!r}")
    return _scaled(found.group(0), settings, answer)


@register("regex")
def regex(answer: str, settings: ParserSettings, ground_truth: str) -> float:
    """Group 1 of `pattern`'s first match, a number divided by maxScore."""
    found = re.search(settings.pattern or "", answer)
    if found is None or not found.groups() or found.group(1) is None:
        raise Unparsed(f"pattern {settings.pattern!r} does not match {answer[:80]!r}")
    try:
        return _scaled(found.group(1), settings, answer)
    except ValueError as err:
        raise Unparsed(str(err)) from None


@register("matches")
def matches(answer: str, settings: ParserSettings, ground_truth: str) -> float:
    """1 when the answer the judge read out of the response (its first number, or its first line when the reference
    is not a number) equals the reference answer, else 0: for a judge asked to extract a final answer, which a
    small model does far more reliably than it grades one."""
    if not ground_truth.strip():
        raise Unparsed("the sample has no reference answer to match (its data's ground truth is empty)")
    try:
        truth = float(ground_truth.replace("_", "?"))  # float() reads '1_000', which no answer means
    except ValueError:
        first = answer.strip().splitlines()[0].strip().rstrip(".") if answer.strip() else ""
        if not first:
            raise Unparsed("expected the response's final answer, got nothing") from None
        return float(first == ground_truth.strip())
    found = re.search(r"-?\d+(?:\.\d+)?", answer.replace(",", ""))
    if found is None:
        raise Unparsed(f"expected the response's final number, got {answer[:80]!r}")
    return float(float(found.group(0)) == truth)


def template_problem(template: str) -> str | None:
    """Why `template` cannot be filled (None: it can): a field other than {prompt}, {response}, {ground_truth}, an
    attribute or index on one, or an unbalanced brace. Literal braces are written doubled ({{ }})."""
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        return f"{err} (write a literal brace as {{{{ or }}}})"
    for name, spec, conv in fields:
        if name not in TEMPLATE_FIELDS or spec or conv:
            return (f"{{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}} is no field it fills; use "
                    + ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS))
    if not any(name == "response" for name, _, _ in fields):
        return "it never shows the judge the response: put {response} in it"
    return None


def question_text(raw_prompt: Any) -> str:
    """The question as the data gives it: a text, or chat messages (the last user message's content)."""
    if isinstance(raw_prompt, (list, tuple)):
        users = [m.get("content", "") for m in raw_prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return "" if raw_prompt is None else str(raw_prompt)


def fill(template: str, prompt: str, response: str, ground_truth: Any) -> str:
    """The judge's user message (the template was checked by template_problem)."""
    truth = "" if ground_truth is None else str(ground_truth)
    return template.format(prompt=prompt, response=response, ground_truth=truth)


def agreement(judged: list[float], reference: list[float]) -> float:
    """The share of samples on which the judge and a reference score (a rule's) give the same verdict: each
    read as pass (>= 0.5) or fail."""
    if not judged:
        return float("nan")
    return sum((j >= 0.5) == (r >= 0.5) for j, r in zip(judged, reference)) / len(judged)
