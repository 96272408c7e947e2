"""The device-mapping planner (hybridflow.mapping, issue 52): the enumeration's counts, the simulator's
monotonicity, the memory model's refusals, the search's time at 128 devices x 5 models, `hybridflow plan --devices`
and its -o spec, and a random sample of 200 candidates that each pass the spec's validation and whose fast memory
verdict is memory.plan's. Pure and fast: no Ray, no torch, no model files."""
from __future__ import annotations

import itertools
import math
import random
import re
import time

import pytest

from hybridflow.api import dump_job, load_job, parse_job
from hybridflow.api.devices import GPU_PROFILES, PROFILES, calibrated
from hybridflow.api.training import fsdp_switch_on
from hybridflow.cli import main
from hybridflow.mapping import enumerate_candidates, resolve, search
from hybridflow.mapping.candidates import (
    Layout, allocations, bell, layouts, placements, pool_sizes, set_partitions,
)
from hybridflow.mapping.fit import layout_spec, pool_fits, role_memory, sized_pool
from hybridflow.mapping.paper import LLAMA, paper_job, paper_shapes
from hybridflow.mapping.stage_time import Calibration, Generation, Parallel, generate_s, pass_s, transition_s
from hybridflow.mapping.workload import workload
from hybridflow.memory import memory_problems, pool_plans
from hybridflow.memory.shapes import SMOLLM2

from support.paths import ROOT

EXAMPLE = ROOT / "examples" / "gpu-grpo-7b.yaml"
H100, A100 = PROFILES["h100-80gb"], PROFILES["a100-80gb"]
QWEN = {"source": "path", "path": "/models/Qwen2.5-7B-Instruct", "dtype": "bfloat16"}


def _job(algorithm="grpo", **spec):
    base = {"algorithm": {"name": algorithm}, "models": {"actor": {"source": "smollm2"}},
            "data": {"task": "arithmetic"}, "rollout": {"maxPromptLength": 48, "maxResponseLength": 16},
            "resourcePools": [{"name": "gpus", "devicesPerNode": 8, "device": "gpu", "accelerator": "h100-80gb"}]}
    return parse_job({"spec": {**base, **spec}})


def _shapes(shape=SMOLLM2):
    return {r: shape for r in ("actor", "rollout", "reference", "critic", "cost_critic", "reward", "cost")}


def _five_models_job():
    """safe_rlhf with a reward model and a cost model: actor, critic, reference, reward, cost (and the cost critic)."""
    return parse_job({"spec": {
        "algorithm": {"name": "safe_rlhf"},
        "models": {"actor": QWEN, "critic": QWEN, "reward": {"type": "model", "model": QWEN},
                   "cost": {"type": "model", "model": QWEN}},
        "data": {"source": "files", "train": ["t.parquet"]},
        "rollout": {"responsesPerPrompt": 1, "maxPromptLength": 1024, "maxResponseLength": 1024},
        "training": {"miniBatchSize": 256}, "trainer": {"promptsPerStep": 1024},
        "resourcePools": [{"name": "gpus", "nodes": 2, "devicesPerNode": 8, "device": "gpu",
                           "accelerator": "a100-80gb"}]}})


def test_device_profiles_carry_speeds_and_the_cpu_peak_is_calibrated():
    for name in GPU_PROFILES:
        p = PROFILES[name]
        assert p.peak_flops > 1e14 and p.memory_bandwidth > 5e11 and p.devices_per_node == 8, name
        assert p.intra_node_bandwidth >= p.inter_node_bandwidth > 0, name
    assert PROFILES["h100-80gb"].peak_flops == 989e12 and PROFILES["a100-80gb"].memory_bandwidth == 2.039e12
    cpu = calibrated(PROFILES["cpu"], 123e9)
    assert cpu.peak_flops == 123e9 and cpu.capacity_bytes == 0 and cpu.runtime_bytes == PROFILES["cpu"].runtime_bytes
    with pytest.raises(ValueError, match="positive"):
        calibrated(PROFILES["cpu"], 0)


