"""WorkerGroup: one Ray actor per device of a pool (single_controller.worker_host, on the device that
single_controller.local_devices decides), torch.distributed among them, and the controller's handles on their roles.

Several roles given the same pool are *colocated*: one process per device hosts all of them and they take turns,
which is what lets the actor train and generate on the same devices (HybridFlow section 4.2 / 5).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Generic, Sequence, TypeVar, cast

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.single_controller.failures import rank_failure
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.protocol import (
    Dispatch,
    DPRank,
    collect_dp,
    concat_results,
    method_protocol,
    protocol_methods,
    registered_methods,
    split_for_dp,
    validate_dp_layout,
)
from hybridflow.api import pool_resource
from hybridflow.single_controller.local_devices import local_device_env
from hybridflow.single_controller.resource_pool import RayResourcePool
from hybridflow.single_controller.worker_host import DEFAULT_COLLECTIVE_TIMEOUT_S, RoleSpec, WorkerHost

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "PendingResult", "RoleHandle", "RoleSpec", "WorkerGroup", "resolve",
           "stuck", "wait_done"]

R = TypeVar("R")  # what a pending call gives once done
P = TypeVar("P")  # the Protocol of a role (hybridflow.roles.protocols): what the controller may call on it


class PendingResult(Generic[R]):
    """Futures of one call, plus how to combine them. Passing it to another call hands over the futures."""

    def __init__(self, refs: list[ray.ObjectRef], combine: Callable[[list[Any]], Any], dp_refs: list | None,
                 method: str = "", where: Sequence[str] = (), timeout_s: float | None = None) -> None:
        self.refs = refs
        self._combine = combine
        self.dp_refs = dp_refs  # per DP rank, when produced by DP_COMPUTE
        self.method, self.where = method, list(where) or [f"rank {i}" for i in range(len(refs))]
        self.timeout_s = timeout_s  # a rank that has not answered by then is stuck (its group's collective timeout)

    def get(self) -> R:
        try:
            outs = ray.get(self.refs, timeout=self.timeout_s)
        except ray.exceptions.RayError as err:  # a lost worker is named (RankFailure); other errors pass as they are
            failure = rank_failure(self.method, self.refs, self.where, err)
            if failure is err:
                raise
            raise failure from err
        return self._combine(outs)


def resolve(x: Any) -> Any:
    return x.get() if isinstance(x, PendingResult) else x


def wait_done(pending: PendingResult) -> None:
    """Until every rank's part of `pending` is done, without fetching it to the controller; a rank that has not
    answered within the call's timeout is named as stuck (single_controller.failures)."""
    done, _ = ray.wait(pending.refs, num_returns=len(pending.refs), fetch_local=False, timeout=pending.timeout_s)
    if len(done) < len(pending.refs):
        raise stuck(pending)


def stuck(pending: PendingResult) -> BaseException:
    """The error for a call whose ranks did not all answer within its timeout: a RankFailure naming them."""
    err = ray.exceptions.GetTimeoutError(f"{pending.method}: no answer within {pending.timeout_s or 0:.0f} s")
    failure = rank_failure(pending.method, pending.refs, pending.where, err)
    failure.__cause__ = err
    return failure


