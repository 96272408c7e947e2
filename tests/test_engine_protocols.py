"""Every generation engine implements the whole RolloutEngine Protocol with the same signatures, so the actor calls
them without probing (no hasattr)."""
import ast
import inspect
import textwrap

import pytest

from hybridflow.engines.rollout import HFRollout, RolloutEngine, VLLMRollout


def _engines():
    from hybridflow.engines.megatron_rollout import MegatronRollout

    return [VLLMRollout, HFRollout, MegatronRollout]


def _protocol_methods():
    return {n: f for n, f in vars(RolloutEngine).items() if callable(f) and not n.startswith("_")}


def test_the_protocol_declares_what_the_actor_uses():
    assert set(_protocol_methods()) == {"generate", "load_weights", "release", "weight_checksums"}


@pytest.mark.parametrize("engine", _engines(), ids=lambda c: c.__name__)
def test_engine_implements_the_whole_rollout_protocol(engine):
    for name, declared in _protocol_methods().items():
        implemented = getattr(engine, name, None)
        assert implemented is not None, f"{engine.__name__} lacks {name}"
        want = list(inspect.signature(declared).parameters)
        got = list(inspect.signature(implemented).parameters)
        assert got == want, f"{engine.__name__}.{name}{got} differs from the Protocol's {want}"
    assert "instance_id" in _assigned_in_init(engine), f"{engine.__name__}.__init__ never sets self.instance_id"


def _assigned_in_init(engine: type) -> set[str]:
    """The attributes `__init__` assigns on self (`self.x = ...`, `self.x: T = ...`), read from its syntax tree:
    a name in a comment or a string does not count."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(engine.__init__)))
    targets = [t for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    return {t.attr for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_only_a_real_assignment_counts_as_setting_an_attribute():
    class Commented:
        def __init__(self):
            self.other = "instance_id"  # instance_id

    class Sets:
        def __init__(self):
            self.instance_id: str = "x"

    assert "instance_id" not in _assigned_in_init(Commented) and "instance_id" in _assigned_in_init(Sets)
