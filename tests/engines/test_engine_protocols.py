"""Conformance: every registered engine of each kind (hybridflow.api.engines: TRAIN_ENGINES, ROLLOUT_ENGINES)
implements the whole Protocol of its kind with the Protocol's signatures, and its module's `build` has the kind's
one factory signature, so roles build and call any of them without probing (no hasattr) and without asking which
they hold. The engines are enumerated from the registries: a kind registered later is checked with no change here.

And adding a generation engine is one module plus its registration: a minimal one, written by the test into its
own directory, goes through the same checks and through one `hybridflow run` step."""
import ast
import inspect
import json
import os
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import yaml
from support.paths import ROOT

from hybridflow.api import engines as registry
from hybridflow.api.engines import ROLLOUT_ENGINES, TRAIN_ENGINES, RolloutEngineKind
from hybridflow.engines.rollout.base import RolloutEngine, RolloutEngineFactory
from hybridflow.engines.train.base import ModelParallelTrainEngine, TrainEngine, TrainEngineFactory

WORKERS = ROOT / "workers" / "hybridflow"


def _protocol_methods(proto: type = RolloutEngine) -> dict[str, typing.Callable]:
    """The methods a Protocol declares, its Protocol bases' included."""
    out: dict[str, typing.Callable] = {}
    for cls in reversed(proto.__mro__):
        if getattr(cls, "_is_protocol", False) and cls is not typing.Protocol:
            out.update({n: f for n, f in vars(cls).items() if callable(f) and not n.startswith("_")})
    return out


def _protocol_attributes(proto: type) -> set[str]:
    return {n for cls in proto.__mro__ if getattr(cls, "_is_protocol", False) and cls is not typing.Protocol
            for n in vars(cls).get("__annotations__", {})}


def _assigned_in_init(engine: type) -> set[str]:
    """The attributes `__init__` assigns on self (`self.x = ...`, `self.x: T = ...`), read from its syntax tree:
    a name in a comment or a string does not count."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(engine.__init__)))
    targets = [t for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    return {t.attr for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _has_attribute(engine: type, name: str) -> bool:
    """Set by `__init__`, or given by the class (a default, or a property) or one of its bases."""
    return name in _assigned_in_init(engine) or any(name in vars(c) for c in engine.__mro__ if c is not object)


def _engine_class(factory: typing.Callable) -> type:
    """What a kind's factory builds: its return annotation (a class; the Protocol is what it must satisfy)."""
    built = typing.get_type_hints(factory)["return"]
    assert inspect.isclass(built) and not getattr(built, "_is_protocol", False), \
        f"{factory.__module__}.build must name the engine class it returns, not {built}"
    return built


def check_conforms(engine: type, proto: type) -> None:
    for name, declared in _protocol_methods(proto).items():
        implemented = getattr(engine, name, None)
        assert implemented is not None, f"{engine.__name__} lacks {name}"
        want = list(inspect.signature(declared).parameters)
        got = list(inspect.signature(implemented).parameters)
        assert got == want, f"{engine.__name__}.{name}{got} differs from the Protocol's {want}"
    for name in _protocol_attributes(proto):
        assert _has_attribute(engine, name), f"{engine.__name__} never sets self.{name}"


def check_factory(factory: typing.Callable, proto_factory: type) -> None:
    """`build` takes exactly the factory Protocol's parameters, with its types."""
    want = dict(list(inspect.signature(proto_factory.__call__).parameters.items())[1:])  # without self
    got = inspect.signature(factory).parameters
    assert list(got) == list(want), f"{factory.__module__}.build{list(got)} is not the common {list(want)}"
    want_types = typing.get_type_hints(proto_factory.__call__)
    got_types = typing.get_type_hints(factory)
    for name in want:
        assert got_types.get(name) == want_types[name], f"{factory.__module__}.build: {name} is {got_types.get(name)}"


def _train_protocol(name: str) -> type:
    return ModelParallelTrainEngine if TRAIN_ENGINES[name].model_parallel else TrainEngine


def test_the_protocol_declares_what_the_actor_uses():
    assert set(_protocol_methods()) == {"generate", "load_weights", "load_adapter", "release", "weight_checksums"}