class RoleHandle(Generic[P]):
    """The controller's view of one role in a WorkerGroup: calling a registered method runs it on every rank.

    `handle.typed(ActorRole)` is the same handle typed by the role's Protocol, and its `call` is the handle as that
    Protocol: `handle.typed(ActorRole).call.compute_log_prob(batch)` dispatches as `handle.compute_log_prob(batch)`
    does, and a type checker follows it into the Protocol."""

    def __init__(self, group: "WorkerGroup", role: str, cls: type, layouts: dict[str, list[DPRank]],
                 ranks: Sequence[int] | None = None) -> None:
        self._group, self._role, self._cls, self.layouts = group, role, cls, layouts
        self.dp_sizes = {mesh: validate_dp_layout(layout) for mesh, layout in layouts.items()}
        self._ranks = None if ranks is None else list(ranks)  # None: every rank of the group

    @property
    def call(self) -> P:
        """This handle as its role's Protocol (the calls dispatch through `__getattr__`, unchanged)."""
        return cast(P, self)

    def typed(self, protocol: Callable[..., R]) -> "RoleHandle[R]":
        """This handle typed by `protocol` (a Protocol class); refused unless its worker class registers every method
        of it. Typed as a callable giving R, not `type[R]`: a type checker refuses a Protocol class for `type[R]`
        ("Only concrete class can be given", mypy's type-abstract) but takes it as a callable."""
        if not isinstance(protocol, type):
            raise TypeError(f"role {self._role}: typed() takes a Protocol class, got {protocol!r}")
        missing = [m for m in protocol_methods(protocol) if method_protocol(self._cls, m) is None]
        if missing:
            raise TypeError(f"role {self._role}: {self._cls.__name__} does not register {', '.join(missing)} of "
                            f"{protocol.__name__}")
        return cast("RoleHandle[R]", self)

    def on(self, ranks: Sequence[int]) -> "RoleHandle[P]":
        """This role on some of its group's ranks only (a group of independent replicas: each rank its own data
        shard), e.g. the rollout replicas still alive while another is being replaced."""
        if not self._group.independent:
            raise ValueError(f"role {self._role}: only a group of independent ranks can be called on some of them")
        if not ranks:
            raise ValueError(f"role {self._role}: no ranks to call")
        k = len(ranks)
        layouts = {mesh: [DPRank(j, k, True) for j in range(k)] for mesh in self.layouts}
        return RoleHandle(self._group, self._role, self._cls, layouts, ranks)

    @property
    def dp_size(self) -> int:
        """Data-parallel size of the training layout (what batches must divide by)."""
        return self.dp_sizes["train"]

    def __getattr__(self, method: str) -> Callable[..., Any]:
        proto = method_protocol(self._cls, method)
        if proto is None:
            raise AttributeError(f"{self._cls.__name__}.{method} is not a registered worker method")

        def call(*args: Any, **kwargs: Any) -> Any:
            pending = self._dispatch(method, proto.dispatch, proto.mesh, args, kwargs)
            return pending.get() if proto.blocking else pending

        call.__name__ = method
        return call

    def _dispatch(self, method: str, dispatch: Dispatch, mesh: str, args: tuple, kwargs: dict) -> PendingResult[Any]:
        ranks = self._ranks if self._ranks is not None else range(len(self._group.hosts))
        hosts = [self._group.hosts[i] for i in ranks]
        n = len(hosts)
        named = (f"{self._role}.{method}", [self._group.where[i] for i in ranks], self._group.call_timeout_s)
        if dispatch == Dispatch.DP_COMPUTE:
            layout = self.layouts[mesh]
            per_rank = [self._dp_args(a, layout) for a in args]
            per_rank_kw = {k: self._dp_args(v, layout) for k, v in kwargs.items()}
            refs = [
                h.execute.remote(self._role, method, *[a[i] for a in per_rank], **{k: v[i] for k, v in per_rank_kw.items()})
                for i, h in enumerate(hosts)
            ]
            dp_refs = collect_dp(refs, layout)
            return PendingResult(refs, lambda outs: concat_results(collect_dp(outs, layout)), dp_refs, *named)
        if dispatch == Dispatch.ALL_TO_ALL:
            for a in [*args, *kwargs.values()]:
                if not isinstance(a, (list, tuple)) or len(a) != n:
                    raise ValueError(f"{method}: ALL_TO_ALL needs one argument per rank ({n})")
            refs = [
                h.execute.remote(self._role, method, *[a[i] for a in args], **{k: v[i] for k, v in kwargs.items()})
                for i, h in enumerate(hosts)
            ]
            return PendingResult(refs, list, None, *named)
        args = tuple(resolve(a) for a in args)
        kwargs = {k: resolve(v) for k, v in kwargs.items()}
        refs = [h.execute.remote(self._role, method, *args, **kwargs) for h in hosts]
        if dispatch == Dispatch.RANK_ZERO:
            return PendingResult(refs, lambda outs: outs[0], None, *named)
        return PendingResult(refs, list, None, *named)

    @staticmethod
    def _dp_args(a: Any, layout: list[DPRank]) -> list[Any]:
        """Per-rank values of one argument: futures of an equally sharded producer pass straight through; a
        producer sharded differently (generation replicas vs training replicas) is gathered and re-split."""
        if isinstance(a, PendingResult) and a.dp_refs is not None and len(a.dp_refs) == layout[0].dp_size:
            return [a.dp_refs[r.dp_rank] for r in layout]
        a = resolve(a)
        if isinstance(a, Batch):
            return split_for_dp(a, layout)
        return [a] * len(layout)


