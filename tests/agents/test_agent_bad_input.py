"""Bad input II (issue 56): what a user's tools file and environment can get wrong is refused before any work, naming
the field, the file and the line (`validate` and `run` load them in the sandbox as their workers will), and what only
shows while the job runs (an environment whose steps fail, a tool that crashes, a non-finite reward) is counted per
step, printed on the console, and stops the job past spec.rollout.agent.maxFailedFraction. No Ray, no model."""
import itertools
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from support.jobs import run_cli
from support.paths import ROOT
from support.agent_doubles import CharCodec

from hybridflow.agents import file_check, local, remote
from hybridflow.agents.file_check import loaded_file_problems
from hybridflow.agents.local import EnvironmentCode, LocalSessions, LocalTools
from hybridflow.agents.places import job_tools
from hybridflow.agents.protocol import Places
from hybridflow.agents.registry import TOOLS
from hybridflow.agents.remote import RemoteSessions, RemoteTools
from hybridflow.agents.tool_file import ToolFileError, read_tools_file
from hybridflow.api import RLHFJob
from hybridflow.api.agents import Agent
from hybridflow.data.tasks import Sample
from hybridflow.roles.episodes import EpisodeRunner
from hybridflow.roles.rollout import _Generator
from hybridflow.single_controller.batch import Batch
from hybridflow.sandbox_pool import Unreachable
from hybridflow.trainer.episodes import AgentFailure, EpisodeFailures
from hybridflow.trainer.loop import evaluate
from hybridflow.trainer.preflight import check_runtime_paths
from hybridflow.trainer.generation.rollouts import Rollouts
from hybridflow.trainer.task import Reward, prompt_batch
from hybridflow.trainer.step import AlgorithmState, Step, generation_rows, skipped_stages
from hybridflow.trainer.generation.weight_sync import ColocatedWeightSync

GOOD_ENV = '''class Environment:
    def reset(self, sample):
        self.n = 0
        return "go"

    def step(self, action):
        self.n += 1
        return "more", 0.5, self.n >= 2, {}
'''


def _write(path, text):
    path.write_text(text)
    return path


def _job(tmp_path, **agent):
    return RLHFJob.model_validate({"spec": {"models": {"actor": {"source": "smollm2"}}, "data": {"task": "products"},
                                            "rollout": {"agent": agent, "maxPromptLength": 8,
                                                        "maxResponseLength": 200},
                                            "trainer": {"checkpointDir": str(tmp_path / "ckpt")}}})


# -- before any work: the files, read and then loaded in the sandbox -------------------------------------------------

def test_a_tool_annotated_outside_the_documented_types_is_refused_naming_the_parameter_and_line(tmp_path):
    f = _write(tmp_path / "tools.py", 'import decimal\n\n\ndef pay(to: str,\n        amount: decimal.Decimal):\n'
                                      '    """Pays."""\n')
    with pytest.raises(ToolFileError, match=r"tools.py:5: tool 'pay': parameter 'amount' is annotated "
                                            r"decimal.Decimal; use one of str, int, float, bool, list, dict"):
        read_tools_file(f)
    quoted = _write(tmp_path / "q.py", 'def f(x: "Decimal"):\n    "doc"\n')
    with pytest.raises(ToolFileError, match=r"q.py:1: tool 'f': parameter 'x' is annotated Decimal"):
        read_tools_file(quoted)
    fine = _write(tmp_path / "ok.py", 'from typing import Optional\n\ndef f(a: list[str], b: "int", c: int | None = '
                                      'None, d: Optional[dict] = None, *, e: dict[str, int] = None):\n    "doc"\n')
    props = read_tools_file(fine)["f"].parameters["properties"]
    assert props == {"a": {"type": "array"}, "b": {"type": "integer"}, "c": {"type": "integer"},
                     "d": {"type": "object"}, "e": {"type": "object"}}
    problems = check_runtime_paths(_job(tmp_path, toolsFile=str(f)))
    assert problems == [f"spec.rollout.agent.toolsFile: {f}:5: tool 'pay': parameter 'amount' is annotated "
                        "decimal.Decimal; use one of str, int, float, bool, list, dict (or list[...], dict[...], "
                        "X | None), or no annotation"]


