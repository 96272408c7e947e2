"""Run train -> generate transitions on N local processes (gloo) and report what each rank measured.

Test support, not runtime: used by the tests (small models, checks every generation shard against the full model)
and by bench/reshard.py (a few hundred MB, timings). Processes are spawned, so this works from any script.
A case is a Transition (reshard_hybridflow, reshard_gather_all or reshard_deepspeed_chat over a p-t-d layout) or a
MegatronGather (the actor's path: gather_micro_dp over megatron-named TP shards). run_cases runs many cases on one
spawn of the ranks (process start and the torch import cost seconds; a case costs milliseconds), each case on
process groups of its own, and reports each case's per-rank results or the failure text of that case alone.
"""
from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.engines.bridge import layout as lay
from hybridflow.engines.bridge import reshard as rs

from . import reshard_baselines as base

SCHEMES = ("hybridflow", "hybridflow-v", "deepspeed-chat")

CASE_TIMEOUT_S = 30.0
"""run_cases' default for how long a collective of one case may wait for a peer (the timeout of the case's groups):
a rank that fails a case drops its groups, so its peers fail that case at once, or at this timeout where they
wait on something else; then all go on to the next case. A test case takes milliseconds."""
SILENCE_S = 120.0
"""run_cases' default for how long a rank may go without reporting (its first report includes starting python and
importing torch) before run_cases kills the ranks: the case that rank was on fails, the cases after it run on a
fresh spawn."""


@dataclass(frozen=True)
class Transition:
    """One train -> generate transition of a decoder_specs(layers, hidden) model under `scheme`; with verify, each
    rank's `ok` says its generation weights equal the model's (and, under HybridFlow, contain its training
    shard). bucket_bytes sizes HybridFlow's all-gathers; the baselines ignore it."""
    L: lay.Layout
    scheme: str
    layers: int
    hidden: int
    verify: bool = True
    bucket_bytes: int = rs.BUCKET_BYTES


@dataclass(frozen=True)
class MegatronGather:
    """The actor's transition over megatron_weights(hidden, layers) sharded t ways in p stages under L (p = 1:
    gather_micro_dp; p > 1: gather_stages, joining the stages); `ok`: every generation shard equals sharding the
    whole weights t_g ways, each name once (in order where p = 1), dtypes kept."""
    L: lay.Layout
    bucket_bytes: int = rs.BUCKET_BYTES
    hidden: int = 32
    layers: int = 2
    matrix_dtype: str = "bfloat16"


Case = Union[Transition, MegatronGather]
CaseResult = Union[list, str]  # each rank's dict, by rank; or the case's failure text


def _groups_for(L: lay.Layout, scheme: str) -> list[list[int]]:
    if scheme == "hybridflow":
        return lay.micro_dp_groups(L)
    if scheme == "hybridflow-v":
        return base.model_parallel_groups(L)
    return [list(range(L.world))]


def _transition(case: Transition, rank: int, groups: list[list[int]], handles: list, everyone: Any) -> dict:
    L, scheme = case.L, case.scheme
    specs = base.decoder_specs(case.layers, case.hidden)
    mine = next(i for i, g in enumerate(groups) if rank in g)
    if scheme == "deepspeed-chat":
        shards = base.zero3_shards(L.world, rank, specs)
    else:
        shards = base.train_shards(L, rank, specs)
    dist.barrier(group=everyone)
    if scheme == "hybridflow":
        gen, stats = base.reshard_hybridflow(L, rank, shards, specs, groups[mine], handles[mine], case.bucket_bytes)
    elif scheme == "hybridflow-v":
        gen, stats = base.reshard_gather_all(L, rank, shards, specs, groups[mine], handles[mine])
    else:
        gen, stats = base.reshard_deepspeed_chat(L, rank, shards, specs, handles[mine])
    dist.barrier(group=everyone)
    ok = None
    if case.verify:
        naive = scheme != "hybridflow"
        if scheme == "deepspeed-chat":
            j = (rank % L.t) // L.s_t
            expected = {s.name: base.tp_slice(base.full_param(s), s.split_dim, j, L.t_g) for s in specs}
        else:
            expected = base.expected_generation_shard(L, rank, specs, naive=naive)
        ok = gen.keys() == expected.keys() and all(torch.equal(gen[k], expected[k]) for k in expected)
        # zero redundancy: under HybridFlow the training shard is literally a part of the generation shard
        if scheme == "hybridflow":
            for name, t in shards.items():
                spec = next(s for s in specs if s.name == name)
                if spec.split_dim is not None:
                    tp = L.coords(rank)[0]
                    within = tp % L.s_t
                    ok = ok and torch.equal(base.tp_slice(gen[name], spec.split_dim, within, L.s_t), t)
    return {"rank": rank, **asdict(stats), "ok": ok}


