"""How a test's spawned gloo rank runs its work and ends (tests/engines/test_lora_training.py,
test_fsdp_communication.py): with os._exit, as tests/checkpoint/test_checkpoint_resize.py's ranks end. FSDP2 keeps
the gloo group's threads alive, and a normal exit (a failure's too) can hang in their teardown; a failure prints its
traceback and exits 1, which the parent's join reports."""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable


def run_rank(work: Callable[..., Any], *args: Any) -> None:
    """`work(*args)`, then end the process: exit 0 when it returned, 1 when it raised."""
    code = 1
    try:
        work(*args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def gloo_ranks(work: Callable[..., Any], tmp_path: Any, *args: Any, world: int = 2) -> list[Any]:
    """`work(*args)` on `world` spawned processes in one gloo group (one torch thread each, collectives bounded to a
    minute, so a rank whose peer died fails instead of outliving the test run); what each returned, in rank order.
    `work` must be importable by name (the processes are spawned)."""
    import torch
    import torch.multiprocessing as mp

    mp.start_processes(_gloo_rank, args=(work, str(tmp_path / "store"), str(tmp_path), world, args), nprocs=world,
                       join=True, start_method="spawn")
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]


def _gloo_rank(rank: int, work: Callable[..., Any], store: str, out: str, world: int, args: tuple) -> None:
    def body() -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            torch.save(work(*args), f"{out}/rank{rank}.pt")
        finally:
            dist.destroy_process_group()

    run_rank(body)
