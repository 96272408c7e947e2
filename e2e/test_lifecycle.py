"""Scenario: lifecycle. Suspend and resume mid-run (pods and their processes go, the job keeps its checkpoints and
continues where it stopped); delete mid-run (every process and object goes); a resize to fewer pods (a new job
that resumes from the old one's checkpoint)."""
from __future__ import annotations

import yaml
from kube.harness import wait_for

from e2e.helpers import job_variant, live_pod_names, phase

STEPS = 80  # long enough (about 30 s here) that a suspend lands mid-run


def _start(world, tmp_path, name):
    changes = {"trainer": {"steps": STEPS, "saveFreq": 3}, "metrics": {"port": 8000, "lingerSeconds": 0}}
    world.kubectl("apply", "--validate=false", "-f", str(job_variant(tmp_path, name, **changes)))
    wait_for(lambda: phase(world, name) == "Running", 300, f"{name} Running")
    wait_for(lambda: world.kube.status(name).get("lastCheckpointStep", 0) >= 3, 300, "a checkpoint")


def test_suspend_and_resume_mid_run(world, tmp_path):
    name = "life-suspend"
    _start(world, tmp_path, name)
    world.kubectl("patch", "rlhfjob", name, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}')
    wait_for(lambda: phase(world, name) == "Suspended", 60, "phase Suspended")
    wait_for(lambda: not live_pod_names(world.kube, name), 120, "pods deleted")
    wait_for(lambda: not world.leftovers(name), 60, "the pods' processes ended")
    stopped_at = world.step_log(name)[-1]
    assert stopped_at < STEPS, "the job finished before the suspend landed"
    world.kubectl("patch", "rlhfjob", name, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":false}}}')
    wait_for(lambda: phase(world, name) in ("Succeeded", "Failed"), 600, "the end after resume")
    st = world.kube.status(name)
    assert st["phase"] == "Succeeded", st
    assert world.step_log(name) == list(range(1, STEPS + 1))


def test_delete_mid_run_removes_every_process_and_object(world, tmp_path):
    name = "life-delete"
    _start(world, tmp_path, name)
    if world.local:
        assert world.leftovers(name), "the job's pods run no processes?"
    world.kubectl("delete", "rlhfjob", name, "--wait=false")
    wait_for(lambda: world.kube.job(name) is None, 120, "the RLHFJob gone")
    wait_for(lambda: not world.kube.pods(name), 120, "pods gone")
    wait_for(lambda: not world.leftovers(name), 60, "every process and pod sandbox of the job gone")
    for kind, lister in (("configmap", world.kube.core.list_namespaced_config_map),
                         ("service", world.kube.core.list_namespaced_service)):
        left = [o.metadata.name for o in lister("default").items if o.metadata.name.startswith(f"{name}-")]
        assert not left, f"{kind}s left: {left}"


def test_a_job_resized_from_two_pods_to_one_resumes_where_the_old_one_stopped(world, tmp_path):
    """How a resize is asked for: a job's spec is immutable but for runPolicy, so the old job is suspended and a new
    one with the new pool names the old one's checkpoints (`trainer.resumeFrom: <old job>`, on the same claim). The
    checkpoint that two pods wrote re-shards onto one; the new job continues from its step."""
    old, new = "resize-two", "resize-one"
    _start(world, tmp_path, old)
    assert len(live_pod_names(world.kube, old)) == 3  # the head and a pool of two
    world.kubectl("patch", "rlhfjob", old, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}')
    wait_for(lambda: phase(world, old) == "Suspended", 60, "phase Suspended")
    wait_for(lambda: not live_pod_names(world.kube, old), 120, "pods deleted")
    sealed = world.kube.status(old)["lastCheckpointStep"]
    ran_to = world.step_log(old)[-1]
    assert ran_to < STEPS, "the job finished before the suspend landed"

    pvc, doc = yaml.safe_load_all(job_variant(tmp_path, new, trainer={"steps": STEPS, "saveFreq": 3,
                                                                      "resumeFrom": old},
                                              metrics={"port": 8000, "lingerSeconds": 0}).read_text())
    doc["spec"]["resourcePools"] = [{"name": "default", "nodes": 1, "devicesPerNode": 1}]
    doc["spec"]["kubernetes"]["checkpointPvc"] = f"{old}-checkpoints"  # where the old job's checkpoints are
    manifest = tmp_path / f"{new}-only.yaml"
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
    world.kubectl("apply", "--validate=false", "-f", str(manifest))
    wait_for(lambda: phase(world, new) == "Running", 300, f"{new} Running")
    assert len(live_pod_names(world.kube, new)) == 2  # the head and a pool of one
    wait_for(lambda: phase(world, new) in ("Succeeded", "Failed"), 600, "the resized job's end")
    st = world.kube.status(new)
    assert st["phase"] == "Succeeded", st
    steps = world.step_log(new, claim=f"{old}-checkpoints")
    resumed_at = steps[0] - 1
    assert sealed <= resumed_at <= ran_to and resumed_at % 3 == 0, (sealed, resumed_at, ran_to)
    assert steps == list(range(resumed_at + 1, STEPS + 1)), "each step after the checkpoint exactly once"
