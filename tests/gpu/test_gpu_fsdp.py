"""One FSDP2 actor (dtype bfloat16) + generation engine (vLLM, or GPU_CHECK_ROLLOUT) job on one GPU, four checks on
it (one vLLM start instead of four): the module's fixture runs the job's steps through `loop.run_iteration`, with
the actor's and the rollout role's handles wrapped in ActorProbes (device memory and vLLM's sleep flag around each
update and sync) and the engine's weights read in the worker after every step; the tests judge what it saw.

What the project's API does not show, and how it is read (WorkerHost.diagnose, single_controller/diagnostics.py):
  * the generation engine's weights beyond one sum: `weight_checksums` is the sum of vLLM's embedding and
    `train_checksum` the sum of the trainer's embedding cast to the compute dtype, so the two public sums differ by
    rounding; `generation_weights` compares every engine tensor with the trainer's whole tensor cast to the
    engine's dtype (q/k/v and gate/up stacked as vLLM stacks them);
  * whether vLLM is asleep and how much device memory it holds: `device_memory` reads vLLM's `asleep` flag and
    the device memory in use (total - free, from the CUDA driver) inside the worker; NVML / nvidia-smi from this
    process beside it; vLLM's own "Sleep mode freed" log line is picked from the workers' logs."""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from gpu_harness import (ActorProbe, Record, Session, Settings, all_equal, device_used_bytes, diagnose,
                         generation_after_sync, gib, job_session, judge_every_tensor, limit, prompts_for_step,
                         unit_roundoff)

from support.gpu_jobs import ENGINE_CLASS, GAP_WARN, GIB, job_doc

pytestmark = [pytest.mark.gpu, limit("T_FSDP", 110)]


@dataclass
class FsdpRun:
    s: Session
    base_used: int | None
    setup_seconds: float
    probe_installed: list[bool]
    ids: Any = None
    initial: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    readings: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


@pytest.fixture(scope="module")
def fsdp(suite: Settings):
    work = tempfile.mkdtemp(prefix="gpu_check_fsdp")
    doc = job_doc("fsdp", suite.device, suite.job_steps(3), work, suite.rollout)
    base_used = device_used_bytes()
    t0 = time.perf_counter()
    try:
        with job_session(doc, suite.out) as s:
            # before the steps: the probe records dtypes during the job's own updates
            run = FsdpRun(s, base_used, round(time.perf_counter() - t0, 2), diagnose(s.w, "precision_probe"))
            _run_steps(run, suite)
            yield run
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_steps(run: FsdpRun, suite: Settings) -> None:
    """The job's steps through run_iteration with probed handles; after each: the public checksums, the engine
    ids and the in-worker weight comparison."""
    from hybridflow.trainer import loop, setup
    from hybridflow.trainer.generation.weight_sync import ColocatedWeightSync

    s = run.s
    w = s.w
    actor, rollout = w.roles["actor"], w.roles["rollout"]

    def read(reset_peak: bool = False) -> dict[str, Any]:
        return {"nvml_used": device_used_bytes(), "worker": diagnose(w, "device_memory", reset_peak)[0]}

    run.ids = rollout.instance_id()
    train, roll = rollout.train_checksum(), rollout.weight_checksums()
    run.initial = {"train": train, "rollout": roll, "worker": diagnose(w, "generation_weights")}
    probe = ActorProbe(actor, read)
    probed_rollout = ActorProbe(rollout, read, probe.readings)
    probed = setup.Workers({**w.roles, "actor": probe, "rollout": probed_rollout}, w.groups, w.devices,
                           ColocatedWeightSync(probed_rollout), w.spec)
    for step in range(1, suite.job_steps(3) + 1):
        t0 = time.perf_counter()
        stats, stages = loop.run_iteration(loop.build_step(s.job, probed, s.task), prompts_for_step(s.task, step))
        secs = time.perf_counter() - t0
        run.steps.append({
            "step": step, "seconds": round(secs, 2), "stages": {k: round(v, 3) for k, v in stages.items()},
            "train": rollout.train_checksum(), "rollout": rollout.weight_checksums(),
            "engine_ids": rollout.instance_id(), "worker": diagnose(w, "generation_weights"),
            **{k: stats.get(k) for k in ("reward_mean", "rollout_log_prob_gap", "generation_weight_bytes",
                                         "reshard_bytes", "actor_peak_memory_bytes", "mfu")}})
        k = run.steps[-1]["worker"][0]
        print(f"  step {step}: {secs:.1f} s, reward {stats.get('reward_mean', float('nan')):.3f}, embedding sum: "
              f"train {run.steps[-1]['train'][0]['embedding']:.6f}, rollout "
              f"{run.steps[-1]['rollout'][0]['embedding']:.6f}, element-wise equal in {k['gen_dtype']}: embedding "
              f"{k['exact']}, every tensor {k['all']['exact']}/{k['all']['tensors']}", flush=True)
    run.readings = probe.readings


