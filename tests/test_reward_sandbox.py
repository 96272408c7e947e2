"""A user's reward function runs as untrusted code: separate processes, a deadline per call, errors reported with
the sample that caused them, and bad files refused before anything runs."""
import os
import textwrap
import time

import pytest

from hybridflow.rewards.sandbox import RewardFileError, RewardFunction, check_reward_file


def _file(tmp_path, body: str, name: str = "reward.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


GOOD = """
import os
def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise ZeroDivisionError("the user's bug")
    if solution_str == "hang":
        while True:
            pass
    if solution_str == "text":
        return "one"
    if solution_str == "env":
        return float(len([k for k in os.environ if "SECRET" in k]))
    if solution_str == "cwd":
        return float(len(os.listdir(".")))
    if solution_str == "exit":
        os._exit(3)
    exact = float(solution_str.strip() == str(ground_truth))
    return {"score": exact, "length": float(len(solution_str)), "source_ok": float(data_source == "gsm8k")}
"""


def _score(fn, solutions, truths=None):
    n = len(solutions)
    return fn.score(["gsm8k"] * n, solutions, truths or ["72"] * n, [{}] * n)


def test_scores_extras_and_errors_with_their_samples(tmp_path):
    with RewardFunction(_file(tmp_path, GOOD), timeout_seconds=5, error_score=-1.0) as fn:
        out = _score(fn, ["72", " 71", "boom", "text"])
    assert out.scores == [1.0, 0.0, -1.0, -1.0]
    assert out.extras["length"][:2] == [2.0, 3.0] and out.extras["source_ok"][:2] == [1.0, 1.0]
    assert [e.index for e in out.errors] == [2, 3]
    assert "ZeroDivisionError: the user's bug at reward.py:5" in str(out.errors[0])
    assert "'boom'" in str(out.errors[0]) and "'72'" in str(out.errors[0])  # the sample and its ground truth
    assert "returned str 'one', not a number" in str(out.errors[1])


def test_a_hanging_call_costs_one_deadline_and_the_pool_recovers(tmp_path):
    with RewardFunction(_file(tmp_path, GOOD), workers=2, timeout_seconds=1.5) as fn:
        t0 = time.monotonic()
        out = _score(fn, ["hang", "72", "72", "72"])
        took = time.monotonic() - t0
        assert out.scores == [0.0, 1.0, 1.0, 1.0]
        assert out.errors[0].index == 0 and "timed out after 1.5 s" in out.errors[0].error
        assert took < 1.5 + 10, took  # generous: the other worker went on meanwhile
        assert _score(fn, ["72", "exit", "72"]).scores == [1.0, 0.0, 1.0]  # a dying worker is replaced too


def test_workers_see_no_credentials_and_an_empty_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak")
    monkeypatch.setenv("RAY_AUTH_SECRET_TOKEN", "do-not-leak")
    with RewardFunction(_file(tmp_path, GOOD), timeout_seconds=10) as fn:
        out = _score(fn, ["env", "cwd"])
    assert out.errors == [] and out.scores == [0.0, 0.0]
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "do-not-leak"  # the driver's own environment is untouched


def test_batched_functions_take_lists(tmp_path):
    body = """
    def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(s == t) for s, t in zip(solution_strs, ground_truths)]
    """
    with RewardFunction(_file(tmp_path, body), batched=True, timeout_seconds=5) as fn:
        assert _score(fn, ["72", "7"]).scores == [1.0, 0.0]
    short = """
    def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]
    """
    with RewardFunction(_file(tmp_path, short, "short.py"), batched=True, timeout_seconds=5) as fn:
        out = _score(fn, ["72", "7"])
    assert out.scores == [0.0, 0.0] and "must return a list of 2 scores" in out.errors[0].error


@pytest.mark.parametrize("body,message", [
    ("def compute_score(a, b:\n    return 1\n", "reward.py:1: syntax error"),
    ("def score(data_source, solution_str, ground_truth, extra_info):\n    return 1\n",
     "no top-level function 'compute_score' (functions found: score)"),
    ("def compute_score(solution_str):\n    return 1\n", "must accept (data_source, solution_str, ground_truth"),
    ("async def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1\n", "is async"),
    ("def helper():\n    compute_score = 1\n    return compute_score\n",  # bound only inside a function body
     "no top-level function 'compute_score' (functions found: helper)"),
])
def test_bad_reward_files_are_refused_with_the_file_named(tmp_path, body, message):
    path = _file(tmp_path, body)
    with pytest.raises(RewardFileError) as err:
        check_reward_file(path, "compute_score")
    assert str(path) in str(err.value) and message in str(err.value)


def test_missing_file_and_failing_import_are_reported(tmp_path):
    with pytest.raises(RewardFileError, match="reward file not found"):
        check_reward_file(tmp_path / "nope.py", "compute_score")
    body = "import not_a_module_anywhere\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1\n"
    with pytest.raises(RewardFileError, match="loading it failed: ModuleNotFoundError"):
        RewardFunction(_file(tmp_path, body), timeout_seconds=5)


def test_kwargs_signature_is_accepted(tmp_path):
    body = "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n    return 0.5\n"
    with RewardFunction(_file(tmp_path, body), timeout_seconds=5) as fn:
        assert _score(fn, ["x"]).scores == [0.5]


def test_verl_names_are_passed_by_keyword_in_any_order(tmp_path):
    """verl calls compute_score by keyword: a file that orders the parameters its own way still gets each one."""
    body = """
    def compute_score(solution_str, ground_truth, data_source=None, extra_info=None):
        return solution_str == ground_truth and data_source == "gsm8k"
    """
    with RewardFunction(_file(tmp_path, body), timeout_seconds=5) as fn:
        out = _score(fn, ["72", "7"])
    assert out.errors == [] and out.scores == [1.0, 0.0]  # a bool is a score


def test_numpy_scalars_are_scores(tmp_path):
    body = """
    import numpy as np
    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return {"score": np.float32(0.5), "hits": np.int64(3), "mean": np.array(0.25)}  # scalars, a 0-d array
    """
    with RewardFunction(_file(tmp_path, body), timeout_seconds=10) as fn:
        out = _score(fn, ["x"])
    assert out.errors == [] and out.scores == [0.5] and out.extras["hits"] == [3.0] and out.extras["mean"] == [0.25]


def test_a_worker_that_died_while_idle_is_replaced(tmp_path):
    with RewardFunction(_file(tmp_path, GOOD), workers=1, timeout_seconds=5) as fn:
        assert _score(fn, ["72"]).scores == [1.0]
        victim = fn._procs[0].proc
        victim.kill()
        victim.wait(5)
        out = _score(fn, ["72", "71"])
    assert out.scores == [1.0, 0.0] and out.errors == []


def test_functions_bound_otherwise_are_checked_when_loaded(tmp_path):
    ok = """
    import functools
    def _score(data_source, solution_str, ground_truth, extra_info, scale):
        return scale * float(solution_str == ground_truth)
    compute_score = functools.partial(_score, scale=2.0)
    """
    check_reward_file(_file(tmp_path, ok), "compute_score")  # not a plain def: no verdict from the AST
    with RewardFunction(tmp_path / "reward.py", timeout_seconds=5) as fn:
        assert _score(fn, ["72"]).scores == [2.0]
    bad = "compute_score = lambda solution_str: 1.0\n"
    with pytest.raises(RewardFileError, match="must accept .data_source, solution_str, ground_truth, extra_info"):
        RewardFunction(_file(tmp_path, bad, "bad.py"), timeout_seconds=5)