def _engine_uses(path: Path, names: tuple[str, ...] = ("engine",)) -> set[str]:
    """Attributes read off a training engine in a module: `self.engine.x`, or `x` of a parameter named `engine`."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Attribute) and v.attr in names and isinstance(v.value, ast.Name)
                and v.value.id == "self") or (isinstance(v, ast.Name) and v.id in names):
            used.add(node.attr)
    return used


def test_the_train_protocol_declares_everything_roles_checkpoints_and_the_bridge_use():
    """The Protocol is complete: whatever the roles and the checkpoint role side call on `self.engine` is declared
    on TrainEngine, whatever the 3D-HybridEngine transfer calls on a model-parallel engine on its sub-Protocol."""
    declared = set(_protocol_methods(TrainEngine)) | _protocol_attributes(TrainEngine)
    users = [*sorted((WORKERS / "roles").glob("*.py")), WORKERS / "checkpoint" / "role.py"]
    for path in users:
        assert _engine_uses(path) <= declared, f"{path.name} uses {_engine_uses(path) - declared} undeclared"
    assert _engine_uses(WORKERS / "roles" / "actor.py") >= {"log_probs", "entropy", "forward_micro", "ppo_update"}
    mp = set(_protocol_methods(ModelParallelTrainEngine)) | _protocol_attributes(ModelParallelTrainEngine)
    transfer = _engine_uses(WORKERS / "engines" / "bridge" / "transfer.py")
    assert transfer and transfer <= mp, transfer - mp


@pytest.mark.parametrize("kind", TRAIN_ENGINES.names())
def test_every_registered_training_engine_implements_the_whole_protocol(kind):
    factory = TRAIN_ENGINES[kind].load()
    check_factory(factory, TrainEngineFactory)
    check_conforms(_engine_class(factory), _train_protocol(kind))


@pytest.mark.parametrize("kind", ROLLOUT_ENGINES.names())
def test_every_registered_generation_engine_implements_the_whole_protocol(kind):
    factory = ROLLOUT_ENGINES[kind].load()
    check_factory(factory, RolloutEngineFactory)
    check_conforms(_engine_class(factory), RolloutEngine)
    assert "instance_id" in _assigned_in_init(_engine_class(factory))


def test_a_protocol_mismatch_is_caught():
    class Short:
        def __init__(self):
            self.instance_id = "x"

        def generate(self, prompts):  # the Protocol's takes cfgs too
            return []

    with pytest.raises(AssertionError, match="differs from the Protocol"):
        check_conforms(Short, RolloutEngine)

    def build(ctx, config):  # a factory with another signature
        return None

    with pytest.raises(AssertionError, match="is not the common"):
        check_factory(build, RolloutEngineFactory)


def test_only_a_real_assignment_counts_as_setting_an_attribute():
    class Commented:
        def __init__(self):
            self.other = "instance_id"  # instance_id

    class Sets:
        def __init__(self):
            self.instance_id: str = "x"

    assert "instance_id" not in _assigned_in_init(Commented) and "instance_id" in _assigned_in_init(Sets)


# --- a generation engine added from outside: one module plus its registration -----------------------------------

PLUGIN = "random_tokens_engine"
PLUGIN_SOURCE = '''
"""A minimal generation engine: uniformly random tokens from the model's vocabulary, seeded per replica. It keeps
no model; the weights the actor pushes are counted and the embedding's sum kept, so a transition is visible."""
from __future__ import annotations

import json
import os
import random
import uuid
from typing import Iterable, Sequence

import torch

from hybridflow.single_controller.context import WorkerContext
from hybridflow.engines.rollout.base import Generation, RolloutSetup, SamplingConfig


class RandomTokens:
    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)
        self.instance_id = uuid.uuid4().hex
        self.embedding = float("nan")

    def generate(self, prompts: list[list[int]], cfgs: Sequence[SamplingConfig]) -> list[Generation]:
        out = []
        for _, cfg in zip(prompts, cfgs):
            tokens = [self.rng.randrange(self.vocab) for _ in range(cfg.max_tokens)]
            out.append(Generation(tokens, [-1.0] * len(tokens) if cfg.log_probs else []))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            if "embed_tokens" in name:
                self.embedding = float(tensor.double().sum())

    def load_adapter(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """No model, so no adapter: counted as taken."""
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def release(self) -> None:
        """Nothing held."""

    def weight_checksums(self) -> dict[str, float]:
        return {"embedding": self.embedding}


def build(ctx: WorkerContext, setup: RolloutSetup) -> RandomTokens:
    vocab = json.loads((setup.model_dir / "config.json").read_text())["vocab_size"]
    return RandomTokens(vocab, setup.seed)
'''


@pytest.fixture
def plugin_engine(tmp_path, monkeypatch):
    """The module on this process's path and on the Ray workers' (they inherit PYTHONPATH), registered for the
    length of the test; the registry is as before afterwards (the CRD's enum is generated from it)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in (str(plugins), os.environ.get("PYTHONPATH"))
                                              if p))
    monkeypatch.setattr(ROLLOUT_ENGINES, "_entries", dict(ROLLOUT_ENGINES._entries))
    monkeypatch.setattr(ROLLOUT_ENGINES, "_info", dict(ROLLOUT_ENGINES._info))
    registry.register_rollout_engine(RolloutEngineKind("random", f"{PLUGIN}:build", "random tokens (a test)"))
    yield "random"
    sys.modules.pop(PLUGIN, None)  # imported from tmp_path: gone with it (test_environment checks every module)


@pytest.mark.slow  # starts Ray: about 10 s on a 2-core machine, most of it Ray and worker start-up
def test_a_generation_engine_registered_from_a_test_conforms_and_runs_a_step(plugin_engine, tmp_path, model_cache,
                                                                             ray_tmp, monkeypatch):
    from hybridflow import cli
    from hybridflow.checkpoint import read_step_log

    assert plugin_engine in ROLLOUT_ENGINES.names()
    factory = ROLLOUT_ENGINES[plugin_engine].load()
    check_factory(factory, RolloutEngineFactory)
    check_conforms(_engine_class(factory), RolloutEngine)

    monkeypatch.setenv("HYBRIDFLOW_MODEL_CACHE", str(model_cache))
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "run"
    doc = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    s = doc["spec"]  # the example on one rank with few prompts: one step in seconds
    s["resourcePools"][0]["devicesPerNode"] = 1
    s["data"].update(trainPrompts=16, evalPrompts=2)
    s["rollout"]["responsesPerPrompt"] = 2
    s["trainer"]["promptsPerStep"] = 4
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    # the CLI's --engine choices come from the registry, so the new kind is one of them
    code = cli.main(["run", str(job), "--engine", plugin_engine, "--steps", "1",
                     "--checkpoint-dir", str(ckpt), "--metrics-port", "0", "--ray-temp-dir", ray_tmp, "-q"])
    assert code == 0
    [record] = read_step_log(ckpt)
    assert record["step"] == 1 and record["stages"]["actor_update"] > 0 and record["stages"]["reshard"] > 0
    assert json.loads((ckpt / "summary.json").read_text())["steps_done"] == 1