def test_set_partitions_are_the_bell_numbers_each_once():
    for n in range(1, 7):
        items = [f"m{i}" for i in range(n)]
        parts = list(set_partitions(items))
        assert len(parts) == bell(n) == len(set(parts))
        for part in parts:
            assert sorted(x for block in part for x in block) == sorted(items)
            assert "m0" in part[0]  # the actor's group first
    assert [bell(n) for n in range(7)] == [1, 1, 2, 5, 15, 52, 203]


def test_placements_follow_the_rules_of_modes():
    ppo = _job("ppo")  # actor, reference, critic: 5 partitions
    got = list(placements(ppo.spec))
    assert len(got) == 5 * 4  # rollout beside the actor (sync), or alone in sync, one_step_off, async
    beside = [p for p in got if not p.rollout_own]
    assert len(beside) == 5 and all("rollout" in p.groups[0] and p.mode == "sync" for p in beside)
    assert all(p.rollout_own for p in got if p.mode != "sync")
    remax = _job("remax")  # a greedy baseline: no async
    assert {p.mode for p in placements(remax.spec)} == {"sync", "one_step_off"}
    fed = _job("ppo", training={"engine": "megatron"}, rollout={"engine": "megatron", "maxPromptLength": 48,
                                                              "maxResponseLength": 16},
               models={"actor": {"source": "smollm2", "dtype": "bfloat16"}})
    assert all(not p.rollout_own and p.mode == "sync" for p in placements(fed.spec))  # fed shards: beside the actor


def test_allocations_use_every_device_in_pool_sizes():
    sizes = tuple(pool_sizes(16, 8))
    assert sizes == (1, 2, 4, 8, 16)
    assert pool_sizes(128, 8)[-3:] == [112, 120, 128] and 12 not in pool_sizes(128, 8)
    for k in (1, 2, 3, 4):
        brute = sorted(c for c in itertools.product(sizes, repeat=k) if sum(c) == 16)
        assert sorted(allocations(k, 16, sizes)) == brute
    assert allocations(2, 16, sizes) == ((8, 8),)


def test_enumeration_count_on_a_small_case():
    """actor + reference on 4 devices: colocated (4), actor+rollout | reference (2,2); own rollout pool:
    actor+reference | rollout (2,2) and actor | reference | rollout (1,1,2), (1,2,1), (2,1,1), in 3 modes each."""
    job = _job("grpo")
    assert [r for r in job.spec.roles() if r != "rollout"] == ["actor", "reference"]
    cands = list(enumerate_candidates(job.spec, _shapes(), 4, H100, engines=("fsdp",), micro_batches=()))
    assert len(cands) == 2 + 3 * (1 + 3)
    assert sum(c.placement.mode == "sync" for c in cands) == 2 + 4
    assert all(c.total_devices == 4 for c in cands)
    with_megatron = list(enumerate_candidates(job.spec, _shapes(), 4, H100, micro_batches=()))
    assert len(with_megatron) > len(cands)
    assert all(c.layout.tp * c.layout.pp <= n for c in with_megatron
               for g, n in zip(c.placement.groups, c.devices) if "actor" in g)