def test_vllm_sync(fsdp: FsdpRun, suite: Settings, check: Record) -> None:
    """Generation engine on the device, in-place weight sync (FSDP2 actor).

    After every step the engine is the same (id unchanged), the update moved the weights, the sync moved bytes, every
    engine tensor == the trainer's cast to the engine's dtype (vocabulary padding zero), and the public checksums within
    that dtype's rounding."""
    c, cpu, rollout_name = check, suite.cpu, suite.rollout
    c.facts.update(setup_seconds=fsdp.setup_seconds, engine_ids=fsdp.ids, initial=fsdp.initial, steps=fsdp.steps)
    f = fsdp.initial["worker"][0]
    c.expect(f["engine"] == ENGINE_CLASS[rollout_name], f"the generation engine is {f['engine']}, not "
                                                        f"{ENGINE_CLASS[rollout_name]}")
    if not cpu:
        c.expect(f["gen_device"].startswith("cuda"), f"the generation weights are on {f['gen_device']}")
        if rollout_name == "vllm":
            c.expect(f["vllm_platform"] == "cuda", f"vLLM's platform is {f['vllm_platform']}")
    c.expect(f["exact"], "before any step the engine's embedding differs from the trainer's")
    train = fsdp.initial["train"]
    c.expect(bool(fsdp.steps), "no step ran")
    for rec in fsdp.steps:
        step, new_train, new_roll = rec["step"], rec["train"], rec["rollout"]
        moved = abs(new_train[0]["embedding"] - train[0]["embedding"])
        gap = abs(new_roll[0]["embedding"] - new_train[0]["embedding"])
        c.expect(rec["engine_ids"] == fsdp.ids, f"step {step}: the generation engine was re-created ({fsdp.ids} -> "
                                                f"{rec['engine_ids']})")
        c.expect(moved > 1e-3, f"step {step}: the update did not move the weights (embedding sum moved {moved:.2e})")
        c.expect((rec.get("generation_weight_bytes") or 0) > 0, f"step {step}: the sync moved no weights")
        k = rec["worker"][0]
        c.expect(k["exact"], f"step {step}: the engine's embedding != the trainer's cast to {k['gen_dtype']} "
                             f"(max |diff| {k['max_abs_diff']})")
        c.expect(k["padding_zero"], f"step {step}: the engine's vocabulary padding rows are not zero")
        judge_every_tensor(c, k.get("all"), f"step {step}", cpu)
        # train_checksum casts to the compute dtype, weight_checksums sums what the engine holds (vLLM: the compute
        # dtype; hf: the model's dtype): the coarser of the two bounds the gap
        bound = k["train_abs_sum"] * max(k["unit_roundoff"], unit_roundoff(k.get("generation_dtype"))) + 1e-9
        c.expect(gap <= bound, f"step {step}: weight_checksums - train_checksum = {gap:.3e}, more than "
                               f"{k['gen_dtype']} rounding can explain ({bound:.3e})")
        train = new_train
    if fsdp.steps:
        k = fsdp.steps[-1]["worker"][0]
        gd = k.get("generation_dtype")
        if gd and gd != k["gen_dtype"].removeprefix("torch."):
            off = abs(fsdp.steps[-1]["rollout"][0]["embedding"] - fsdp.steps[-1]["train"][0]["embedding"])
            c.note(f"the {rollout_name} engine holds its weights in {k['gen_dtype']} (the model's dtype) while "
                   f"train_checksum casts the trainer's to the compute dtype {gd}: the public weight_checksums and "
                   f"train_checksum differ by {gd} rounding ({off:.2e} here) although every tensor is equal")
        if k["gen_dtype"] != k["train_dtype"]:
            c.note(f"the engine generates in {k['gen_dtype']}, the trainer keeps {k['train_dtype']} weights: the "
                   f"public checksums differ by rounding ({abs(k['gen_sum'] - k['train_sum']):.2e} here)")
    exact = [bool(r["worker"][0]["exact"] and all_equal(r["worker"][0].get("all"))) for r in fsdp.steps]
    last = fsdp.steps[-1]["worker"][0] if fsdp.steps else {}
    c.summary = (f"{len(fsdp.steps)} steps, {rollout_name} on {last.get('gen_device', '?')} in "
                 f"{last.get('gen_dtype', '?')}, engine id unchanged: "
                 f"{bool(fsdp.steps) and fsdp.steps[-1]['engine_ids'] == fsdp.ids}, all "
                 f"{(last.get('all') or {}).get('tensors', '?')} generation tensors == the trainer's after every "
                 f"step: {bool(fsdp.steps) and all(exact)}")
    if rollout_name != "vllm":  # no sleep_wake (vLLM only): generation with the synced weights is judged here
        gen = generation_after_sync(fsdp.s.w.roles["rollout"], fsdp.s.task, fsdp.s.job)
        c.facts["generation_after_sync"] = gen
        c.expect(gen["ok"], "generation after the last sync is degenerate: " + "; ".join(gen["problems"]))
        c.summary += (f"; generation after the last sync: {gen['distinct_responses']}/16 distinct sampled, greedy "
                      f"reward {gen['greedy_reward']}")
    c.verdict()