def megatron_weights(hidden: int = 32, layers: int = 2, matrix_dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """Whole megatron-named weights covering every sharding rule (column, row, gated, replicated), in megatron's
    order, bf16 matrices beside fp32 norms as in mixed-precision training: buckets must not mix dtypes."""
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, dtype: torch.dtype = getattr(torch, matrix_dtype)) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(dtype)

    out = {"embedding.word_embeddings.weight": w(8 * hidden, hidden)}
    for i in range(layers):
        h = f"decoder.layers.{i}."
        out |= {h + "input_layernorm.weight": w(hidden, dtype=torch.float32),
                h + "self_attention.linear_qkv.weight": w(3 * hidden, hidden),
                h + "self_attention.linear_qkv.bias": w(3 * hidden),
                h + "self_attention.linear_proj.weight": w(hidden, hidden),
                h + "pre_mlp_layernorm.weight": w(hidden, dtype=torch.float32),
                h + "mlp.linear_fc1.weight": w(8 * hidden, hidden),
                h + "mlp.linear_fc2.weight": w(hidden, 4 * hidden)}
    out["decoder.final_layernorm.weight"] = w(hidden, dtype=torch.float32)
    return out


def stage_of(name: str, layers: int, stages: int) -> int:
    """Which pipeline stage trains megatron tensor `name` (layers split evenly; the embedding on the first stage,
    the final norm on the last), as the megatron engine places them."""
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (layers // stages)
    return 0 if name.startswith("embedding.") else stages - 1


def _megatron_gather(case: MegatronGather, rank: int, groups: list[list[int]], handles: list, everyone: Any) -> dict:
    """The actor's transition (gather_micro_dp, or gather_stages across pipeline stages, over megatron TP shards),
    checked against sharding the whole weights t_g ways: every generation shard, bit for bit."""
    from hybridflow.engines.train import megatron_model as mm

    L = case.L
    mine = next(i for i, g in enumerate(groups) if rank in g)
    full = megatron_weights(case.hidden, case.layers, case.matrix_dtype)
    tp, _, pp = L.coords(rank)
    j = lay.gen_tp_rank(L, rank)
    stats = rs.ReshardStats()
    shards = [(name, mm.shard(name, w, L.t, tp)) for name, w in full.items()  # the training shards, before timing
              if stage_of(name, case.layers, L.p) == pp]
    names = list(full)
    del full  # a rank's whole model is rebuilt for the check, after the transition
    dist.barrier(group=everyone)
    if L.p == 1:
        gen = list(rs.gather_micro_dp(shards, handles[mine], len(groups[mine]), stats, case.bucket_bytes))
        in_order = [name for name, _ in gen] == names
    else:
        gen = list(rs.gather_stages(shards, handles[mine], groups[mine], L.p, pp, case.layers // L.p, stats,
                                    case.bucket_bytes))
        in_order = sorted(name for name, _ in gen) == sorted(names)
    full = megatron_weights(case.hidden, case.layers, case.matrix_dtype)
    ok = in_order and all(
        t.dtype == full[name].dtype and torch.equal(t, mm.shard(name, full[name], L.t_g, j)) for name, t in gen)
    return {"rank": rank, **asdict(stats), "ok": ok}


def _run_case(case: Case, rank: int, world: int, timeout: timedelta) -> dict:
    """One case on this rank, on process groups of its own (every rank creates the same groups in the same order:
    the case's, then one of the whole world), destroyed after it. A rank that fails drops its groups at once, so
    peers blocked on it fail fast rather than at the timeout; one that succeeds waits for the others first."""
    if isinstance(case, Transition):
        groups, run = _groups_for(case.L, case.scheme), _transition
    else:
        groups, run = lay.micro_dp_groups(case.L), _megatron_gather
    handles = [dist.new_group(g, timeout=timeout) for g in groups]
    everyone = dist.new_group(list(range(world)), timeout=timeout)
    done = False
    try:
        out = run(case, rank, groups, handles, everyone)
        done = True
        return out
    finally:
        if done:
            try:
                dist.barrier(group=everyone)
            except Exception:  # a peer failed this case and dropped its groups: its report says why
                pass
        for h in (*handles, everyone):
            try:
                dist.destroy_process_group(h)
            except Exception:
                pass


def _worker(rank: int, world: int, init: str, cases: list[Case], case_timeout_s: float, queue: Any) -> None:
    """Every case in order; puts (rank, case index, this rank's dict or the case's traceback), then (rank, None,
    None). A case that raises is reported and the next one runs. The world's own timeout (rendezvous, creating a
    case's groups) is longer than a case's, so a rank that failed a case early waits in the next case's group
    creation until its peers are out of the failed one."""
    torch.set_num_threads(1)
    case_timeout = timedelta(seconds=case_timeout_s)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=2 * case_timeout + timedelta(seconds=60))
    except Exception:
        failure = f"rank {rank} could not join the gloo world:\n{traceback.format_exc()}"
        for i in range(len(cases)):
            queue.put((rank, i, failure))
        queue.put((rank, None, None))
        return
    for i, case in enumerate(cases):
        try:
            out: dict | str = _run_case(case, rank, world, case_timeout)
        except Exception:
            out = traceback.format_exc()
        queue.put((rank, i, out))
    queue.put((rank, None, None))
    dist.destroy_process_group()