def test_the_simulator_is_monotone_in_devices_and_model_size():
    work = workload(paper_job("13b").spec)
    cal = Calibration()
    s13, s70 = LLAMA["13b"], LLAMA["70b"]
    tokens = work.pass_tokens("megatron")
    for kind in ("train", "forward"):
        times = [pass_s(s13, work, tokens, kind, Parallel(n, 4, 2, fsdp=False, micro=4), A100, cal)
                 for n in (8, 16, 32, 64, 128)]
        assert all(a >= b for a, b in zip(times, times[1:])), (kind, times)
        fsdp = [pass_s(s13, work, tokens, kind, Parallel(n, micro=4), A100, cal) for n in (8, 16, 64)]
        assert all(a >= b for a, b in zip(fsdp, fsdp[1:])), (kind, fsdp)
        assert pass_s(s70, work, tokens, kind, Parallel(64, 8, 4, fsdp=False, micro=4), A100, cal) > \
            pass_s(s13, work, tokens, kind, Parallel(64, 8, 4, fsdp=False, micro=4), A100, cal)
    gens = [generate_s(s13, work, Generation(n, 4, 20 << 30), A100, cal) for n in (8, 16, 32, 64)]
    assert all(a > b for a, b in zip(gens, gens[1:])), gens
    assert generate_s(s70, work, Generation(64, 8, 20 << 30), A100, cal) > \
        generate_s(s13, work, Generation(64, 8, 20 << 30), A100, cal)
    assert generate_s(s13, work, Generation(64, 4, 0), A100, cal) == math.inf  # no KV cache: cannot generate
    # the 3D-HybridEngine: no transition when generation keeps the training layout, more the more it gathers
    assert transition_s(s13, Parallel(64, 4, 1, fsdp=False), 4, A100, cal) == 0
    assert transition_s(s13, Parallel(64, 8, 1, fsdp=False), 1, A100, cal) > \
        transition_s(s13, Parallel(64, 8, 1, fsdp=False), 4, A100, cal) > 0


def test_the_memory_model_refuses_and_the_search_drops():
    none = search(paper_job("70b"), paper_shapes("70b"), 16, A100, modes=("sync",))
    assert none.ranked == [] and none.considered > 0 and none.feasible == 0  # four 70B models on 16 A100s
    some = search(paper_job("70b"), paper_shapes("70b"), 64, A100, modes=("sync",))
    assert some.ranked and 0 < some.feasible < some.considered
    for r in some.ranked:
        assert memory_problems(r.job.spec, pool_plans(r.job.spec, paper_shapes("70b"))) == []
        assert r.headroom_bytes >= 0 and r.candidate.layout.tp * r.candidate.layout.pp >= 8  # 70B needs sharding
    steps = [r.step_seconds for r in some.ranked]
    assert steps == sorted(steps)


def test_128_devices_and_5_models_resolve_in_under_30_seconds():
    job = _five_models_job()
    assert [r for r in job.spec.roles() if r != "rollout"] == ["actor", "reference", "critic", "reward", "cost",
                                                                "cost_critic"]
    shapes = {r: LLAMA["7b"] for r in ("actor", "rollout", "reference", "critic", "cost_critic", "reward", "cost")}
    started = time.perf_counter()
    result = search(job, shapes, 128, A100)
    took = time.perf_counter() - started
    assert took < 30, took
    assert len(result.ranked) == 10 and result.considered > 1_000_000
    assert all(r.candidate.total_devices == 128 for r in result.ranked)


def test_plan_with_devices_ranks_and_writes_a_spec_that_parses(tmp_path, capsys):
    out = tmp_path / "resolved.yaml"
    started = time.perf_counter()
    assert main(["plan", str(EXAMPLE), "--devices", "64", "--accelerator", "h100-80gb", "-o", str(out)]) == 0
    assert time.perf_counter() - started < 30
    text = capsys.readouterr().out
    rows = [ln for ln in text.splitlines() if re.match(r"\| \d+ \|", ln)]
    assert [int(r.split("|")[1]) for r in rows] == list(range(1, 11))
    steps = [float(r.split("|")[5]) for r in rows]
    assert steps == sorted(steps) and steps[0] > 0
    job = load_job(out)  # the schema and api/rules.py accept it
    assert sum(p.world_size for p in job.spec.resource_pools) == 64
    assert all(p.accelerator == "h100-80gb" for p in job.spec.resource_pools)
    assert set(job.spec.placement) == set(job.spec.roles())
    assert memory_problems(job.spec, pool_plans(job.spec, _shapes_of(job))) == []
    assert f"wrote {out}" in text