def test_sleep_wake(fsdp: FsdpRun, suite: Settings, check: Record) -> None:
    """vLLM sleep (level 2) during updates, wake at sync.

    Per step, vLLM awake before update_actor, asleep after it, awake after sync_weights; device memory drops >= 1 GiB
    and >= half of gpuMemoryUtilization x total while it sleeps and at least half of that comes back; after the wake its
    weights are the trainer's and it generates non-degenerate tokens (greedy repeatable). CPU smoke run: no sleep mode,
    memory not judged."""
    if suite.rollout != "vllm":
        pytest.fail(f"sleep mode is vLLM's (level 2 frees weights and KV cache); the {suite.rollout} engine keeps its "
                    "weights: deselect this check with GPU_CHECK_ROLLOUT=hf (bench/gpu_check.sh does)", pytrace=False)
    c, cpu, readings, steps = check, suite.cpu, fsdp.readings, fsdp.steps
    per_step = [readings[i:i + 3] for i in range(0, len(readings), 3)]
    c.facts["device_used_before_workers"] = fsdp.base_used
    c.facts["readings"] = [{ev: r for ev, r in trio} for trio in per_step]
    order = [[ev for ev, _ in t] for t in per_step]
    assert len(per_step) == len(steps) and all(o == ["before_update", "after_update", "after_sync"] for o in order), \
        f"unexpected call order around the update: {[ev for ev, _ in readings]}"
    util = fsdp.s.job.spec.rollout.gpu_memory_utilization
    drops = []
    for i, ((_, a), (_, b), (_, cc)) in enumerate(per_step, 1):
        wa, wb, wc = a["worker"], b["worker"], cc["worker"]
        if cpu:
            continue
        c.expect(wa["asleep"] is False, f"step {i}: vLLM already asleep before the update")
        c.expect(wb["asleep"] is True, f"step {i}: vLLM not asleep after update_actor (release() did not run)")
        c.expect(wc["asleep"] is False, f"step {i}: vLLM still asleep after sync_weights")
        if "device_used" not in wa:
            c.failures.append(f"step {i}: device memory unobservable in the worker (CUDA not initialised there?)")
            continue
        used = [x["device_used"] for x in (wa, wb, wc)]
        drop, regain = used[0] - used[1], used[2] - used[1]
        drops.append(drop)
        budget = util * wa["device_total"]
        c.expect(drop >= GIB, f"step {i}: device memory dropped only {gib(drop)} while vLLM slept")
        c.expect(drop >= 0.5 * budget, f"step {i}: device memory dropped {gib(drop)}, less than half of vLLM's "
                                       f"budget gpuMemoryUtilization x total = {gib(budget)}")
        c.expect(regain >= 0.5 * drop, f"step {i}: after the wake only {gib(regain)} came back of {gib(drop)}")
        print(f"  step {i}: device memory in use {gib(used[0])} before update -> {gib(used[1])} after (vLLM "
              f"asleep) -> {gib(used[2])} after sync (awake); torch allocated {gib(wa['torch_allocated'])} -> "
              f"{gib(wb['torch_allocated'])}, peak in update {gib(wb['torch_peak_allocated'])}; NVML "
              f"{gib(a['nvml_used'])} -> {gib(b['nvml_used'])} -> {gib(cc['nvml_used'])}", flush=True)
    if cpu:
        c.note("CPU: vLLM has no sleep mode (release() is a no-op there): memory not judged; post-sync weights and "
               "generation checked")
    for rec in steps[1:]:  # generation after the wake matches the trainer: the exact weight check of each step
        c.expect(rec["worker"][0]["exact"], f"step {rec['step']}: after the wake the engine's weights differ from "
                                            "the trainer's")
        gap = rec.get("rollout_log_prob_gap")
        if gap is not None and gap > GAP_WARN:
            c.note(f"step {rec['step']}: mean |trainer - engine| log-prob of the sampled tokens is {gap:.3f} "
                   f"(> {GAP_WARN}); informational (the weights are judged element-wise)")
    c.facts["rollout_log_prob_gap"] = [r.get("rollout_log_prob_gap") for r in steps]
    gen = generation_after_sync(fsdp.s.w.roles["rollout"], fsdp.s.task, fsdp.s.job)
    c.facts["generation_after_wake"] = gen
    c.expect(gen["ok"], "generation after wake is degenerate: " + "; ".join(gen["problems"]))
    freed = [ln.strip() for ln in fsdp.s.worker_logs().splitlines() if "Sleep mode freed" in ln]
    c.facts["vllm_log"] = [ln[-200:] for ln in freed[:8]]
    if freed:
        c.note("vLLM's own log (last sleep): " + freed[-1][-160:])
    c.summary = (f"released {', '.join(gib(d) for d in drops) or 'n/a (CPU)'} during the updates (budget {util:g} x "
                 f"device), woke at every sync; post-wake weights exact; generation after the last wake: "
                 f"{gen['distinct_responses']}/16 distinct sampled, greedy reward {gen['greedy_reward']}")
    c.verdict()


