"""A user's reward function scored in the sandbox pool: real RewardFunction workers (in their sandboxes) behind real
pool servers on 127.0.0.1, reached by RemoteRewardFunction with the job's sandbox token. A batch is split over the
replicas and comes back in order with its errors at their samples; a replica that is gone leaves its part to the
other; what a replica answers that is not a score (its user code could forge anything) stops the job instead of
training on it; and on Kubernetes (the operator's URLs and token in the environment) the job's reward is scored
there, never on the driver's machine."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from hybridflow.agents.server import PoolServer, PoolService
from hybridflow.rewards.remote import RemoteRewardFunction, serve_rewards
from hybridflow.rewards.sandbox import RewardFunction
from hybridflow.rewards.text import TextReward
from hybridflow.sandbox_pool import REWARD_URLS_ENV, TOKEN_ENV, URLS_ENV, PoolClient, PoolError
from support.paths import ROOT as REPO

TOKEN = "sandbox-token-" + "y" * 40

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise ValueError("no score for boom")
    return {"score": float(solution_str == ground_truth), "sample": float(extra_info["i"])}
'''


@pytest.fixture
def replicas(tmp_path):
    """Two pool replicas, each with the reward function in its own sandboxed workers; stopped on the way out."""
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    made: list[tuple[PoolServer, RewardFunction]] = []
    try:
        for _ in range(2):
            function = RewardFunction(path, workers=1, timeout_seconds=10)
            server = PoolServer(PoolService(None, None, rewards=serve_rewards(function)), TOKEN)
            server.start()
            made.append((server, function))
        yield [s for s, _ in made]
    finally:
        for server, function in made:
            server.stop()
            function.close()


def _batch(n: int) -> tuple[list, list, list, list]:
    solutions = [str(i % 3) if i != 3 else "boom" for i in range(n)]
    return ["d"] * n, solutions, ["1"] * n, [{"i": i} for i in range(n)]


def test_a_batch_is_split_over_the_replicas_and_comes_back_in_order(replicas):
    client = PoolClient([r.url for r in replicas], TOKEN)
    remote = RemoteRewardFunction(client, "reward.py:compute_score", timeout_seconds=10, workers=1)
    out = remote.score(*_batch(7))
    assert out.scores == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # "boom" (sample 3) scores error_score
    assert [(e.index, e.solution) for e in out.errors] == [(3, "boom")]
    assert "no score for boom" in out.errors[0].error
    assert all(c == 1 for c in client.request_counts().values())  # one part each, side by side
    seen = out.extras["sample"]  # each sample's metric at its own place, across the two parts
    assert math.isnan(seen[3]) and [x for i, x in enumerate(seen) if i != 3] == [0, 1, 2, 4, 5, 6]


def test_a_replica_that_is_gone_leaves_its_part_to_the_other(replicas):
    client = PoolClient([r.url for r in replicas], TOKEN)
    replicas[0].stop()
    out = RemoteRewardFunction(client, "reward.py:compute_score", workers=1).score(*_batch(4))
    assert out.scores == [0.0, 1.0, 0.0, 0.0] and [e.index for e in out.errors] == [3]
    assert client.failure_counts()[replicas[0].url] >= 1


def test_a_wrong_token_is_refused(replicas):
    with pytest.raises(PoolError, match="refused the job's sandbox token"):
        RemoteRewardFunction(PoolClient([replicas[1].url], "not-the-token"), "r").score(*_batch(2))


@pytest.mark.parametrize("answer", [
    {"scores": [float("nan"), 1.0], "extras": {}, "errors": []},
    {"scores": [1.0], "extras": {}, "errors": []},
    {"scores": [1.0, 1.0], "extras": {}, "errors": [{"index": 7, "error": "x"}]},
    {"scores": ["1", 1.0], "extras": {}, "errors": []},
    {"scores": [10 ** 400, 1.0], "extras": {}, "errors": []},  # past a float's range: JSON allows it
    {"scores": [1.0, 1.0], "extras": {"m": ["x", 1.0]}, "errors": []},
])
def test_what_is_not_a_score_stops_the_job_instead_of_training_on_it(answer):
    server = PoolServer(PoolService(None, None, rewards=lambda body: answer), TOKEN)
    server.start()
    try:
        with pytest.raises(PoolError, match="is not 2 scores"):
            RemoteRewardFunction(PoolClient([server.url], TOKEN), "r").score(*_batch(2))
    finally:
        server.stop()


def test_on_kubernetes_the_jobs_reward_function_is_scored_in_the_pool(replicas, tmp_path, monkeypatch):
    spec = SimpleNamespace(type="function", function=SimpleNamespace(path=str(tmp_path / "absent.py"),
                                                                      name="compute_score", batched=False),
                           scorers=[], workers=2, timeout_seconds=10.0, error_score=0.0, max_error_fraction=0.5)
    monkeypatch.setenv(URLS_ENV, ",".join(r.url for r in replicas))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    reward = TextReward(spec)  # the file is not on this machine: nothing here loads or runs it
    assert isinstance(reward.function, RemoteRewardFunction)
    assert reward.score(*_batch(3)).scores == [0.0, 1.0, 0.0]


def test_a_pool_replica_without_the_whole_sandbox_refuses_to_start_when_required(tmp_path, monkeypatch, capsys):
    """`hybridflow environments serve` where the pod lacks a layer (a default cluster's seccomp refuses user
    namespaces) and HYBRIDFLOW_SANDBOX=require: exit EXIT_SANDBOX_UNAVAILABLE, naming the layers and the way out,
    before anything is served (the operator fails the job with this message)."""
    import json

    import yaml

    from hybridflow import cli, sandbox
    from hybridflow.api import EXIT_SANDBOX_UNAVAILABLE

    doc = yaml.safe_load((REPO / "examples" / "smollm2-arithmetic.yaml").read_text())
    doc["spec"]["rollout"]["agent"] = {"environment": "guess_number"}
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(doc))
    partial = sandbox.Layers(None, how="no bwrap", missing=(("network", "bwrap: No permissions to create a new "
                                                                        "namespace"),))
    monkeypatch.setattr(sandbox, "probe", lambda *a, **k: partial)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv(sandbox.REQUIRE_ENV, "require")
    assert cli.main(["environments", "serve", "--spec", str(spec), "--port", "0"]) == EXIT_SANDBOX_UNAVAILABLE
    err = capsys.readouterr().err
    assert "network (bwrap: No permissions" in err and "spec.sandbox.runtimeClassName" in err


def test_the_job_learns_which_layers_its_pool_lacks_and_only_with_its_token():
    missing = [["network", "bwrap: No permissions to create a new namespace"], ["user", "no user namespace"]]
    server = PoolServer(PoolService(None, None, layers={"how": "no bwrap", "missing": missing}), TOKEN)
    server.start()
    try:
        assert PoolClient([server.url], TOKEN).missing_layers() == (dict(missing), 1)
        with pytest.raises(PoolError, match="refused the job's sandbox token"):
            PoolClient([server.url], "not-the-token").missing_layers()
        gone = PoolClient([server.url, "http://127.0.0.1:9"], TOKEN)  # a replica not up yet tells nothing
        assert gone.missing_layers(timeout=2) == (dict(missing), 1)
    finally:
        server.stop()


def test_a_split_pool_scores_rewards_only_on_the_replicas_set_apart(replicas, tmp_path, monkeypatch):
    """N2: where the operator sets reward functions apart from the model's code (a partial sandbox), the gang
    scores on the reward replicas (HYBRIDFLOW_REWARD_URLS) and a replica serving the agent refuses to score."""
    spec = SimpleNamespace(type="function", function=SimpleNamespace(path="reward.py", name="compute_score",
                                                                      batched=False),
                           scorers=[], workers=1, timeout_seconds=10.0, error_score=0.0, max_error_fraction=0.5)
    agents_only = PoolServer(PoolService(None, None, serves="agents"), TOKEN)
    agents_only.start()
    try:
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        monkeypatch.setenv(URLS_ENV, agents_only.url)
        with pytest.raises(PoolError, match="serves agents only, not reward functions"):
            TextReward(spec).score(*_batch(2))
        monkeypatch.setenv(REWARD_URLS_ENV, replicas[0].url)
        assert TextReward(spec).score(*_batch(3)).scores == [0.0, 1.0, 0.0]
    finally:
        agents_only.stop()


def test_a_replica_set_apart_builds_only_its_half_of_the_jobs_code(tmp_path):
    """`hybridflow environments serve --serves`: an agents replica builds no reward workers (the reward file is not
    even mounted there), a rewards replica builds no agent and does not need the environment file."""
    import yaml

    from hybridflow.api import SpecError, parse_job
    from hybridflow.cli.pool_replica import replica_halves

    doc = yaml.safe_load((REPO / "examples" / "smollm2-arithmetic.yaml").read_text())
    doc["spec"]["rollout"]["agent"] = {"environmentFile": str(tmp_path / "absent_env.py"), "environmentClass": "E"}
    doc["spec"]["models"]["reward"] = {"type": "function", "function": {"path": "reward.py"}}
    job = parse_job(doc)
    agent, function = replica_halves(job, "job.yaml", "rewards")
    assert agent is None and function is not None and function.path == "reward.py"
    with pytest.raises(SpecError, match="environmentFile: .*absent_env.py: no such file here"):
        replica_halves(job, "job.yaml", "agents")
    with pytest.raises(SpecError, match="environmentFile"):
        replica_halves(job, "job.yaml", "all")
    (tmp_path / "absent_env.py").write_text("class E:\n    pass\n")
    agent, function = replica_halves(job, "job.yaml", "agents")
    assert agent is not None and function is None
