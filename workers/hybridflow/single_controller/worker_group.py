"""RayResourcePool (a spec resource pool as Ray placement groups) and WorkerGroup (one Ray actor per device,
torch.distributed among them).

Several roles given the same pool are *colocated*: one process per device hosts all of them and they take turns,
which is what lets the actor train and generate on the same devices (HybridFlow section 4.2 / 5).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.single_controller.allocator import own_allocator
from hybridflow.single_controller.failures import rank_failure
from hybridflow.single_controller.batch import Batch
from hybridflow.single_controller.protocol import (
    Dispatch,
    DPRank,
    collect_dp,
    concat_results,
    method_protocol,
    registered_methods,
    split_for_dp,
    validate_dp_layout,
)
from hybridflow.api import pool_resource
from hybridflow.api.run_policy import COLLECTIVE_TIMEOUT_SECONDS
from hybridflow.single_controller.context import WorkerContext
from hybridflow.single_controller.resource_pool import RayResourcePool


DEFAULT_COLLECTIVE_TIMEOUT_S = float(COLLECTIVE_TIMEOUT_SECONDS)  # jobs pass runPolicy's (api.run_policy)


@dataclass(frozen=True)
class RoleSpec:
    """A role class and its constructor keyword arguments; the class takes `ctx: WorkerContext` first.

    `colocated` names roles of the same group, built before this one, that its constructor receives as objects
    (keyword = role name): a role that works on another's state in the same process (the rollout role on the
    actor's training engine) gets it handed over by the host, not found through a global."""

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    colocated: tuple[str, ...] = ()
    # Each rank stands alone (a generation replica on a pool of its own): no torch.distributed world among the
    # ranks, so one lost rank can be replaced alone (WorkerGroup.replace) while the others go on.
    independent: bool = False