def test_nccl(fsdp: FsdpRun, suite: Settings, check: Record) -> None:
    """Process group cpu:gloo,cuda:nccl (FSDP2 on NCCL, CPU tensors on gloo), LOCAL_RANK as decided.

    The actor's default group and FSDP's mesh group run on process_group_backend(device), parameters are FSDP2 DTensors
    on the GPU, all-reduces of a device tensor and of a CPU tensor give the right sums, and each rank has the LOCAL_RANK
    / CUDA_VISIBLE_DEVICES that local_device_env decides from where Ray placed it, computing on cuda:LOCAL_RANK."""
    import ray

    from hybridflow.single_controller.local_devices import local_device_env, process_group_backend

    c, cpu = check, suite.cpu
    c.facts["ranks"] = ranks = diagnose(fsdp.s.w, "process_group")
    group = next(g for g in fsdp.s.w.groups if "actor" in g.roles)
    placements = ray.get([h.placement.remote() for h in group.hosts], timeout=60)
    decided = local_device_env(placements, getattr(group, "independent", False))
    c.facts["placements"] = [{"node": p.node, "gpu_ids": list(p.gpu_ids)} for p in placements]
    c.facts["decided_env"] = decided
    want = process_group_backend(suite.device)
    c.facts["expected_backend"] = want
    for r in ranks:
        rk = r["rank"]
        c.expect(r["backend"] == want, f"rank {rk}: default process group backend {r['backend']}, not {want}")
        c.expect(r.get("mesh_backend") == want, f"rank {rk}: FSDP's device mesh group backend "
                                                f"{r.get('mesh_backend')}, not {want}")
        classes = r.get("backend_class", {})
        c.expect(classes.get("cpu") == "ProcessGroupGloo", f"rank {rk}: CPU tensors are served by "
                                                           f"{classes.get('cpu')}, not gloo")
        if not cpu:
            c.expect(classes.get("cuda") == "ProcessGroupNCCL", f"rank {rk}: CUDA tensors are served by "
                                                                f"{classes.get('cuda')}, not NCCL")
            c.expect(str(r.get("param_device", "")).startswith("cuda"),
                     f"rank {rk}: parameters on {r.get('param_device')}")
            local = r["env"].get("LOCAL_RANK")
            c.expect(local is not None and r.get("cuda_device") == int(local),
                     f"rank {rk}: computes on cuda:{r.get('cuda_device')}, LOCAL_RANK is {local}")
        c.expect(r.get("param_type") == "DTensor", f"rank {rk}: parameters are {r.get('param_type')}, not FSDP2 "
                                                   "DTensors")
        c.expect(r["all_reduce"] == r["all_reduce_expected"],
                 f"rank {rk}: all_reduce gave {r['all_reduce']}, expected {r['all_reduce_expected']}")
        c.expect(r.get("cpu_all_reduce") == r["all_reduce_expected"],
                 f"rank {rk}: all_reduce of a CPU tensor gave {r.get('cpu_all_reduce')}, expected "
                 f"{r['all_reduce_expected']}")
        mine = decided[rk] if rk < len(decided) else {}
        for key, value in mine.items():
            c.expect(r["env"].get(key) == value, f"rank {rk}: {key}={r['env'].get(key)}, local_device_env decided "
                                                 f"{value}")
        c.expect(r.get("ctx_local_rank") == int(mine.get("LOCAL_RANK", -1)),
                 f"rank {rk}: the worker's context has local rank {r.get('ctx_local_rank')}, decided "
                 f"{mine.get('LOCAL_RANK')}")
    lines = [ln for ln in fsdp.s.worker_logs().splitlines() if "NCCL INFO" in ln]
    c.facts["nccl_log_lines"] = len(lines)
    c.facts["nccl_log_sample"] = [ln.strip()[-200:] for ln in lines if "version" in ln or "Init COMPLETE" in ln][:4]
    if not cpu and not lines:
        c.note("no 'NCCL INFO' line in the workers' logs (NCCL_DEBUG=INFO; informational only)")
    r0 = ranks[0]
    env0 = ", ".join(f"{k}={v}" for k, v in r0["env"].items() if v is not None)
    c.summary = (f"backend {r0['backend']} ({', '.join(f'{k}: {v}' for k, v in r0['backend_class'].items())}), "
                 f"FSDP mesh {r0.get('mesh_backend')} on {r0.get('mesh_device_type')}, world size {r0['world_size']}, "
                 f"CPU-tensor all_reduce {r0.get('cpu_all_reduce')}, {env0}"
                 + (f", NCCL {r0['nccl_version']}" if r0.get("nccl_version") else "")
                 + (f", {r0['gpu']}" if r0.get("gpu") else ""))
    if r0["world_size"] == 1 and not cpu:
        c.note("world size 1 (one GPU): NCCL communicators are made and the collectives run through NCCL, but no "
               "bytes cross between GPUs and FSDP2 shards nothing")
    c.verdict()