@pytest.mark.parametrize("source, refused", [
    ('def calculator(expression: str):\n    "Mine."\n', r"t.py:1: tool 'calculator' has the name of the built-in"),
    ('def f(x: str):\n    "One."\n\n\ndef f(y: str):\n    "Two."\n', r"t.py:5: tool 'f' is defined again \(first at "
                                                                      r"line 1\)"),
    ('async def f(x: str):\n    "Async."\n', r"t.py:1: tool 'f' is async"),
    ('def f(x: str, /):\n    "Positional."\n', r"t.py:1: tool 'f': parameter 'x' is positional-only"),
])
def test_tool_names_clash_with_builtins_or_each_other_and_uncallable_tools_are_refused(tmp_path, source, refused):
    f = _write(tmp_path / "t.py", source)
    agent = Agent.model_validate({"tools": ["calculator"], "toolsFile": str(f)})
    with pytest.raises(ToolFileError, match=refused):
        job_tools(agent)
    (problem,) = check_runtime_paths(_job(tmp_path, tools=["calculator"], toolsFile=str(f)))
    assert problem.startswith(f"spec.rollout.agent.toolsFile: {tmp_path}/t.py:"), problem


@pytest.mark.parametrize("source, cls, problem", [
    ("class Environment:\n    def reset(self, sample):\n        return ''\n", "Environment",
     "env.py:1: class 'Environment' has no method step(action)"),
    (GOOD_ENV, "Game", "env.py: no class 'Game' (spec.rollout.agent.environmentClass) once it has run; the classes it "
                       "defines: Environment"),
    ("class Environment:\n    def reset(self):\n        return ''\n\n    def step(self, action, extra):\n"
     "        return '', 0.0, True, {}\n", "Environment",
     "env.py:2: class 'Environment' has reset(self), but it is called with one argument, reset(sample)"),
    ("class Environment:\n    def __init__(self, level):\n        pass\n\n    def reset(self, sample):\n"
     "        return ''\n\n    async def step(self, action):\n        return '', 0.0, True, {}\n", "Environment",
     "env.py:2: class 'Environment' takes (level), but it is made with no arguments"),
    ("import a_module_the_sandbox_lacks\n" + GOOD_ENV, "Environment",
     "env.py:1: loading it raised ModuleNotFoundError: No module named 'a_module_the_sandbox_lacks'"),
])
def test_an_environment_is_loaded_in_the_sandbox_and_what_cannot_work_names_file_line_and_field(
        tmp_path, source, cls, problem):
    f = _write(tmp_path / "env.py", source)
    assert check_runtime_paths(_job(tmp_path, environmentFile=str(f), environmentClass=cls)) == []  # it parses
    problems = loaded_file_problems(Agent.model_validate({"environmentFile": str(f), "environmentClass": cls}))
    assert any(p.startswith(f"spec.rollout.agent.environmentFile: {tmp_path}/{problem}") for p in problems), problems


def test_loading_runs_in_the_sandbox_not_here_and_a_sound_file_passes(tmp_path):
    marker = tmp_path / "ran-here"
    f = _write(tmp_path / "env.py", f"open({str(marker)!r}, 'w').write('x')\n" + GOOD_ENV)
    problems = loaded_file_problems(Agent.model_validate({"environmentFile": str(f)}))
    assert len(problems) == 1 and "loading it raised" in problems[0], problems  # the sandbox's filesystem is read-only
    assert not marker.exists()
    sound = _write(tmp_path / "sound.py", GOOD_ENV)
    tools = _write(tmp_path / "tools.py", 'def lookup(city: str, days: int = 1):\n    """Weather."""\n'
                                          '    return city\n')
    assert loaded_file_problems(Agent.model_validate({"environmentFile": str(sound), "toolsFile": str(tools)})) == []
    decorated = _write(tmp_path / "deco.py", 'def keyword_only(f):\n    def g(*, other):\n        return other\n'
                                             '    return g\n\n\n@keyword_only\ndef f(x: str):\n    "doc"\n')
    (problem,) = loaded_file_problems(Agent.model_validate({"toolsFile": str(decorated)}))
    assert problem.startswith(f"spec.rollout.agent.toolsFile: {decorated}:8: tool 'f' as loaded takes (*, other)")