def run_cases(cases: list[Case], case_timeout_s: float = CASE_TIMEOUT_S, silence_s: float = SILENCE_S,
              total_s: float = 600.0) -> list[CaseResult]:
    """Every case, in order, on one spawn of L.world ranks per world size: for each case, each rank's dict (its
    ReshardStats and `ok`), by rank, or the text of what went wrong in that case (each rank's traceback, or the
    rank that died or went silent in it). A rank that dies or hangs takes its case down, not the others: the ranks
    are killed and the cases after that one run on a fresh spawn. Always returns with every process gone;
    cases not done in total_s fail."""
    deadline = time.monotonic() + total_s
    reports: list[dict[int, dict | str]] = [{} for _ in cases]
    notes = ["" for _ in cases]  # why a rank did not report, where one did not
    by_world: dict[int, list[int]] = {}
    for i, case in enumerate(cases):
        by_world.setdefault(case.L.world, []).append(i)
    for world, pending in by_world.items():
        while pending:
            got, trouble, troubled = _spawn(world, [cases[i] for i in pending], case_timeout_s, silence_s, deadline)
            for i, g in zip(pending, got):
                reports[i], notes[i] = g, trouble
            if not trouble or time.monotonic() > deadline:
                break
            # a troubled rank fails the case it was on; what its peers reported after that case is collateral (they
            # waited for it), so those cases run again
            blamed = {next((k for k, g in enumerate(got) if r not in g), len(got)) for r in troubled}
            pending = [i for k, i in enumerate(pending) if k > min(blamed) and k not in blamed]
    out: list[CaseResult] = []
    for case, got, note in zip(cases, reports, notes):
        world = case.L.world
        if len(got) == world and not any(isinstance(v, str) for v in got.values()):
            out.append([got[r] for r in range(world)])
            continue
        failed = {r: v for r, v in sorted(got.items()) if isinstance(v, str)}
        lines = [f"{case} failed:"]
        lines += [f"rank {r}: {text.strip().splitlines()[-1]}" for r, text in failed.items()]
        lines += [f"rank {r}: no report ({note or 'not run'})" for r in range(world) if r not in got]
        lines += [f"\n--- rank {r} ---\n{text}" for r, text in failed.items()]
        out.append("\n".join(lines))
    return out


