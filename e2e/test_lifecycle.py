"""Scenario: lifecycle. Suspend and resume mid-run (pods and their processes go, the job keeps its checkpoints and
continues where it stopped); delete mid-run (every process and object goes)."""
from __future__ import annotations

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