def _cli_job(tmp_path, agent):
    doc = yaml.safe_load((ROOT / "examples" / "guess-the-number.yaml").read_text())
    data = _write(tmp_path / "games.jsonl", "".join(json.dumps({"prompt": "play", "secret": i}) + "\n"
                                                    for i in range(16)))
    doc["spec"]["data"].update(train=[str(data)], eval=[str(data)])
    doc["spec"]["rollout"]["agent"] = agent
    doc["spec"]["trainer"]["checkpointDir"] = str(tmp_path / "run")
    doc["spec"]["metrics"]["port"] = 0
    return _write(tmp_path / "job.yaml", yaml.safe_dump(doc))


def test_validate_and_run_exit_2_naming_the_file_line_and_field_before_ray_starts(tmp_path):
    env = _write(tmp_path / "env.py", "class Environment:\n    def reset(self, sample):\n        return ''\n")
    job = _cli_job(tmp_path, {"environmentFile": str(env)})
    out = run_cli(["validate", str(job)], cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"spec.rollout.agent.environmentFile: {env}:1: class 'Environment' has no method step(action)" \
        in out.stderr, out.stderr[-2000:]
    job = _cli_job(tmp_path, {"environmentFile": str(_write(tmp_path / "g.py", GOOD_ENV)), "environmentClass": "Game"})
    out = run_cli(["run", str(job), "--ray-temp-dir", str(tmp_path / "ray")], cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "spec.rollout.agent.environmentFile" in out.stderr and "no class 'Game'" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "ray").exists(), "Ray was started for a job whose environment cannot work"


# -- while it runs: failed episodes, counted per step and bounded ----------------------------------------------------

class EngineDouble:
    """The rollout engine's place: every turn of every episode writes `text` (one character per token, then the
    stop token 0)."""

    def __init__(self, text):
        self.ids = [ord(c) for c in text] + [0]

    def generate(self, contexts, cfgs):
        return [SimpleNamespace(tokens=list(self.ids), log_probs=[]) for _ in contexts]


def _rows(n):
    return Batch({}, {"prompt_ids": [[104, 105]] * n, "truth": [f"secret {i}" for i in range(n)],
                      "data_source": ["games.jsonl"] * n, "extra_info": [{"row": i} for i in range(n)]})


def _generated(tmp_path, places, text="guess", n=4, **agent):
    """A rollout rank's generation of `n` episodes, as the driver receives it (roles.rollout's packing)."""
    job = _job(tmp_path, **agent)
    runner = EpisodeRunner(job.spec.rollout.agent, CharCodec(), places, job.spec.rollout.max_response_length)
    gen = _Generator(EngineDouble(text), SimpleNamespace(rollout=job.spec.rollout, algorithm=job.spec.algorithm),
                     (0,), episodes=runner)
    try:
        return job.spec, gen.packed(_rows(n), greedy=False)
    finally:
        runner.close()


def _step(spec):
    rollouts = Rollouts(spec, None, ColocatedWeightSync(None), lambda: Batch(), generation_rows)
    return Step(spec, {}, {}, {}, AlgorithmState.for_spec(spec), rollouts, skipped_stages(spec))


def _env(tmp_path, body):
    f = _write(tmp_path / "env.py", "class Environment:\n    def reset(self, sample):\n        self.sample = sample\n"
                                    "        return 'go'\n\n" + body)
    return str(f), Places(sessions=LocalSessions(EnvironmentCode.from_file(f, "Environment"), step_timeout_seconds=10))


@pytest.mark.parametrize("body, kind, message", [
    ("    def step(self, action):\n        return 'x', float('nan'), False, {}\n", "environment step",
     "the environment's step raised TypeError: the reward must be a finite number, got nan"),
    ("    def step(self, action):\n        return 'x', 1.0, True, {}\n\n    def reset(self, sample):\n"
     "        raise ValueError('no game in ' + repr(sample['ground_truth']))\n", "environment reset",
     "the environment's reset raised ValueError: no game in 'secret 0' at env.py:10"),
    ("    pass\n", "environment step", "the environment's step raised AttributeError"),
])
def test_an_environment_failing_every_episode_stops_the_job_in_its_first_step_naming_the_first(
        tmp_path, body, kind, message):
    path, places = _env(tmp_path, body)
    spec, generated = _generated(tmp_path, places, environmentFile=path)
    assert list(generated["agent_failure"]) == [kind] * 4
    with pytest.raises(AgentFailure) as err:
        _step(spec).compute(generated)  # the generation's first stage, before anything is trained on it
    text = str(err.value)
    assert text.startswith(f"4 of 4 episodes failed in this step ({kind}: 4), more than "
                           "spec.rollout.agent.maxFailedFraction = 0.5; first: sample 0 (data source 'games.jsonl', "
                           f"ground truth 'secret 0'): {kind}: {message}"), text


def _tool_episodes(tmp_path, source, n=2):
    f = _write(tmp_path / "tools.py", source)
    agent = Agent.model_validate({"toolsFile": str(f), "maxTurns": 2})
    places = Places(tools=LocalTools(job_tools(agent), 5))
    return _generated(tmp_path, places, '<tool_call>{"name": "lookup", "arguments": {"city": "x"}}</tool_call>', n=n,
                      toolsFile=str(f), maxTurns=2)


@pytest.mark.parametrize("source, error", [
    ('def lookup(city: str):\n    """Weather."""\n    return city\n\n\nraise RuntimeError("breaks at import")\n',
     "the tool's code did not load: RuntimeError: breaks at import at tools.py:6"),
    ('def lookup(city: str):\n    """Weather."""\n    return forecast(city)\n', "NameError: name 'forecast' is not "
                                                                             "defined at tools.py:3"),
])
def test_a_tool_that_crashes_fails_its_episodes_and_stops_the_job(tmp_path, source, error):
    spec, generated = _tool_episodes(tmp_path, source)
    assert list(generated["agent_failure"]) == ["tool crash"] * 2
    assert float(generated["agent_turns"][0]) == 2  # a crash fails the episode; the model still read the error
    with pytest.raises(AgentFailure) as err:
        _step(spec).compute(generated)
    assert str(err.value).startswith("2 of 2 episodes failed in this step (tool crash: 2), more than spec.rollout."
                                     "agent.maxFailedFraction = 0.5; first: sample 0 (data source 'games.jsonl', "
                                     f"ground truth 'secret 0'): tool crash: the lookup tool crashed: {error}"), err


def test_a_tool_refusing_the_models_arguments_is_its_answer_not_a_failure(tmp_path):
    spec, generated = _tool_episodes(tmp_path, 'def lookup(city: str):\n    """Weather."""\n    raise ValueError('
                                               '"no such city: " + city)\n')
    assert list(generated["agent_failure"]) == ["", ""] and float(generated["agent_tool_errors"][0]) == 1
    _step(spec).compute(generated)


def test_a_step_with_failures_under_the_bound_prints_one_line_and_goes_on(tmp_path, caplog):
    path, places = _env(tmp_path, "    def step(self, action):\n        bad = self.sample['extra_info']['row'] == 2\n"
                                  "        return 'x', float('inf') if bad else 1.0, True, {}\n")
    spec, generated = _generated(tmp_path, places, environmentFile=path)
    step = _step(spec)
    with caplog.at_level(logging.WARNING, logger="hybridflow"):
        batch = step.compute(generated)
        step.compute(batch)  # a later stage on the same batch counts nothing again
        step.trained = batch.with_columns(scores=batch["env_reward"])
        stats = step.summary()
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridflow.trainer.episodes"]
    assert lines == ["agent: 1 of 4 episodes failed in this step (environment step: 1); first: sample 2 (data source "
                     "'games.jsonl', ground truth 'secret 2'): environment step: the environment's step raised "
                     "TypeError: the reward must be a finite number, got inf"], lines
    assert stats["agent_episodes_failed"] == 1.0
    strict = _step(spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"agent": spec.rollout.agent.
                                   model_copy(update={"max_failed_fraction": 0.2})})}))
    with pytest.raises(AgentFailure, match="1 of 4 episodes failed"):
        strict.compute(Batch(dict(batch.tensors), dict(batch.non_tensors)))  # 25% > maxFailedFraction 0.2


