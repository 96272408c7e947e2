"""`placement: auto` (issue 52, item 2): the spec takes it, the planner resolves it onto the devices of the job's
pools (hybridflow.mapping.auto), its record (summary and fields) is what a plan pod prints and status.plan holds,
hybridflow.api.plan lays those fields over the accepted spec (the operator and every pod build the same job), and
`hybridflow run` resolves it for this machine and runs it end to end."""
from __future__ import annotations

import json

import pytest
import yaml

from hybridflow.api import SpecError, dump_job, parse_job
from hybridflow.api.plan import PLAN_ENV, apply_plan, plan_from_text
from hybridflow.cli import main
from hybridflow.mapping.auto import resolve_auto
from hybridflow.mapping.search import PlanError
from hybridflow.memory import read_shapes

from support.paths import ROOT


def _auto_doc(example: str = "tiny-grpo.yaml", **spec) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    doc["metadata"]["name"] = "tiny-auto"
    doc["spec"]["placement"] = "auto"
    doc["spec"].update(spec)
    return doc


def _gpu_auto_job():
    doc = yaml.safe_load((ROOT / "examples" / "gpu-grpo-7b.yaml").read_text())
    doc["spec"]["placement"] = "auto"
    doc["spec"]["resourcePools"] = [{"name": "gpus", "nodes": 2, "devicesPerNode": 8, "device": "gpu",
                                     "accelerator": "h100-80gb"}]
    return parse_job(doc)


def test_the_spec_takes_auto_and_names_the_field_for_anything_else():
    assert parse_job(_auto_doc()).spec.placement == "auto"
    with pytest.raises(SpecError, match=r"spec.placement: Input should be 'auto', got 'automatic'"):
        parse_job(_auto_doc(placement="automatic"))
    job = parse_job(_auto_doc())
    assert job.spec.pool("rollout").name == "default"  # until resolved: every role on the first pool


def test_the_plan_re_cuts_the_pools_devices_and_its_fields_rebuild_the_same_job():
    job = _gpu_auto_job()
    plan = resolve_auto(job, read_shapes(job.spec, ROOT / "examples"))
    summary, fields = plan.record()["summary"], plan.record()["fields"]
    assert sum(summary["pools"].values()) == 16 and summary["accelerator"] == "h100-80gb"
    assert summary["mode"] == job.spec.rollout.mode  # the user's mode is theirs: only placements of it compete
    assert plan.job.spec.placement != "auto" and set(plan.job.spec.placed) >= set(job.spec.roles())
    rebuilt = apply_plan(job, json.loads(json.dumps(fields)))  # as a plan pod prints it and the operator reads it
    assert dump_job(rebuilt) == dump_job(plan.job)
    with pytest.raises(SpecError, match="only to a job with spec.placement: auto"):
        apply_plan(plan.job, fields)
    with pytest.raises(SpecError, match=r"status.plan.training: the plan decides only"):
        apply_plan(job, {**fields, "training": {"lr": 1.0}})


def test_a_plan_that_does_not_fit_its_devices_or_mixes_accelerators_names_the_pools():
    job = _gpu_auto_job()
    doc = dump_job(job)
    doc["spec"]["resourcePools"] = [{"name": "one", "devicesPerNode": 1, "device": "gpu", "accelerator": "l40s-48gb"}]
    small = parse_job(doc)
    shapes = read_shapes(small.spec, ROOT / "examples")
    with pytest.raises(PlanError, match=r"no placement of this job's models fits its 1 x l40s-48gb "
                                        r"\(spec.resourcePools"):
        resolve_auto(small, shapes)
    doc["spec"]["resourcePools"] += [{"name": "two", "devicesPerNode": 8, "device": "gpu",
                                      "accelerator": "h100-80gb"}]
    with pytest.raises(PlanError, match="spec.placement: auto plans one kind of device"):
        resolve_auto(parse_job(doc), shapes)