def _shapes_of(job):
    from hybridflow.memory import read_shapes

    return read_shapes(job.spec, ROOT / "examples")


@pytest.mark.parametrize("args, field", [
    (["--devices", "0", "--accelerator", "h100-80gb"], "--devices"),
    (["--devices", "60", "--accelerator", "h100-80gb"], "--devices"),
    (["--devices", "16", "--accelerator", "tpu"], "--accelerator"),
    (["--devices", "16", "--accelerator", "96Gi"], "--accelerator"),
    (["--devices", "16", "--accelerator", "h100-80gb", "--modes", "fast"], "--modes"),
    (["--devices", "16", "--accelerator", "h100-80gb", "--train-engines", "jax"], "--train-engines"),
    (["--devices", "16", "--accelerator", "h100-80gb", "--top", "0"], "--top"),
])
def test_plan_with_devices_names_the_bad_flag(args, field, capsys):
    assert main(["plan", str(EXAMPLE), *args]) == 2
    err = capsys.readouterr().err
    assert f"error: {field}" in err, err


def test_plan_without_devices_is_the_memory_plan():
    from hybridflow.cli import parser

    args = parser().parse_args(["plan", str(EXAMPLE)])
    assert args.devices is None and args.fn.__name__ == "cmd_plan"


def test_a_random_sample_of_200_candidates_passes_validation_and_the_fast_memory_verdict_is_the_plans():
    """Every candidate resolves to a spec the schema and api/rules.py accept (what `hybridflow validate` checks
    besides the files it names), with the candidate's pools and placement; the search's per-role memory sums
    agree with memory.plan on each pool."""
    job = parse_job({"spec": {
        "algorithm": {"name": "ppo"}, "models": {"actor": QWEN, "reward": {"type": "model", "model": QWEN}},
        "data": {"source": "files", "train": ["t.parquet"]},
        "rollout": {"responsesPerPrompt": 2, "maxPromptLength": 512, "maxResponseLength": 512},
        "training": {"miniBatchSize": 64}, "trainer": {"promptsPerStep": 128},
        "resourcePools": [{"name": "gpus", "nodes": 2, "devicesPerNode": 8, "device": "gpu",
                           "accelerator": "h100-80gb"}]}})
    shapes = _shapes(LLAMA["7b"])
    rng = random.Random(52)
    sample: list = []
    for i, cand in enumerate(enumerate_candidates(job.spec, shapes, 16, H100)):  # reservoir sampling
        if len(sample) < 200:
            sample.append(cand)
        elif (j := rng.randrange(i + 1)) < 200:
            sample[j] = cand
    assert len(sample) == 200 and len({c.placement.mode for c in sample}) == 3
    assert {c.layout.engine for c in sample} == {"fsdp", "megatron"}
    agree = refused = 0
    for cand in sample:
        resolved = resolve(job, cand, H100)  # raises SpecError if the spec's validation refuses it
        spec = resolved.spec
        assert sum(p.world_size for p in spec.resource_pools) == 16
        assert spec.rollout.mode == cand.placement.mode and spec.training.tensor_parallel == cand.layout.tp
        for group, n in zip(cand.placement.groups, cand.devices):
            assert all(spec.pool(r).world_size == n for r in group)
        plans = pool_plans(spec, shapes)
        fit_spec = layout_spec(job.spec, cand.layout)
        for plan, group in zip(plans, cand.placement.groups):
            colocated = "actor" in group and "rollout" in group
            pool = sized_pool(job.spec.resource_pools[0], plan.world_size, H100)
            fast = pool_fits([role_memory(r, fit_spec, pool, shapes[r], H100, colocated) for r in group], H100)
            full = not memory_problems(spec, [plan])
            assert fast == full, (cand, plan.name)
            agree += 1
            refused += not full
    assert agree >= 200 and refused > 0  # the sample meets the memory model's refusals too