def test_the_held_out_evaluation_stops_before_training_when_every_episode_fails(tmp_path):
    path, places = _env(tmp_path, "    def step(self, action):\n        return 'x', float('nan'), True, {}\n")
    spec, generated = _generated(tmp_path, places, environmentFile=path)
    rollout = SimpleNamespace(dp_sizes={"rollout": 1}, generate=lambda batch, greedy: generated)
    rollout.call = rollout  # the handle as its role's Protocol (RoleHandle.call)
    workers = SimpleNamespace(rollout=rollout, spec=spec, roles={})
    samples = [Sample([104, 105], f"secret {i}", "games.jsonl", {"row": i}) for i in range(4)]
    assert len(prompt_batch(samples)) == 4
    with pytest.raises(AgentFailure, match=r"4 of 4 episodes failed in the held-out evaluation"):
        evaluate(workers, Reward(episode_score="environment"), samples)


def test_max_failed_fraction_is_a_fraction_in_the_spec():
    assert Agent().max_failed_fraction == 0.5
    with pytest.raises(ValueError, match="maxFailedFraction"):
        RLHFJob.model_validate({"spec": {"models": {"actor": {"source": "smollm2"}}, "data": {"task": "products"},
                                         "rollout": {"agent": {"tools": ["calculator"], "maxFailedFraction": 1.5}}}})
    assert np.isclose(Agent.model_validate({"maxFailedFraction": 0}).max_failed_fraction, 0.0)


