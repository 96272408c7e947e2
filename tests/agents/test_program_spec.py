"""spec.rollout.agent.program (bring your own agent over an OpenAI-compatible endpoint): what the spec accepts beside
it, its score, where it runs with a sandbox pool (Kubernetes), and the checks before any work (issue 56's
standard): `validate` and `run` load the program in the sandbox and a program that cannot work is a problem naming
the field, the file and the line."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from support.jobs import run_cli
from support.paths import ROOT

from hybridflow.agents import places
from hybridflow.agents.file_check import loaded_file_problems
from hybridflow.agents.program import LocalPrograms
from hybridflow.api import RLHFJob
from hybridflow.api.agents import Agent
from hybridflow.agents.protocol import Listen
from hybridflow.agents.remote_programs import RemotePrograms
from hybridflow.sandbox_pool import ENDPOINT_PORTS_ENV, POD_IP_ENV, TOKEN_ENV, URLS_ENV
from hybridflow.trainer.preflight import check_runtime_paths

GOOD = "async def run(client, sample):\n    return 1.0\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def _job(tmp_path: Path, **agent: object) -> RLHFJob:
    return RLHFJob.model_validate({"spec": {"models": {"actor": {"source": "smollm2"}}, "data": {"task": "products"},
                                            "rollout": {"agent": agent, "maxPromptLength": 8,
                                                        "maxResponseLength": 200},
                                            "trainer": {"checkpointDir": str(tmp_path / "ckpt")}}})


def test_a_program_is_an_agent_alone_scored_by_its_reward(tmp_path: Path) -> None:
    prog = str(_write(tmp_path / "agent.py", GOOD))
    agent = _job(tmp_path, program=prog).spec.rollout.agent
    assert agent is not None
    assert (agent.episode_score, agent.has_environment, agent.program_timeout_seconds, agent.trajectory) == \
        ("environment", False, 300.0, "merged")
    for field, value in (("tools", ["calculator"]), ("toolsFile", prog), ("environment", "guess_number"),
                         ("environmentFile", prog)):
        with pytest.raises(ValidationError, match=f"spec.rollout.agent.program and spec.rollout.agent.{field} are "
                                                  "both set"):
            _job(tmp_path, program=prog, **{field: value})
    for score in ("reward", "both"):
        with pytest.raises(ValidationError, match=f"score: {score} with program"):
            _job(tmp_path, program=prog, score=score)
    assert _job(tmp_path, program=prog, score="environment").spec.rollout.agent.episode_score == "environment"


def test_a_greedy_baseline_refuses_one_sequence_per_call(tmp_path: Path) -> None:
    prog = str(_write(tmp_path / "agent.py", GOOD))
    remax = {"algorithm": {"name": "remax"}}
    with pytest.raises(ValidationError, match="per_call makes an episode several sequences, and remax's greedy"):
        RLHFJob.model_validate({"spec": {**_job(tmp_path, program=prog, trajectory="per_call").spec.model_dump(
            by_alias=True, exclude_unset=True), **remax}})
    assert RLHFJob.model_validate({"spec": {**_job(tmp_path, program=prog).spec.model_dump(
        by_alias=True, exclude_unset=True), **remax}}).spec.rollout.agent.trajectory == "merged"


def test_with_a_sandbox_pool_the_program_runs_there_and_the_endpoint_listens_on_the_pods_address(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prog = str(_write(tmp_path / "agent.py", GOOD))
    for name, value in ((URLS_ENV, "http://env-0.j-env.ns.svc:8100"), (TOKEN_ENV, "t" * 16),
                        (POD_IP_ENV, "10.1.2.3"), (ENDPOINT_PORTS_ENV, "8400-8463")):
        monkeypatch.setenv(name, value)
    got = places.job_places(Agent.model_validate({"program": prog}))
    assert isinstance(got.programs, RemotePrograms) and got.tools is None and got.sessions is None
    assert got.listen == Listen("10.1.2.3", (8400, 8463))
    monkeypatch.setenv(ENDPOINT_PORTS_ENV, "8400-")
    with pytest.raises(ValueError, match=ENDPOINT_PORTS_ENV):
        places.job_places(Agent.model_validate({"program": prog}))
    monkeypatch.delenv(URLS_ENV)  # no pool: this machine's sandboxes, the endpoint on its Unix socket alone
    local = places.job_places(Agent.model_validate({"program": prog}))
    assert isinstance(local.programs, LocalPrograms) and local.listen is None


def test_local_places_run_the_program(tmp_path: Path) -> None:
    prog = _write(tmp_path / "agent.py", GOOD)
    got = places.local_places(Agent.model_validate({"program": str(prog)}))
    assert got.tools is None and got.sessions is None and isinstance(got.programs, LocalPrograms)
    assert got.programs.path == str(prog.resolve())


@pytest.mark.parametrize("source, problem", [
    ("async def plan(client, sample):\n    return 0\n",
     "agent.py: defines no `async def run(client, sample)` once it has run; its functions: plan"),
    ("import asyncio\n\n\ndef run(client, sample):\n    return 0\n",
     "agent.py:4: run is a plain function; it must be `async def run(client, sample)`"),
    ("async def run(client):\n    return 0\n",
     "agent.py:1: run takes (client), but it is called as run(client, sample)"),
    ("x = 1\nimport a_module_the_sandbox_lacks\n",
     "agent.py:2: loading it raised ModuleNotFoundError: No module named 'a_module_the_sandbox_lacks'"),
    ("run = 3\n", "agent.py:1: run is int, not `async def run(client, sample)`"),
])
def test_a_program_that_cannot_work_names_field_file_and_line(tmp_path: Path, source: str, problem: str) -> None:
    prog = _write(tmp_path / "agent.py", source)
    assert check_runtime_paths(_job(tmp_path, program=str(prog))) == []  # it parses
    (got,) = loaded_file_problems(Agent.model_validate({"program": str(prog)}))
    assert got.startswith(f"spec.rollout.agent.program: {tmp_path}/{problem}"), got


def test_a_sound_program_passes_and_a_missing_or_broken_one_is_static(tmp_path: Path) -> None:
    sound = _write(tmp_path / "agent.py", "import openai\n\n\nasync def run(client, sample, *, retries=2):\n"
                                          "    return {'reward': 0}\n")
    assert loaded_file_problems(Agent.model_validate({"program": str(sound)})) == []
    assert check_runtime_paths(_job(tmp_path, program=str(tmp_path / "nope.py"))) == [
        f"spec.rollout.agent.program: {tmp_path}/nope.py: agent program not found; fix the path"]
    broken = _write(tmp_path / "broken.py", "async def run(client, sample)\n    return 1\n")
    assert check_runtime_paths(_job(tmp_path, program=str(broken))) == [
        f"spec.rollout.agent.program: {broken}:1: syntax error: expected ':'"]


def test_validate_exits_2_naming_the_program_before_any_work(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "smollm2-calculator.yaml").read_text())
    prog = _write(tmp_path / "agent.py", "def run(client, sample):\n    return 1\n")
    doc["spec"]["rollout"]["agent"] = {"program": str(prog)}
    doc["spec"]["trainer"]["checkpointDir"] = str(tmp_path / "run")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = run_cli(["validate", str(job)], cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"spec.rollout.agent.program: {prog}:1: run is a plain function" in out.stderr, out.stderr[-2000:]
