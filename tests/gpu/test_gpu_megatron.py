"""The megatron actor (TP 1) on one GPU: `test_megatron` with the suite's generation engine (vLLM, or
GPU_CHECK_ROLLOUT), `test_megatron_gen` with megatron generation fed the training engine's native shards (the
3D-HybridEngine; a machine without vLLM). A few steps each; after every one the generation weights equal the
training weights (public checksums, and every tensor in the worker: WorkerHost.diagnose)."""
from __future__ import annotations

import shutil
import tempfile
import time

import pytest
from gpu_harness import (Record, Settings, all_equal, diagnose, generation_after_sync, job_session, judge_every_tensor,
                         limit, prompts_for_step)

from support.gpu_jobs import job_doc

pytestmark = [pytest.mark.gpu]


def _megatron(suite: Settings, c: Record, rollout_name: str) -> None:
    from hybridflow.single_controller.local_devices import process_group_backend
    from hybridflow.trainer import loop

    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="gpu_check_megatron")
    steps_n = suite.job_steps(2)
    doc = job_doc("megatron", suite.device, steps_n, work, rollout_name)
    try:
        with job_session(doc, suite.out) as s:
            job, w, task = s.job, s.w, s.task
            rollout = w.roles["rollout"]
            c.facts["setup_seconds"] = round(time.perf_counter() - t_start, 2)
            c.facts["dp_sizes"] = rollout.dp_sizes
            c.facts["ranks"] = ranks = diagnose(w, "megatron")
            for r in ranks:
                c.expect(r["engine"] == "MegatronEngine", f"rank {r['rank']}: the training engine is {r['engine']}")
                if not suite.cpu:
                    c.expect(r["device"].startswith("cuda") and r["param_device"].startswith("cuda"),
                             f"rank {r['rank']}: megatron runs on {r['device']} (parameters on {r['param_device']})")
                    want = process_group_backend("gpu")
                    c.expect(r["backend"] == want, f"rank {r['rank']}: backend {r['backend']}, not {want}")
            ids = rollout.instance_id()
            before = rollout.train_checksum()
            c.expect(rollout.weight_checksums() == before, "before any step the generation weights differ")
            steps = []
            for step in range(1, steps_n + 1):
                t0 = time.perf_counter()
                stats, stages = loop.run_iteration(loop.build_step(job, w, task), prompts_for_step(task, step))
                secs = time.perf_counter() - t0
                tr, ro, new_ids = rollout.train_checksum(), rollout.weight_checksums(), rollout.instance_id()
                exact = diagnose(w, "generation_weights")[0]
                steps.append({"step": step, "seconds": round(secs, 2), "train": tr, "rollout": ro,
                              "engine_ids": new_ids, "stages": {k: round(v, 3) for k, v in stages.items()},
                              "worker": exact,
                              **{k: stats.get(k) for k in ("reward_mean", "rollout_log_prob_gap",
                                                           "generation_weight_bytes", "reshard_bytes")}})
                c.expect(ro == tr, f"step {step}: generation weights differ from training weights ({ro} vs {tr})")
                c.expect(tr != before, f"step {step}: the update did not change the weights")
                c.expect(new_ids == ids, f"step {step}: the generation engine was re-created")
                c.expect(exact["exact"], f"step {step}: the engine's embedding != the trainer's (element-wise, max "
                                         f"|diff| {exact['max_abs_diff']})")
                judge_every_tensor(c, exact.get("all"), f"step {step}", suite.cpu)
                if not suite.cpu:
                    c.expect(exact["gen_device"].startswith("cuda"), f"the generation weights on {exact['gen_device']}")
                every = exact.get("all")
                print(f"  step {step}: {secs:.1f} s, every tensor equal {every['exact']}/{every['tensors']}",
                      flush=True)
                before = tr
            c.facts["steps"] = steps
            r0 = ranks[0] if ranks else {}
            c.summary = (f"{steps_n} steps on {r0.get('device', '?')} ({r0.get('backend', '?')}, TP "
                         f"{r0.get('tp', '?')}) -> {r0.get('rollout', rollout_name)}, checksums equal after every "
                         f"step: {all(x['train'] == x['rollout'] for x in steps)}, every generation tensor == the "
                         f"trainer's: {all(all_equal(x['worker'].get('all')) for x in steps)}, engine id unchanged: "
                         f"{all(x['engine_ids'] == ids for x in steps)}")
            if rollout_name != "vllm":  # generation with the synced weights (vLLM's is judged by sleep_wake)
                gen = generation_after_sync(rollout, task, job)
                c.facts["generation_after_sync"] = gen
                c.expect(gen["ok"], "generation after the last sync is degenerate: " + "; ".join(gen["problems"]))
                c.summary += (f"; generation after the last sync: {gen['distinct_responses']}/16 distinct sampled, "
                              f"greedy reward {gen['greedy_reward']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    c.verdict()


@limit("T_MEGATRON", 115)
def test_megatron(suite: Settings, check: Record) -> None:
    """Megatron actor on the device, weights synced to the suite's generation engine after every step."""
    _megatron(suite, check, suite.rollout)


@limit("T_MEGATRON_GEN", 60)
def test_megatron_gen(suite: Settings, check: Record) -> None:
    """Megatron actor + megatron generation (3D-HybridEngine shards) on the device.

    Weights synced after every step, generation after the last sync not degenerate."""
    _megatron(suite, check, "megatron")