# -- the sandbox pool's failures are reported, never counted against the bound (review H2) ---------------------------

class PoolDouble:
    """A sandbox pool of one replica whose pod went away (evicted, OOM-killed, drained) or answers errors:
    `answer(method, path)` gives (code, body) or raises Unreachable."""

    def __init__(self, answer):
        self.replicas, self.answer = [SimpleNamespace(url="http://sandbox-0:8080")], answer

    def next_index(self):
        return 0

    def cooling(self, index):
        return False

    def request(self, index, method, path, body, timeout):
        return self.answer(method, path)

    def request_counts(self):
        return {}


def _evicted(method, path):
    raise Unreachable("connection refused")


def _step_expires(method, path, ids=itertools.count()):
    if path == "/v1/sessions":
        return 200, {"session": f"s{next(ids)}", "observation": {"text": "go"}}
    return (410, {"error": "the session expired"}) if path.endswith("/step") else (200, {})


def _refused(method, path):
    return 500, {"error": "no sandbox could start"}


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
GAME = {"environment": "guess_number"}


@pytest.mark.parametrize("places, answer, text, agent, kind", [
    (lambda pool: Places(sessions=RemoteSessions(pool, 5)), _evicted, "guess", GAME, "replica lost"),
    (lambda pool: Places(sessions=RemoteSessions(pool, 5)), _refused, "guess", GAME, "not run"),
    (lambda pool: Places(sessions=RemoteSessions(pool, 5)), _step_expires, "guess", GAME, "sandbox unavailable"),
    (lambda pool: Places(tools=RemoteTools(pool, 5)), _refused, CALL, {"tools": ["calculator"], "maxTurns": 2},
     "sandbox unavailable"),
], ids=["evicted", "open-500", "step-410", "tool-500"])
def test_an_evicted_or_failing_sandbox_replica_is_reported_and_never_stops_the_job(tmp_path, caplog, places, answer,
                                                                                   text, agent, kind):
    spec, generated = _generated(tmp_path, places(PoolDouble(answer)), text, **agent)
    assert list(generated["agent_failure"]) == [kind] * 4
    step = _step(spec)
    with caplog.at_level(logging.WARNING, logger="hybridflow"):
        batch = step.compute(generated)  # every episode failed, none by the user's code: no AgentFailure
        step.trained = batch.with_columns(scores=batch["env_reward"])
        stats = step.summary()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "hybridflow.trainer.episodes"]
    assert line.startswith(f"agent: 4 of 4 episodes failed in this step ({kind}: 4), 4 of them in the sandbox pool, "
                           "not the user's code (not counted against spec.rollout.agent.maxFailedFraction); first: "
                           f"sample 0 (data source 'games.jsonl', ground truth 'secret 0'): {kind}: "), line
    assert "Fix the" not in line
    assert stats["agent_episodes_failed"] == stats["agent_episodes_failed_infrastructure"] == 4.0


def test_an_environment_file_that_kills_its_sandbox_loading_fails_its_resets_counted(tmp_path):
    """The user's file, not the pool: its episodes fail at reset and count against the bound (not "not run")."""
    f = _write(tmp_path / "env.py", "import os\n\nos._exit(3)\n" + GOOD_ENV)
    places = Places(sessions=LocalSessions(EnvironmentCode.from_file(f, "Environment"), step_timeout_seconds=10))
    spec, generated = _generated(tmp_path, places, environmentFile=str(f))
    assert list(generated["agent_failure"]) == ["environment reset"] * 4
    assert "loading the environment's file failed: the worker closed its pipe; it exited with status 3" in \
        generated["agent_error"][0]
    with pytest.raises(AgentFailure, match=r"4 of 4 episodes failed in this step \(environment reset: 4\)"):
        _step(spec).compute(generated)