def test_fp32_master(fsdp: FsdpRun, suite: Settings, check: Record) -> None:
    """FSDP2 actor: fp32 master weights, gradients and AdamW state; bf16 compute.

    The job's actor dtype is bfloat16 (the compute dtype): parameters and their local shards float32, gradients float32
    at every optimizer step, AdamW moments float32, compute dtype bfloat16 and a decoder Linear seen running on bf16
    weights (FSDP2's gathered copy)."""
    c, cpu = check, suite.cpu
    f32, bf16 = "torch.float32", "torch.bfloat16"
    c.facts["probe_installed"] = fsdp.probe_installed
    c.expect(all(fsdp.probe_installed), "the precision probe could not hook the optimizer (no optimizer?)")
    c.facts["ranks"] = ranks = diagnose(fsdp.s.w, "precision")
    for rk, r in enumerate(ranks):
        c.expect(r["compute_dtype"] == bf16, f"rank {rk}: compute dtype {r['compute_dtype']}, not bfloat16")
        c.expect(r["param_dtypes"] == [f32], f"rank {rk}: parameters in {r['param_dtypes']}, not float32")
        c.expect(r["shard_dtypes"] == [f32], f"rank {rk}: local shards in {r['shard_dtypes']}, not float32")
        if not cpu:
            c.expect(all(d.startswith("cuda") for d in r["shard_devices"]), f"rank {rk}: shards on "
                                                                            f"{r['shard_devices']}")
        st = r["optimizer_state_dtypes"]
        c.expect(r["optimizer_states"] > 0, f"rank {rk}: the optimizer holds no state (no step ran?)")
        for k in ("exp_avg", "exp_avg_sq"):
            c.expect(st.get(k) == [f32], f"rank {rk}: AdamW {k} in {st.get(k)}, not float32")
        c.expect(bool(r["step"]), f"rank {rk}: the probe saw no optimizer step")
        for i, x in enumerate(r["step"], 1):
            c.expect(x["grads"] > 0 and x["grad_dtypes"] == [f32],
                     f"rank {rk}, optimizer step {i}: {x['grads']} gradients in {x['grad_dtypes']}, not float32")
            c.expect(x["param_dtypes"] == [f32], f"rank {rk}, optimizer step {i}: parameters in {x['param_dtypes']}")
        c.expect(any(x["grad_enabled"] for x in r["forward"]), f"rank {rk}: the probe saw no forward pass with "
                                                               "gradients")
        for x in r["forward"]:
            c.expect(x["weight"] == bf16 and x["output"] == bf16,
                     f"rank {rk}: a decoder Linear ran on {x['weight']} weights giving {x['output']}, not bfloat16")
    r0 = ranks[0]
    c.summary = (f"compute {r0['compute_dtype'].removeprefix('torch.')}, master "
                 f"{'/'.join(x.removeprefix('torch.') for x in r0['shard_dtypes'])}, gradients "
                 f"{'/'.join(sorted({d.removeprefix('torch.') for x in r0['step'] for d in x['grad_dtypes']})) or '?'}"
                 f" at {len(r0['step'])} optimizer steps, AdamW "
                 + ", ".join(f"{k} {'/'.join(x.removeprefix('torch.') for x in v)}"
                             for k, v in r0["optimizer_state_dtypes"].items())
                 + f"; {r0['shard_bytes'] / 2**20:.2f} MiB of fp32 shards on {', '.join(r0['shard_devices'])}")
    c.verdict()
