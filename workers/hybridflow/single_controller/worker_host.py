"""The process side of a worker group: one `WorkerHost` per device, which joins the group's torch.distributed world
on the device the group decided for it (single_controller.local_devices) and hosts any number of colocated roles.
The controller side, which starts hosts and calls their roles, is single_controller.worker_group."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace as replaced
from typing import Any

import ray

from hybridflow.api.run_policy import COLLECTIVE_TIMEOUT_SECONDS
from hybridflow.single_controller.context import WorkerContext
from hybridflow.single_controller.local_devices import Placement, process_group_backend
from hybridflow.single_controller.protocol import DPRank
from hybridflow.single_controller.allocator import own_allocator

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


def use_threads(env: dict[str, str]) -> None:
    """torch computes on the threads `env`'s OMP_NUM_THREADS names (the pool's cpusPerDevice). Setting the variable
    in the running process does not do it: torch read its thread count when it was imported, before the host's
    `env` arrived, from what the process started with (Ray's floor of the actor's CPUs, unless the driver had
    exported OMP_NUM_THREADS: then every rank took the driver's, whatever its pool's cpusPerDevice)."""
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))


@ray.remote
class WorkerHost:
    """One process per device. Sets up torch.distributed, then hosts any number of colocated role objects."""

    def __init__(self, rank: int, world_size: int, device: str, env: dict[str, str]) -> None:
        os.environ.update(env)
        use_threads(env)
        self.ctx = WorkerContext(rank, world_size, 0, device)  # its local rank once the group knows (use_local_device)
        self.roles: dict[str, Any] = {}
        self._store: Any = None

    def placement(self) -> Placement:
        """Where Ray put this process: its node's address and the GPU ids it was given."""
        return Placement(ray.util.get_node_ip_address(), tuple(str(g) for g in ray.get_gpu_ids()))

    def use_local_device(self, env: dict[str, str]) -> None:
        """Take the local rank and visible devices the group decided (local_devices.local_device_env), before
        anything touches CUDA: CUDA reads CUDA_VISIBLE_DEVICES once, when it is first initialised."""
        os.environ.update(env)
        self.ctx = replaced(self.ctx, local_rank=int(env["LOCAL_RANK"]))
        if self.ctx.device == "gpu":
            import torch

            torch.cuda.set_device(self.ctx.local_rank)

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
        )
        # gloo listens where the hostname resolves, or on loopback when it does not resolve (yet): bind it to the
        # interface of the address Ray reaches this node on, which the other ranks can reach too.
        iface = interface_for(ray.util.get_node_ip_address())
        if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
        if self.ctx.device == "gpu":
            # A weight stream's group that times out (engines.bridge.stream) sets NCCL's process-wide dump flag; the
            # world's monitor thread would then dump and, 480 s later, kill this process (the trainer's rank 0)
            # instead of letting the stream's named error reach the controller.
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
        store = self._store or dist.TCPStore(master_addr, master_port, self.ctx.world_size, is_master=False)
        dist.init_process_group(process_group_backend(self.ctx.device), store=store, rank=self.ctx.rank, world_size=self.ctx.world_size,
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

    def diagnose(self, name: str, *args: Any) -> Any:
        """A registered reading from inside this worker (single_controller/diagnostics.py), for checks that must
        see what the roles' methods do not report (the GPU suite, tests/gpu)."""
        from hybridflow.single_controller.diagnostics import run_diagnostic

        return run_diagnostic(self, name, *args)