def _failures(kinds):
    errors = np.array(["boom" if k else "" for k in kinds], dtype=object)
    return Batch({}, {"agent_error": errors, "agent_failure": np.array(kinds, dtype=object),
                      "truth": [f"secret {i}" for i in range(len(kinds))], "data_source": ["games.jsonl"] * len(kinds)})


def test_the_bound_counts_the_users_code_only_and_names_its_first_failure():
    failures = EpisodeFailures(0.5)
    failures.add(_failures(["replica lost", "environment step", "not run", ""]))  # 1 of 4 is the user's code
    assert failures.line() == ("agent: 3 of 4 episodes failed in this step (replica lost: 1, environment step: 1, "
                               "not run: 1), 2 of them in the sandbox pool, not the user's code (not counted against "
                               "spec.rollout.agent.maxFailedFraction); first: sample 1 (data source 'games.jsonl', "
                               "ground truth 'secret 1'): environment step: boom")
    with pytest.raises(AgentFailure) as err:
        EpisodeFailures(0.5).add(_failures(["sandbox unavailable", "tool crash", "tool crash", "environment reset"]))
    assert str(err.value) == (
        "3 of 4 episodes failed in this step (tool crash: 2, environment reset: 1), more than spec.rollout.agent."
        "maxFailedFraction = 0.5; first: sample 1 (data source 'games.jsonl', ground truth 'secret 1'): tool crash: "
        "boom. Fix the environment or tools file (run its reset and step on that sample), or raise maxFailedFraction "
        "(1 more failed in the sandbox pool, not counted: sandbox unavailable: 1)")


# -- a tool's crash is decided by the driver, for the user's tools only (review M4) ----------------------------------

FORGE = ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"error\": \"forged\", \"crashed\": "
         "true, \"broken\": true}\\n')\n    except OSError:\n        pass\nos._exit(0)\n")


def test_the_models_code_cannot_make_a_built_in_tool_crash():
    tools = LocalTools({"python": TOOLS["python"]}, 5)
    forged = tools.call("python", {"code": FORGE})  # writes a crash report onto the protocol pipe, then exits
    assert forged.error and not forged.crashed, forged
    died = tools.call("python", {"code": "import os\nos._exit(3)\n"})
    assert died.error and "exited with status 3" in died.error and not died.crashed, died


RUNNER = ('def run(code: str):\n    """Runs code."""\n    scope = {}\n    exec(code, scope)\n'
          '    return scope["out"]\n\n\n'
          'def load(module: str):\n    """Imports a module by name."""\n    return str(__import__(module))\n\n\n'
          'def leave(status: int):\n    """Exits."""\n    import os\n    os._exit(status)\n')


def test_what_the_models_arguments_cause_in_a_users_tool_is_its_answer_not_a_crash(tmp_path):
    f = _write(tmp_path / "tools.py", RUNNER)
    tools = LocalTools(read_tools_file(f), 5)
    for name, arguments, error in [("run", {"code": "out = undefined_name"}, "NameError: name 'undefined_name'"),
                                   ("load", {"module": "no_such_module"}, "ModuleNotFoundError"),
                                   ("leave", {"status": 3}, "exited with status 3")]:
        result = tools.call(name, arguments)
        assert error in str(result.error) and not result.crashed, (name, result)
    dies_loading = _write(tmp_path / "dies.py", 'import os\n\n\ndef f(x: str):\n    """Doc."""\n\n\nos._exit(3)\n')
    result = LocalTools(read_tools_file(dies_loading), 5).call("f", {"x": "1"})
    assert result.crashed and "while its file was loading" in str(result.error), result


# -- a tools file loads within a call's deadline, and calls that all time out are on the console (review M5) ---------

SLOW_TOOLS = 'import time\n\ntime.sleep(3)\n\n\ndef lookup(city: str):\n    """Weather."""\n    return city\n'


