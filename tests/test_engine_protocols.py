"""Every generation engine implements the whole RolloutEngine Protocol with the same signatures, so the actor calls
them without probing (no hasattr)."""
import inspect

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
    assert "instance_id" in inspect.getsource(engine.__init__), f"{engine.__name__} never sets instance_id"
