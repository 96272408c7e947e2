"""Built-in reward scorers over decoded text: `math` (HF math-verify), `exact`, `regex` and `format`, and a weighted
combination of them. A scorer has verl's reward signature plus its own options, so a built-in and a user's
`compute_score` are interchangeable: `scorer(data_source, solution_str, ground_truth, extra_info, **options)`.

Adding a scorer is one function with `@register("name")` (SCORERS.register); the spec validates
spec.models.reward.scorers[].name against SCORERS, and the CRD's enum lists its names.
"""
from __future__ import annotations

import re
import threading
from typing import Any, Callable, Mapping, Sequence

from hybridflow.registry import Registry

Scorer = Callable[..., float]
SCORERS: Registry[Scorer] = Registry("scorer", plural="scorers")


def register(name: str) -> Callable[[Scorer], Scorer]:
    return SCORERS.register(name)


def get_scorer(name: str) -> Scorer:
    return SCORERS[name]  # an unknown name: "unknown scorer 'x'; registered scorers: ..."


@register("math")
def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None,
               **_: Any) -> float:
    """1 when the response's final mathematical answer equals the ground truth (math-verify: GSM8K's `#### 72`,
    `\\boxed{}`, fractions vs decimals, LaTeX), else 0."""
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only the main thread may set.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(str(ground_truth), parsing_timeout=limit)
    if not gold:
        raise ValueError(f"the ground truth {ground_truth!r} holds no answer math-verify can read")
    answer = parse(solution_str, parsing_timeout=limit)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=limit) else 0.0


@register("exact")
def exact_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None,
                *, strip: bool = True, case_sensitive: bool = True, **_: Any) -> float:
    """1 when the response equals the ground truth (after stripping whitespace; optionally ignoring case)."""
    a, b = solution_str, str(ground_truth)
    if strip:
        a, b = a.strip(), b.strip()
    if not case_sensitive:
        a, b = a.casefold(), b.casefold()
    return 1.0 if a == b else 0.0


@register("regex")
def regex_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None,
                *, pattern: str = r"(-?\d+(?:\.\d+)?)\s*$", **_: Any) -> float:
    """1 when the pattern's first group (or whole match), searched in the response, equals the ground truth; the
    default pattern takes the number the response ends with."""
    m = re.search(pattern, solution_str, re.DOTALL)
    if not m:
        return 0.0
    got = m.group(1) if m.groups() else m.group(0)
    return 1.0 if got.strip() == str(ground_truth).strip() else 0.0


@register("format")
def format_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None,
                 *, pattern: str = r"(?s).*\\boxed\{.+\}.*", **_: Any) -> float:
    """1 when the whole response matches the pattern (default: it contains a `\\boxed{...}` answer), whatever the
    answer; for shaping the output format beside a correctness scorer."""
    return 1.0 if re.fullmatch(pattern, solution_str.strip()) else 0.0


def weighted(parts: Sequence[tuple[str, float, Mapping[str, Any]]]) -> Scorer:
    """sum(weight * scorer(...)) over (name, weight, options) parts, e.g. 0.9 * math + 0.1 * format."""
    resolved = [(get_scorer(name), float(w), dict(opts)) for name, w, opts in parts]

    def score(data_source: str, solution_str: str, ground_truth: Any,
              extra_info: Mapping[str, Any] | None = None) -> float:
        return sum(w * fn(data_source, solution_str, ground_truth, extra_info, **opts) for fn, w, opts in resolved)

    return score