def test_layout_keeps_tensor_parallel_inside_a_node_and_dividing_the_heads():
    job = paper_job("34b")
    got = layouts(job.spec, paper_shapes("34b"), A100, engines=("megatron",), micro_batches=(4,))
    assert got and all(l.tp <= 8 and 8 % l.tp == 0 and l.tp % l.tg == 0 for l in got)
    assert Layout("megatron", 8, 16, 8, 4) in got and all(48 % l.pp == 0 for l in got)  # 48 layers


def test_a_lora_jobs_candidates_train_megatron_at_t1_p1_and_each_resolves():
    """Megatron trains LoRA at tensorParallel = pipelineParallel = 1 only, and a LoRA actor is its own reference
    (api.rules): the planner offers no other megatron layout and no reference apart from the actor for a LoRA job,
    so every candidate it emits resolves to a spec the rules accept."""
    job = _job(training={"lora": {"rank": 16}})
    cands = list(enumerate_candidates(job.spec, _shapes(), 8, H100))
    megatron = [c for c in cands if c.layout.engine == "megatron"]
    assert megatron and all((c.layout.tp, c.layout.pp, c.layout.tg) == (1, 1, 1) for c in megatron)
    assert any(c.layout.tp * c.layout.pp > 1 for c in enumerate_candidates(_job().spec, _shapes(), 8, H100))  # no LoRA
    for cand in random.Random(54).sample(cands, min(40, len(cands))):
        assert resolve(job, cand, H100).spec.training.lora.rank == 16  # raises SpecError where a rule refuses


def _tiny_job_and_candidates():
    """The calibration job of bench/plan.py (examples/tiny-grpo-megatron.yaml) and a few of its 2-device candidates."""
    from hybridflow.mapping import Candidate, Placement

    job = load_job(ROOT / "examples" / "tiny-grpo-megatron.yaml")
    co, own = (("actor", "reference", "rollout"),), (("actor", "reference"), ("rollout",))
    cands = {
        "fsdp mb64": Candidate(Placement(co, "sync"), (2,), Layout("fsdp", 1, 1, 1, 64)),
        "fsdp mb8": Candidate(Placement(co, "sync"), (2,), Layout("fsdp", 1, 1, 1, 8)),
        "megatron t2 mb64": Candidate(Placement(co, "sync"), (2,), Layout("megatron", 2, 1, 1, 64)),
        "own sync": Candidate(Placement(own, "sync"), (1, 1), Layout("fsdp", 1, 1, 1, 64)),
        "own one_step_off": Candidate(Placement(own, "one_step_off"), (1, 1), Layout("fsdp", 1, 1, 1, 64)),
    }
    return job, _shapes_of(job), cands


def _fsdp_switches(job, **switches: str):
    """`job` with FSDP communication switches (spec.training.keepGatheredForBackward, reduceGradientsPerStep) set."""
    doc = dump_job(job)
    doc["spec"].setdefault("training", {}).update(switches)
    return parse_job(doc)


def test_the_update_prices_the_fsdp_switches_as_the_engine_resolves_them():
    """keepGatheredForBackward and reduceGradientsPerStep (issue 57), resolved by the engine's rule
    (api.training.fsdp_switch_on): auto is on for a CPU pool of two ranks, where the update then gathers each layer
    once per optimizer step instead of twice per micro-batch, and reduce-scatters once per step instead of once per
    micro-batch: each switch takes communication off "off". On one rank and on GPUs auto is off, and prices as
    "off". A forward without backward (the reference's; the actor's old log-probs off-policy) gathers per forward
    either way."""
    from hybridflow.mapping.search import predict
    from hybridflow.mapping.stage_time import calibration_for, fsdp_switched

    job, shapes, cands = _tiny_job_and_candidates()
    off = _fsdp_switches(job, keepGatheredForBackward="off", reduceGradientsPerStep="off")
    keep = _fsdp_switches(off, keepGatheredForBackward="auto")
    auto = _fsdp_switches(keep, reduceGradientsPerStep="auto")
    cpu = calibrated(PROFILES["cpu"], 1e12)
    two = [predict(j, shapes, cands["fsdp mb8"], cpu)[1] for j in (off, keep, auto)]
    assert two[0]["update"] > two[1]["update"] > two[2]["update"]
    assert two[0]["prepare"] == two[2]["prepare"]
    work, two_ranks = workload(auto.spec), Parallel(2, micro=8)
    forward = [pass_s(shapes["actor"], work, work.pass_tokens("fsdp"), "forward", par, cpu, calibration_for(cpu))
               for par in (two_ranks, fsdp_switched(two_ranks, auto.spec.training, "cpu"))]
    assert forward[0] == forward[1]
    assert predict(auto, shapes, cands["own sync"], cpu)[1] == predict(off, shapes, cands["own sync"], cpu)[1]
    assert predict(auto, shapes, cands["fsdp mb8"], H100)[1] == predict(off, shapes, cands["fsdp mb8"], H100)[1]


