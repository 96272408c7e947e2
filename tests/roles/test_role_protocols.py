"""Conformance at the driver-worker boundary: every worker class of every registered role (hybridflow.api.roles:
ROLE_KINDS) offers exactly the Protocol the controller calls it through (hybridflow.roles.protocols), method for
method, with the same parameters and defaults, and with the return type its transfer protocol gives the controller.
A worker method renamed, a parameter added or a dispatch changed fails here, not in a job.

And the handles: `RoleHandle.typed(Protocol).call.<method>` dispatches as the untyped handle does."""
import inspect
import re

import pytest

from hybridflow.api import ROLES
from hybridflow.api.roles import ROLE_KINDS, trained_roles
from hybridflow.single_controller.protocol import Dispatch, DPRank, method_protocol, protocol_methods, register
from hybridflow.single_controller.worker_group import PendingResult, RoleHandle

PAIRS = [(role, worker, proto) for role in ROLE_KINDS for worker, proto in ROLE_KINDS[role].load_workers()]


def _ann(a: object) -> str:
    """An annotation as written (the modules use `from __future__ import annotations`), spaces normalised."""
    return re.sub(r"\s+", "", a if isinstance(a, str) else getattr(a, "__name__", repr(a)))


def driver_return(worker_return: str, dispatch: Dispatch, blocking: bool) -> str:
    """What the controller gets from a call whose method returns `worker_return` on each rank
    (single_controller.worker_group.RoleHandle._dispatch)."""
    if dispatch == Dispatch.RANK_ZERO:
        out = worker_return
    elif dispatch == Dispatch.DP_COMPUTE and worker_return == "Batch":
        out = "Batch"  # the shards' batches joined
    else:
        out = f"list[{worker_return}]"  # every rank's (every shard's) result
    return out if blocking else f"Pending[{out}]"


def test_the_roles_tuple_is_the_registry_of_role_definitions():
    assert ROLES == ("actor", "rollout", "reference", "critic", "reward", "judge", "cost", "cost_critic")
    assert tuple(ROLE_KINDS) == ROLES
    assert trained_roles() == ("actor", "critic", "cost_critic")
    for role in ROLES:  # each worker's Protocol is (a refinement of) the role's own
        common = ROLE_KINDS[role].load_protocol()
        assert all(common in proto.__mro__ for _, _, proto in [p for p in PAIRS if p[0] == role])


@pytest.mark.parametrize("role,worker,proto", PAIRS, ids=[f"{r}-{w.__name__}" for r, w, _ in PAIRS])
def test_a_role_protocol_matches_its_worker_class(role, worker, proto):
    declared = protocol_methods(proto)
    registered = sorted(n for n in dir(worker) if method_protocol(worker, n) is not None)
    assert declared == registered, (f"{proto.__name__} declares {declared}; {worker.__name__} registers "
                                    f"{registered}: rename the method on both sides (and its callers)")
    for name in declared:
        want, have = inspect.signature(getattr(proto, name)), inspect.signature(getattr(worker, name))
        wp, hp = list(want.parameters.values())[1:], list(have.parameters.values())[1:]  # without self
        assert [(p.name, p.kind, p.default) for p in wp] == [(p.name, p.kind, p.default) for p in hp], \
            f"{worker.__name__}.{name}{have} vs {proto.__name__}.{name}{want}"
        for p, q in zip(wp, hp):  # a batch may come from the controller or as another call's pending result
            assert _ann(p.annotation) == _ann(q.annotation) or (_ann(p.annotation), _ann(q.annotation)) == (
                "BatchIn", "Batch"), f"{worker.__name__}.{name}: parameter {p.name}"
        dispatch = method_protocol(worker, name)
        assert _ann(want.return_annotation) == driver_return(_ann(have.return_annotation), dispatch.dispatch,
                                                             dispatch.blocking), f"{worker.__name__}.{name}"


class _Host:
    def __init__(self, rank):
        self.rank = rank
        self.execute = self  # `host.execute.remote(role, method, *args)`, as a Ray actor's

    def remote(self, role, method, *args, **kwargs):
        return (self.rank, role, method, args, kwargs)


class _Group:
    independent = False
    call_timeout_s = 1.0

    def __init__(self, n):
        self.hosts = [_Host(r) for r in range(n)]
        self.where = [f"rank {r}" for r in range(n)]


class _Worker:
    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def ping(self, x: int) -> int:
        return x


class _Ping:
    def ping(self, x: int) -> PendingResult[list[int]]: ...


class _Pong:
    def pong(self) -> None: ...


def test_a_typed_handle_dispatches_as_the_untyped_one_and_refuses_a_protocol_its_worker_lacks():
    handle = RoleHandle(_Group(2), "pinger", _Worker, {"train": [DPRank(0, 2, True), DPRank(1, 2, True)]})
    typed = handle.typed(_Ping)
    assert typed is handle
    via_call, plain = typed.call.ping(3), handle.ping(3)
    assert isinstance(via_call, PendingResult) and via_call.refs == plain.refs == [
        (0, "pinger", "ping", (3,), {}), (1, "pinger", "ping", (3,), {})]
    with pytest.raises(TypeError, match="_Worker does not register pong of _Pong"):
        handle.typed(_Pong)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        return lambda *args: self.calls.append((method, args)) or "pending"


# The step's tables as trainer/step.py wrote them by hand before they were derived from STAGES (step.REMOTE_STAGES
# is now remote_stages() itself, so comparing with it could not fail).
STEP_TABLE = {
    "old_log_prob": ("actor", "compute_log_prob"),
    "reference": ("reference", "compute_ref_log_prob"),
    "values": ("critic", "compute_values"),
    "cost_values": ("cost_critic", "compute_values"),
    "reward": ("reward", "compute_rm_scores"),
    "cost": ("cost", "compute_rm_scores"),
}


def test_each_stage_calls_its_roles_protocol_method_and_agrees_with_the_steps_table():
    from hybridflow.roles.stages import STAGES, optional_stages, remote_stages

    assert remote_stages() == STEP_TABLE and optional_stages() == {"reference"}
    for name, stage in STAGES.items():
        assert stage.role in ROLE_KINDS, name
        assert ROLE_KINDS[stage.role].load_protocol() is stage.protocol, name  # what every worker of it offers
        assert stage.method in protocol_methods(stage.protocol), name
        rec = _Recorder()
        assert stage.launch(rec, "batch") == "pending" and rec.calls == [(stage.method, ("batch",))], name


class _Scorer:
    @register(Dispatch.DP_COMPUTE, blocking=False)
    def compute_rm_scores(self, batch):
        return batch


def test_a_stage_runs_through_the_typed_handle():
    from hybridflow.roles.stages import STAGES

    handle = RoleHandle(_Group(1), "reward", _Scorer, {"train": [DPRank(0, 1, True)]})
    pending = STAGES["reward"].run(handle, "not a Batch: given to every rank as it is")
    assert pending.refs == [(0, "reward", "compute_rm_scores", ("not a Batch: given to every rank as it is",), {})]
    with pytest.raises(TypeError, match="_Scorer does not register checkpoint_written, compute_values, .* of Critic"):
        STAGES["values"].run(handle, None)
