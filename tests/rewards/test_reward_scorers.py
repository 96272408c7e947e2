"""Built-in reward scorers on decoded text, each checked on answers that must and must not score."""
import pytest

from hybridflow.rewards.scorers import SCORERS, get_scorer, weighted


@pytest.mark.parametrize("response,truth,expected", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),         # GSM8K's answer line
    ("The answer is \\boxed{72}.", "#### 72", 1.0),                    # GSM8K-style ground truth
    ("So the total is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),          # fraction vs decimal
    ("x = \\frac{3}{4}", "\\frac{3}{4}", 1.0),
    ("The answer is \\boxed{71}.", "72", 0.0),
    ("I do not know.", "72", 0.0),
    ("", "72", 0.0),
])
def test_math(response, truth, expected):
    assert get_scorer("math")("gsm8k", response, truth, {}) == expected


def test_math_refuses_a_ground_truth_without_an_answer():
    with pytest.raises(ValueError, match="holds no answer"):
        get_scorer("math")("gsm8k", "72", "no answer here", {})


def test_exact_regex_format():
    exact, regex, fmt = get_scorer("exact"), get_scorer("regex"), get_scorer("format")
    assert exact("d", " Paris\n", "Paris", {}) == 1.0 and exact("d", "paris", "Paris", {}) == 0.0
    assert exact("d", "paris", "Paris", {}, case_sensitive=False) == 1.0
    assert regex("d", "so it is 42", "42", {}) == 1.0 and regex("d", "42 is wrong, 43", "42", {}) == 0.0
    assert regex("d", "ANSWER: B.", "B", {}, pattern=r"ANSWER:\s*([A-D])") == 1.0
    assert fmt("d", "work... \\boxed{7}", None, {}) == 1.0 and fmt("d", "7", None, {}) == 0.0


def test_weighted_combination():
    score = weighted([("math", 0.9, {}), ("format", 0.1, {})])
    assert score("d", "\\boxed{72}", "72", {}) == pytest.approx(1.0)
    assert score("d", "72", "72", {}) == pytest.approx(0.9)
    assert score("d", "\\boxed{71}", "72", {}) == pytest.approx(0.1)
    with pytest.raises(KeyError, match="registered scorers: exact, format, math, regex"):
        weighted([("nope", 1.0, {})])


def test_registry_names():
    assert set(SCORERS) == {"math", "exact", "regex", "format"}


def test_a_scorer_reward_from_the_spec_scores_decoded_responses():
    """What the driver runs for `reward: {scorers: [{name: math}]}` (type scorer, from the field given): each
    response against its ground truth, a scorer that raises scoring errorScore and counted. This is the `math`
    scorer's path through a job (the end-to-end file jobs use reward functions)."""
    from hybridflow.rewards.text import TextReward
    from hybridflow.api import RewardSpec

    spec = RewardSpec.model_validate({"scorers": [{"name": "math"}], "errorScore": -1})
    assert spec.type == "scorer"
    responses = ["3 + 4 = 7\n#### 7", "#### 8", "I do not know.", "#### 7"]
    out = TextReward(spec).score(["gsm8k_style"] * 4, responses, ["7", "7", "7", "no answer here"], [{}] * 4)
    assert out.scores == [1.0, 0.0, 0.0, -1.0]
    assert [e.index for e in out.errors] == [3]