def interface_for(ip: str) -> str | None:
    """The network interface that holds this address (e.g. eth0 for a pod IP, lo for 127.0.0.1)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def settle_heap() -> None:
    """Collect garbage once, then move every object alive into the collector's permanent generation (gc.freeze).

    A worker holds ~650k Python objects once torch, transformers and vLLM are imported, and each full collection
    walks them all (0.2-1.6 s here, depending on load): vLLM's engine start collects five times, every actor update
    twice (release_free_memory), and the interpreter by itself whenever enough objects were allocated. What exists
    after a role is built lives as long as the worker, so later collections only need to walk what the steps
    allocate."""
    import gc

    gc.collect()
    gc.freeze()


@ray.remote
class WorkerHost:
    """One process per device. Sets up torch.distributed, then hosts any number of colocated role objects."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device: str, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.ctx = WorkerContext(rank, world_size, local_rank, device)
        self.roles: dict[str, Any] = {}
        self._store: Any = None

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: start the group's rendezvous store on a port the kernel picks (the server listens on every
        address; the other ranks reach it at this node's address, which is returned with the port).

        Binding port 0 leaves no gap between choosing the port and listening on it. The port used to be probed
        free on 127.0.0.1 and bound later on every address, and a port free on loopback can already belong to one
        of Ray's servers on the pod IP: the other ranks then talked to that server (connection reset by peer)."""
        import torch.distributed as dist

        ip = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(ip, 0, self.ctx.world_size, is_master=True, wait_for_workers=False)
        return ip, int(self._store.port)

    def init_distributed(self, master_addr: str, master_port: int,
                         timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> str:
        """Join the group's torch.distributed world; returns this rank's node address. A collective that waits
        longer than `timeout_s` for a rank fails instead of hanging (a stopped pod never answers)."""
        import datetime

        import torch.distributed as dist

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.ctx.rank),
            WORLD_SIZE=str(self.ctx.world_size),
            LOCAL_RANK=str(self.ctx.local_rank),
        )
        # gloo listens where the hostname resolves, or on loopback when it does not resolve (yet): bind it to the
        # interface of the address Ray reaches this node on, which the other ranks can reach too.
        iface = interface_for(ray.util.get_node_ip_address())
        if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
        if self.ctx.device == "gpu":
            import torch

            torch.cuda.set_device(0)  # Ray exposes exactly the bundle's GPU
        backend = "nccl" if self.ctx.device == "gpu" else "gloo"
        store = self._store or dist.TCPStore(master_addr, master_port, self.ctx.world_size, is_master=False)
        dist.init_process_group(backend, store=store, rank=self.ctx.rank, world_size=self.ctx.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return ray.util.get_node_ip_address()

    def build(self, role: str, spec: RoleSpec) -> None:
        missing = [name for name in spec.colocated if name not in self.roles]
        if missing:
            raise ValueError(f"role '{role}' needs the colocated role(s) {missing} built before it in this process")
        siblings = {name: self.roles[name] for name in spec.colocated}
        settle_heap()  # the modules this worker imported (torch, the role's own) are never garbage
        self.roles[role] = spec.cls(self.ctx, **spec.kwargs, **siblings)
        settle_heap()  # nor are the role's engines and weights: they live as long as the worker

    def dp_rank(self, role: str, mesh: str) -> DPRank:
        obj = self.roles[role]
        if hasattr(obj, "dp_rank"):
            return obj.dp_rank(mesh)
        return DPRank(self.ctx.rank, self.ctx.world_size, True)

    def execute(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.roles[role], method)(*args, **kwargs)

    def allocator(self) -> str:
        """The C heap allocator this process runs on (the pool's `allocator`, if its library was found)."""
        return own_allocator()

    def node_address(self) -> str:
        return ray.util.get_node_ip_address()


class PendingResult:
    """Futures of one call, plus how to combine them. Passing it to another call hands over the futures."""

    def __init__(self, refs: list[ray.ObjectRef], combine: Callable[[list[Any]], Any], dp_refs: list | None,
                 method: str = "", where: Sequence[str] = (), timeout_s: float | None = None) -> None:
        self.refs = refs
        self._combine = combine
        self.dp_refs = dp_refs  # per DP rank, when produced by DP_COMPUTE
        self.method, self.where = method, list(where) or [f"rank {i}" for i in range(len(refs))]
        self.timeout_s = timeout_s  # a rank that has not answered by then is stuck (its group's collective timeout)

    def get(self) -> Any:
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


class RoleHandle:
    """The controller's view of one role in a WorkerGroup: calling a registered method runs it on every rank."""

    def __init__(self, group: "WorkerGroup", role: str, cls: type, layouts: dict[str, list[DPRank]],
                 ranks: Sequence[int] | None = None) -> None:
        self._group, self._role, self._cls, self.layouts = group, role, cls, layouts
        self.dp_sizes = {mesh: validate_dp_layout(layout) for mesh, layout in layouts.items()}
        self._ranks = None if ranks is None else list(ranks)  # None: every rank of the group

    def on(self, ranks: Sequence[int]) -> "RoleHandle":
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

    def _dispatch(self, method: str, dispatch: Dispatch, mesh: str, args: tuple, kwargs: dict) -> PendingResult:
        ranks = self._ranks if self._ranks is not None else range(len(self._group.hosts))
        hosts = [self._group.hosts[i] for i in ranks]
        n = len(hosts)
        named = (f"{self._role}.{method}", [self._group.where[i] for i in ranks], self._group.collective_timeout_s)
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
                 collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
        """`env` is set in each worker once it runs; `process_env` is the environment its process starts with (what
        must be there before Python is: the allocator's LD_PRELOAD, single_controller.allocator). A collective
        waits at most `collective_timeout_s` for its slowest rank, then fails (single_controller.failures)."""
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
        if self.independent:
            nodes = ray.get([h.node_address.remote() for h in self.hosts])
        else:
            addr, port = ray.get(self.hosts[0].open_rendezvous.remote())
            nodes = ray.get([h.init_distributed.remote(addr, port, collective_timeout_s) for h in self.hosts])
        # how a failure names each rank: its pool, rank and node (a pod's address on Kubernetes)
        self.where = [f"pool {pool.name} rank {rank} ({node})" for rank, node in enumerate(nodes)]
        self.collective_timeout_s = collective_timeout_s
        self._roles: dict[str, RoleHandle] = {}
        for role, spec in roles.items():
            ray.get([h.build.remote(role, spec) for h in self.hosts])
            meshes = {"train"} | {p.mesh for p in registered_methods(spec.cls).values()}
            layouts = {m: ray.get([h.dp_rank.remote(role, m) for h in self.hosts]) for m in sorted(meshes)}
            self._roles[role] = RoleHandle(self, role, spec.cls, layouts)

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
        ).remote(rank, pool.world_size, idx, pool.device, self._env)

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
                node = ray.get(host.node_address.remote(), timeout=max(1.0, deadline - time.monotonic()))
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
            nodes = ray.get([h.node_address.remote() for h in hosts], timeout=max(1.0, deadline - time.monotonic()))
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

    def __getitem__(self, role: str) -> RoleHandle:
        return self._roles[role]

    @property
    def roles(self) -> list[str]:
        return list(self._roles)

    def shutdown(self) -> None:
        self._closed = True
        for h in self.hosts:
            ray.kill(h)
        self.hosts = []