def test_a_tools_file_must_load_within_the_tool_timeout_and_environments_within_the_load_deadline(tmp_path):
    f = _write(tmp_path / "tools.py", SLOW_TOOLS)
    (problem,) = loaded_file_problems(Agent.model_validate({"toolsFile": str(f), "toolTimeoutSeconds": 1}))
    assert problem == (f"spec.rollout.agent.toolsFile: {f}: loading it in the sandbox took more than 1 s (spec.rollout."
                       "agent.toolTimeoutSeconds, the deadline of each call, which loads the file and then runs the "
                       "tool); what its top level runs must end sooner"), problem
    assert file_check.LOAD_SECONDS is local.LOAD_SECONDS and remote.LOAD_SECONDS is local.LOAD_SECONDS


def test_a_step_whose_tool_calls_all_time_out_prints_one_line(tmp_path, caplog):
    f = _write(tmp_path / "tools.py", SLOW_TOOLS)
    agent = Agent.model_validate({"toolsFile": str(f), "maxTurns": 2, "toolTimeoutSeconds": 1})
    spec, generated = _generated(tmp_path, Places(tools=LocalTools(job_tools(agent), 1)),
                                 '<tool_call>{"name": "lookup", "arguments": {"city": "x"}}</tool_call>', n=2,
                                 toolsFile=str(f), maxTurns=2, toolTimeoutSeconds=1)
    assert list(generated["agent_tool_timeouts"]) == [1.0, 1.0] and list(generated["agent_failure"]) == ["", ""]
    step = _step(spec)
    with caplog.at_level(logging.WARNING, logger="hybridflow"):
        batch = step.compute(generated)
        step.trained = batch.with_columns(scores=batch["env_reward"])
        step.summary()
    lines = [r.getMessage() for r in caplog.records if r.name == "hybridflow.trainer.episodes"]
    assert lines == ["agent: all 2 tool calls in this step timed out (spec.rollout.agent.toolTimeoutSeconds = 1 s): a "
                     "call loads the tools file and runs the tool within it; make the file's top level or the tool "
                     "faster, or raise toolTimeoutSeconds"], lines
    result = LocalTools(job_tools(agent), 1).call("lookup", {"city": "x"})
    assert result.timed_out and "(its file was still loading)" in result.text and not result.crashed, result


# -- messages and annotations (review L4, L5) -------------------------------------------------------------------------

def test_a_reward_function_that_does_not_load_is_user_code_not_the_agents(tmp_path):
    from hybridflow.api import SpecError
    from hybridflow.cli import _refuse_unloadable_code

    reward = _write(tmp_path / "reward.py", "import a_module_the_sandbox_lacks\n\ndef compute_score(data_source, "
                                            "solution_str, ground_truth, extra_info):\n    return 1.0\n")
    job = RLHFJob.model_validate({"spec": {"models": {"actor": {"source": "smollm2"}, "reward": {"function": {
        "path": str(reward)}}}, "data": {"task": "products"}, "trainer": {"checkpointDir": str(tmp_path / "c")}}})
    with pytest.raises(SpecError) as err:
        _refuse_unloadable_code(job, "job.yaml")
    assert str(err.value).startswith("job.yaml: its user code cannot work\n  spec.models.reward.function: "), err.value


def test_typing_spellings_of_the_documented_types_are_accepted_alike(tmp_path):
    f = _write(tmp_path / "t.py", "import typing\nimport typing as t\nfrom typing import List, Optional, Union\n\n\n"
                                  "def f(a: typing.Optional[int], b: Union[str, None], c: typing.List[str], "
                                  "d: t.Dict[str, int], e: typing.Union[None, float], g: List, h: Optional[List[int]],"
                                  " i: 'typing.Optional[bool]'):\n    \"doc\"\n")
    props = read_tools_file(f)["f"].parameters["properties"]
    assert props == {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "array"},
                     "d": {"type": "object"}, "e": {"type": "number"}, "g": {"type": "array"}, "h": {"type": "array"},
                     "i": {"type": "boolean"}}
    for refused in ("Union[int, str]", "typing.Union[int, str, None]", "typing.Decimal", "t.Optional[decimal]"):
        bad = _write(tmp_path / "b.py", f"import typing\n\n\ndef f(x: {refused}):\n    'doc'\n")
        with pytest.raises(ToolFileError, match=r"parameter 'x' is annotated"):
            read_tools_file(bad)