def test_plan_auto_writes_the_record_a_plan_pod_prints(tmp_path, capsys):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(_auto_doc()))
    out = tmp_path / "termination-log"
    assert main(["plan", str(job_file), "--auto", "--write-plan", str(out)]) == 0
    assert "placement auto: " in capsys.readouterr().out
    plan = plan_from_text(out.read_text(), str(out))
    assert plan["summary"]["devices"] == 2 and plan["summary"]["accelerator"] == "cpu"
    fixed = parse_job(_auto_doc())
    assert apply_plan(fixed, plan["fields"]).spec.placement == plan["fields"]["placement"]
    not_auto = tmp_path / "manual.yaml"
    not_auto.write_text((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    assert main(["plan", str(not_auto), "--auto"]) == 2
    assert "--auto plans a job with spec.placement: auto" in capsys.readouterr().err
    assert main(["plan", str(job_file), "--auto", "--devices", "8"]) == 2  # its devices are its pools'
    assert "--auto plans onto the devices of the job's own pools" in capsys.readouterr().err


def test_in_a_pod_the_operators_plan_is_used_as_given(tmp_path, monkeypatch):
    """Every pod of a job builds the same job: from the plan the operator hands it (PLAN_ENV), not from a plan of
    its own made on whatever machine it landed on."""
    from hybridflow.cli.device_map import placed

    job = parse_job(_auto_doc())
    fields = {"resourcePools": [{"name": "solo", "devicesPerNode": 2}], "placement": {"actor": "solo"},
              "training": {"microBatchSize": 4}}
    monkeypatch.setenv(PLAN_ENV, json.dumps({"summary": {}, "fields": fields}))
    used = placed(job, str(tmp_path / "job.yaml"), quiet=True)
    assert used.spec.resource_pools[0].name == "solo" and used.spec.training.micro_batch_size == 4
    monkeypatch.setenv(PLAN_ENV, "{not json")
    with pytest.raises(SpecError, match=f"{PLAN_ENV}: not a plan"):
        placed(job, str(tmp_path / "job.yaml"), quiet=True)


@pytest.mark.slow
def test_a_placement_auto_job_runs_end_to_end_here(tmp_path, run_here):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(_auto_doc(trainer={**_auto_doc()["spec"]["trainer"], "steps": 2})))
    rc, printed = run_here(job_file, {"spec.trainer.checkpointDir": str(tmp_path / "ckpt")}, cwd=tmp_path)
    assert rc == 0, printed
    assert "placement auto: " in printed and "on 2 x cpu" in printed, printed
    assert "done: 2 steps" in printed, printed


def test_an_async_job_may_ask_for_auto_and_its_plan_gives_the_rollout_a_pool_of_its_own():
    """The rule that async generation needs devices of its own holds for the plan, not for `auto` (issue 52 on
    Kubernetes: e2e/test_success.py runs this job so)."""
    from hybridflow.api.devices import PROFILES

    job = parse_job(_auto_doc("tiny-async-k8s.yaml"))
    plan = resolve_auto(job, read_shapes(job.spec, ROOT / "examples"), PROFILES["cpu"])
    assert plan.job.spec.rollout.mode == "async"
    assert plan.job.spec.pool("rollout").name != plan.job.spec.pool("actor").name
    with pytest.raises(SpecError, match="rollout needs devices of its own"):
        parse_job(_auto_doc("tiny-async-k8s.yaml", placement={"actor": "trainer", "rollout": "trainer"}))


def test_the_plan_keeps_to_the_nodes_the_pools_describe():
    """A job written for 4-GPU nodes gets no planned pod asking for 8: the profile's usual node gives way to the
    pools' own."""
    job = _gpu_auto_job()
    doc = dump_job(job)
    doc["spec"]["resourcePools"] = [{"name": "gpus", "nodes": 4, "devicesPerNode": 4, "device": "gpu",
                                     "accelerator": "h100-80gb"}]
    four = parse_job(doc)
    plan = resolve_auto(four, read_shapes(four.spec, ROOT / "examples"))
    assert all(p.devices_per_node <= 4 for p in plan.job.spec.resource_pools), plan.record()["fields"]
    assert sum(p.nodes * p.devices_per_node for p in plan.job.spec.resource_pools) == 16


def test_a_plan_nested_deeper_than_any_plan_is_refused_as_not_a_plan():
    """Refused as a SpecError naming its source, never an uncaught RecursionError (whether the JSON decoder recurses
    that deep depends on the interpreter's stack: where it does not, the value is refused for its shape)."""
    with pytest.raises(SpecError, match=r"pod x: (not a plan|a plan is)"):
        plan_from_text("[" * 1750 + "]" * 1750, "pod x")


def test_an_auto_jobs_podgroup_waits_for_its_plan():
    """Volcano's gang is sized by the job's pools: an unplanned `placement: auto` job has none yet, so its
    PodGroup is made from the planned job (at its first gang start), never from the pools as written."""
    from hybridflow_operator import manifests as mf

    job = _gpu_auto_job()
    doc = dump_job(job)
    doc["spec"]["runPolicy"] = {**doc["spec"].get("runPolicy", {}), "gangScheduling": True}
    doc["metadata"]["namespace"] = "ml"
    auto = parse_job(doc)
    kinds = [o["kind"] for o in mf.static_children(auto, "uid", "t" * 64, [])]
    assert "PodGroup" not in kinds and "ConfigMap" in kinds
    fields = {"resourcePools": [{"name": "one", "nodes": 2, "devicesPerNode": 8, "device": "gpu",
                                 "accelerator": "h100-80gb"}], "placement": {"actor": "one"}}
    planned = apply_plan(auto, fields)
    group = next(o for o in mf.static_children(planned, "uid", "t" * 64, [], accepted=auto) if o["kind"] == "PodGroup")
    assert group["spec"]["minMember"] == 1 + 2  # the head and the planned pool's two pods