def _spawn(world: int, cases: list[Case], case_timeout_s: float, silence_s: float,
           deadline: float) -> tuple[list[dict[int, dict | str]], str, list[int]]:
    """The cases on one spawn of `world` ranks: what each rank reported for each case, and, where the ranks were
    killed before all were done, why and which ranks it was (dead, silent; all of them past the deadline)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    reports: list[dict[int, dict | str]] = [{} for _ in cases]
    finished: set[int] = set()
    heard = [time.monotonic()] * world
    procs: list[Any] = []
    trouble, troubled = "", []

    def take(item: tuple) -> None:
        rank, i, payload = item
        heard[rank] = time.monotonic()
        if i is None:
            finished.add(rank)
        else:
            reports[i][rank] = payload

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        try:
            for r in range(world):
                procs.append(ctx.Process(target=_worker, args=(r, world, init, cases, case_timeout_s, queue),
                                         daemon=True))
                procs[-1].start()
            while len(finished) < world:
                try:
                    take(queue.get(timeout=1))
                    continue
                except queue_mod.Empty:
                    pass
                if any(p.exitcode is not None for r, p in enumerate(procs) if r not in finished):
                    while True:  # what they put before they went
                        try:
                            take(queue.get(timeout=0.5))
                        except queue_mod.Empty:
                            break
                    gone = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None and r not in finished}
                    if gone:
                        trouble, troubled = f"rank(s) {sorted(gone)} exited (codes {list(gone.values())})", list(gone)
                        break
                now = time.monotonic()
                silent = [r for r in range(world) if r not in finished and now - heard[r] > silence_s]
                if silent:
                    trouble, troubled = f"rank(s) {silent} reported nothing for {silence_s:.0f} s", silent
                    break
                if now > deadline:
                    trouble, troubled = "the cases did not finish in time", list(range(world))
                    break
        except BaseException as e:
            trouble = f"the harness stopped: {e!r}"
            raise
        finally:  # every process gone, whatever happened: a clean exit is waited for, a stuck one killed
            wait_until = time.monotonic() + (60 if not trouble else 0)
            for p in procs:
                p.join(max(0.0, wait_until - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
            queue.close()
    return reports, trouble, troubled


def run_transition(L: lay.Layout, scheme: str, layers: int, hidden: int, verify: bool = True,
                   bucket_bytes: int = rs.BUCKET_BYTES) -> list[dict]:
    """One transition on L.world spawned ranks; each rank's ReshardStats (and `ok`: its generation weights equal
    the model's, when verify). bucket_bytes sizes HybridFlow's all-gathers; the baselines ignore it."""
    return _one(Transition(L, scheme, layers, hidden, verify, bucket_bytes))


def run_megatron_gather(L: lay.Layout, bucket_bytes: int = rs.BUCKET_BYTES, hidden: int = 32, layers: int = 2,
                        matrix_dtype: str = "bfloat16") -> list[dict]:
    """The actor's transition on L.world spawned ranks (gather_micro_dp, or gather_stages where p > 1): each rank's
    ReshardStats and `ok`."""
    return _one(MegatronGather(L, bucket_bytes, hidden, layers, matrix_dtype))


def _one(case: Case) -> list[dict]:
    """One case, as before run_cases: no limit but the default torch.distributed timeout (bench/reshard.py's
    transitions of hundreds of MB on a loaded machine take what they take); a rank that fails raises."""
    (result,) = run_cases([case], case_timeout_s=1800.0, silence_s=float("inf"), total_s=float("inf"))
    if isinstance(result, str):
        raise RuntimeError(result)
    return result