def test_the_planner_offers_no_model_parallel_engine_to_a_job_with_an_fsdp_switch_on():
    """api.rules refuses keepGatheredForBackward or reduceGradientsPerStep "on" with an engine that gathers nothing,
    so no candidate trains with one."""
    from hybridflow.mapping.candidates import train_engines

    assert "megatron" in train_engines(_job().spec)
    for field in ("keepGatheredForBackward", "reduceGradientsPerStep"):
        assert train_engines(_job(training={field: "on"}).spec) == ["fsdp"]


def test_fixed_costs_are_monotone_and_appear_in_the_predictions():
    """Each fixed cost of the cpu calibration (stage_time.Calibration's second group) adds to every prediction that
    pays it and takes from none: more of it, a slower step; the cpu profile gets its calibration by default, the
    GPU profiles the defaults (fixed costs 0)."""
    from dataclasses import replace

    from hybridflow.mapping.search import predict
    from hybridflow.mapping.stage_time import CALIBRATIONS, calibration_for

    job, shapes, cands = _tiny_job_and_candidates()
    cpu = calibrated(PROFILES["cpu"], 1e12)
    cal = calibration_for(cpu)
    assert cal is CALIBRATIONS["cpu"] and calibration_for(H100) == Calibration()
    fixed = ("call_s", "layer_op_s", "collective_latency_s", "optimizer_step_s", "decode_row_s", "weight_load_s",
             "driver_step_s")
    assert all(getattr(Calibration(), k) == 0 for k in fixed if k != "collective_latency_s")
    bare = replace(cal, **{k: 0.0 for k in fixed}, kernel_step_s=0.0)
    for name, cand in cands.items():
        base = predict(job, shapes, cand, cpu, bare)[0]
        assert 0 < base < 0.05, (name, base)  # a tiny model's FLOPs and bytes: milliseconds
        full = predict(job, shapes, cand, cpu)[0]
        assert full == predict(job, shapes, cand, cpu, cal)[0] > 10 * base  # on CPU the fixed costs are the step
        for k in fixed:
            steps = [predict(job, shapes, cand, cpu, replace(cal, **{k: getattr(cal, k) * f}))[0] for f in (0, 1, 2)]
            assert steps[0] < steps[1] < steps[2], (name, k, steps)  # every one of them is paid by every candidate
    # more micro-batches pay more per-micro-batch costs; megatron's tensor-parallel collectives cost more still
    step = {n: predict(job, shapes, c, cpu)[0] for n, c in cands.items()}
    assert step["fsdp mb8"] > step["fsdp mb64"] and step["megatron t2 mb64"] > step["fsdp mb64"]