class WorkerGroup:
    """One WorkerHost per device of a pool, hosting the given roles side by side (colocation). When every role's
    ranks are independent (RoleSpec.independent) the ranks form no torch.distributed world and a lost one can be
    replaced alone (`replace`)."""

    def __init__(self, pool: RayResourcePool, roles: dict[str, RoleSpec],
                 env: dict[str, str] | None = None, process_env: dict[str, str] | None = None,
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, call_timeout_s: float | None = None
                 ) -> None:
        """`env` is set in each worker once it runs; `process_env` is the environment its process starts with (what
        must be there before Python is: the allocator's LD_PRELOAD, single_controller.allocator). A collective
        waits at most `collective_timeout_s` for its slowest rank, then fails (single_controller.failures); the
        controller waits for a call's answers `call_timeout_s` (default: the collective timeout), which the caller
        may change between calls (the gang's start-up is allowed longer: trainer.setup.Workers.first_step_done)."""
        self.call_timeout_s = collective_timeout_s if call_timeout_s is None else call_timeout_s
        self.pool = pool
        self.hosts: list[Any] = []
        self.independent = all(spec.independent for spec in roles.values())
        self._specs, self._env, self._process_env = dict(roles), env or {}, process_env
        self._placements: list[tuple[PlacementGroup, int]] = []
        self._closed = False  # shut down: a replacement under way stops
        self._retired: set[int] = set()  # ranks ended for good (retire); ranks are never renumbered
        try:
            self._start(pool, roles, env or {}, process_env, collective_timeout_s)
        except BaseException:  # a worker lost while the group forms: nothing of it is left holding the devices
            self.shutdown()
            pool.release()
            raise

    def _start(self, pool: RayResourcePool, roles: dict[str, RoleSpec], env: dict[str, str],
               process_env: dict[str, str] | None, collective_timeout_s: float) -> None:
        self._placements = pool.acquire()
        self.hosts = [self._host(rank) for rank in range(len(self._placements))]
        nodes = self._localise(self.hosts)
        if not self.independent:
            addr, port = ray.get(self.hosts[0].open_rendezvous.remote())
            nodes = ray.get([h.init_distributed.remote(addr, port, collective_timeout_s) for h in self.hosts])
        # how a failure names each rank: its pool, rank and node (a pod's address on Kubernetes)
        self.where = [f"pool {pool.name} rank {rank} ({node})" for rank, node in enumerate(nodes)]
        self._roles: dict[str, RoleHandle[Any]] = {}
        for role, spec in roles.items():
            ray.get([h.build.remote(role, spec) for h in self.hosts])
            meshes = {"train"} | {p.mesh for p in registered_methods(spec.cls).values()}
            layouts = {m: ray.get([h.dp_rank.remote(role, m) for h in self.hosts]) for m in sorted(meshes)}
            self._roles[role] = RoleHandle(self, role, spec.cls, layouts)

    def _localise(self, hosts: Sequence[Any], timeout_s: float | None = None) -> list[str]:
        """Tell each of `hosts` (the whole group, or new independent ranks) which local device it is; returns their
        nodes' addresses."""
        placements = ray.get([h.placement.remote() for h in hosts], timeout=timeout_s)
        envs = local_device_env(placements, self.independent)
        ray.get([h.use_local_device.remote(env) for h, env in zip(hosts, envs)], timeout=timeout_s)
        return [p.node for p in placements]

    def _host(self, rank: int) -> Any:
        """A worker process for `rank`, in its device's bundle of the pool's placement groups."""
        pg, idx = self._placements[rank]
        pool = self.pool
        return WorkerHost.options(
            num_cpus=pool.cpus_per_device,
            num_gpus=1 if pool.device == "gpu" else 0,
            resources={pool_resource(pool.name): 1.0},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=idx),
            name=None,
            runtime_env={"env_vars": self._process_env} if self._process_env else None,
        ).remote(rank, pool.world_size, pool.device, self._env)

    def replace(self, rank: int, timeout_s: float) -> str:
        """A new worker process for `rank` (its old one is gone), with every role built again, in the rank's
        bundle: Ray places it once the bundle has a node again (on Kubernetes, the pod the operator created in
        place of the lost one). Returns how failures name the new rank. The other ranks are not touched.

        Ray may not know yet that the lost rank's node is dead (it takes missed heartbeats): a process placed there
        dies with the node, and is placed again, until `timeout_s` runs out."""
        if not self.independent:
            raise RuntimeError(f"pool {self.pool.name}: its ranks form a torch.distributed world; a lost rank is "
                               "mended by rebuilding the whole group")
        ray.kill(self.hosts[rank], no_restart=True)  # what is left of it, if anything
        deadline = time.monotonic() + timeout_s
        while True:
            if self._closed:
                raise RuntimeError(f"pool {self.pool.name} was shut down while its rank {rank} was being replaced")
            host = self._host(rank)
            try:
                node, = self._localise([host], timeout_s=max(1.0, deadline - time.monotonic()))
                for role, spec in self._specs.items():
                    ray.get(host.build.remote(role, spec), timeout=max(1.0, deadline - time.monotonic()))
                break
            except ray.exceptions.RayActorError:  # placed on the dying node: again, once Ray moved the bundle
                ray.kill(host, no_restart=True)
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
            except BaseException:
                ray.kill(host, no_restart=True)
                raise
        if self._closed:  # shut down while this one was built: it goes too
            ray.kill(host, no_restart=True)
            raise RuntimeError(f"pool {self.pool.name} was shut down while its rank {rank} was being replaced")
        self.hosts[rank] = host
        self.where[rank] = f"pool {self.pool.name} rank {rank} ({node})"
        return self.where[rank]

    def grow(self, slot: int, timeout_s: float) -> list[int]:
        """The ranks of one more node, pod index `slot` (a slotted group of independent ranks only), each with
        every role built (on Kubernetes: a pod the operator added to the pool). Returns the new ranks."""
        if not self.independent:
            raise RuntimeError(f"pool {self.pool.name}: its ranks form a torch.distributed world of a fixed size")
        deadline = time.monotonic() + timeout_s
        placements = self.pool.add_node(slot, timeout_s)
        ranks = list(range(len(self.hosts), len(self.hosts) + len(placements)))
        hosts = []
        try:
            self._placements += placements
            hosts = [self._host(r) for r in ranks]
            nodes = self._localise(hosts, timeout_s=max(1.0, deadline - time.monotonic()))
            for role, spec in self._specs.items():
                ray.get([h.build.remote(role, spec) for h in hosts], timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            for h in hosts:
                ray.kill(h, no_restart=True)
            del self._placements[len(self.hosts):]
            self.pool.remove_node(placements[0][0])
            raise
        if self._closed:
            for h in hosts:
                ray.kill(h, no_restart=True)
            raise RuntimeError(f"pool {self.pool.name} was shut down while it grew")
        self.hosts += hosts
        self.where += [f"pool {self.pool.name} rank {r} ({node})" for r, node in zip(ranks, nodes)]
        return ranks

    def slot_of(self, rank: int) -> int | None:
        """The pod index whose node holds `rank` (slotted pools; None otherwise, or once retired)."""
        return None if rank in self._retired else self.pool.slot_of(self._placements[rank][0])

    def retire(self, ranks: Sequence[int]) -> None:
        """End `ranks` for good (independent ranks whose node is leaving); a node all of whose ranks are retired is
        given back to Ray. Ranks are never renumbered: theirs are never called again."""
        for r in ranks:
            ray.kill(self.hosts[r], no_restart=True)
            self.where[r] = f"pool {self.pool.name} rank {r} (retired)"
        self._retired.update(ranks)
        for pg in {self._placements[r][0] for r in ranks}:
            if all(i in self._retired for i, (g, _) in enumerate(self._placements) if g == pg):
                self.pool.remove_node(pg)

    def alive(self, ranks: Sequence[int], timeout_s: float = 5.0) -> list[bool]:
        """Whether each of `ranks` answers within `timeout_s` (a dead process or node does not)."""
        refs = [self.hosts[r].node_address.remote() for r in ranks]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for ref in refs:
            try:
                out.append(ref in ready and bool(ray.get(ref, timeout=0)))
            except ray.exceptions.RayError:
                out.append(False)
        return out

    def allocators(self) -> list[str]:
        """Each rank's C heap allocator, as its process reports it."""
        return ray.get([h.allocator.remote() for h in self.hosts])

    def __getitem__(self, role: str) -> RoleHandle[Any]:
        return self._roles[role]

    @property
    def roles(self) -> list[str]:
        return list(self._roles)

    def shutdown(self) -> None:
        self._closed = True
        for h in self.hosts:
            ray.kill(h)
        self.hosts = []