def test_the_overlapped_modes_run_the_old_log_prob_pass_and_pools_side_by_side_contend():
    """one_step_off and async train on a batch older than the policy: the actor's separate old-log-prob forward is
    in their prepare stage (trainer/step.py skips it in sync only); pool_overlap < 1 makes side-by-side pools pay
    part of the shorter side's seconds, and 1 is the plain max."""
    from dataclasses import replace

    from hybridflow.mapping.search import predict
    from hybridflow.mapping.stage_time import calibration_for, side_by_side, step_s

    job, shapes, cands = _tiny_job_and_candidates()
    cpu = calibrated(PROFILES["cpu"], 1e12)
    _, sync = predict(job, shapes, cands["own sync"], cpu)
    _, off = predict(job, shapes, cands["own one_step_off"], cpu)
    assert off["prepare"] > sync["prepare"] and off["generate"] == sync["generate"]
    cal = calibration_for(cpu)
    assert side_by_side(3.0, 5.0, replace(cal, pool_overlap=1.0)) == 3.0
    assert side_by_side(3.0, 5.0, replace(cal, pool_overlap=0.0)) == 5.0
    overlapped = [step_s("one_step_off", 1.0, 0.0, 0.1, 0.5, 0.5, 0.1, replace(cal, pool_overlap=ov))
                  for ov in (1.0, 0.5, 0.0)]
    assert overlapped[0] == pytest.approx(1.2) and overlapped[0] < overlapped[1] < overlapped[2] == \
        pytest.approx(2.2)
    assert step_s("sync", 1.0, 0.1, 0.1, 0.5, 0.5, 0.1, cal) == pytest.approx(2.3)


def test_the_search_scores_a_candidate_as_predict_does():
    """The vectorized search and the one-candidate `predict` (bench/plan.py's) give the same step seconds."""
    from hybridflow.mapping.search import predict

    job, shapes, _ = _tiny_job_and_candidates()
    cpu = calibrated(PROFILES["cpu"], 1e12)
    result = search(job, shapes, 2, cpu, top=10)
    assert result.ranked
    for r in result.ranked:
        assert predict(job, shapes, r.candidate, cpu)[0] == pytest.approx(r.step_seconds, rel=1e-9), r.label


def test_the_cpu_calibration_is_the_fit_of_the_runs_kept_beside_the_bench():
    """CALIBRATIONS["cpu"] is what `bench/plan.py --from-json bench/plan_fit.json --fit abcefgj` fits (its
    provenance), to the 3 significant digits kept; and the held-out placements' predictions are within 25% there.
    The kept runs predate the FSDP switches (issue 57): they gathered and reduced per micro-batch, so the bench prices
    them with both switches off (bench/plan.py as_measured)."""
    import importlib.util
    import json
    import sys

    from hybridflow.mapping.stage_time import CALIBRATIONS

    spec = importlib.util.spec_from_file_location("bench_plan", ROOT / "bench" / "plan.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_plan"] = bench
    try:
        spec.loader.exec_module(bench)
        kept = json.loads((ROOT / "bench" / "plan_fit.json").read_text())
        device = calibrated(PROFILES["cpu"], kept["peak_flops"], kept["fp32_peak_flops"])
        job = bench.as_measured(load_job(bench.JOB), kept)
        assert all(fsdp_switch_on(getattr(job.spec.training, f), "cpu", 2) is False
                   for f in ("keep_gathered_for_backward", "reduce_gradients_per_step"))  # kept before the switches
        shapes = _shapes_of(job)
        measured = bench.load_measured(str(ROOT / "bench" / "plan_fit.json"))
        runs = [r for r in bench.RUNS if r.key in "abcefgj"]
        cal, _ = bench.fit(job, shapes, device, runs, measured, CALIBRATIONS["cpu"])
    finally:
        del sys.modules["bench_plan"]
    for k in bench.FITTED:
        assert getattr(CALIBRATIONS["cpu"], k) == pytest.approx(getattr(cal, k), rel=5e-3, abs=1e-9), k
    for r in bench.RUNS:
        if r.key in "dhi":
            got = bench.measured_step(measured[r.key])
            assert abs(bench.predict(job, shapes, r.candidate, device)[0] / got - 1) < 0.25, r.key
