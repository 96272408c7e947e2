"""Scenario: lifecycle. Suspend and resume mid-run (pods and processes go, the job keeps its checkpoints and
continues where it stopped); delete mid-run (every process and object goes)."""
from __future__ import annotations

import psutil
from kube.harness import wait_for

from e2e.helpers import job_variant, live_pod_names, step_log

STEPS = 30
LONG = {"trainer": {"steps": STEPS, "saveFreq": 3}, "metrics": {"port": 8000, "lingerSeconds": 0}}


def _start(world, tmp_path, name):
    world.kubectl("apply", "--validate=false", "-f", str(job_variant(tmp_path, name, **LONG)))
    wait_for(lambda: world.kube.status(name).get("phase") == "Running", 180, f"{name} Running")
    wait_for(lambda: (world.kube.status(name).get("lastCheckpointStep") or 0) >= 3, 180, "a checkpoint")


def _job_processes(name):
    """Processes of the job's pods still alive anywhere in the e2e namespace (Ray, the driver, workers)."""
    out = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            env = p.info["environ"] or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if env.get("POD_NAME", "").startswith(f"{name}-"):
            out.append(p.pid)
    return out


def test_suspend_and_resume_mid_run(world, tmp_path):
    name = "life-suspend"
    _start(world, tmp_path, name)
    world.kubectl("patch", "rlhfjob", name, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}')
    wait_for(lambda: world.kube.status(name).get("phase") == "Suspended", 60, "phase Suspended")
    wait_for(lambda: not live_pod_names(world.kube, name), 60, "pods deleted")
    wait_for(lambda: not _job_processes(name), 30, "the pods' processes ended")
    stopped_at = step_log(world, name)[-1]
    assert stopped_at < STEPS
    world.kubectl("patch", "rlhfjob", name, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":false}}}')
    wait_for(lambda: world.kube.status(name).get("phase") in ("Succeeded", "Failed"), 300, "the end after resume")
    st = world.kube.status(name)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS, st
    assert step_log(world, name) == list(range(1, STEPS + 1))


def test_delete_mid_run_removes_every_process_and_object(world, tmp_path):
    name = "life-delete"
    _start(world, tmp_path, name)
    assert _job_processes(name), "the job's pods run no processes?"
    world.kubectl("delete", "rlhfjob", name, "--wait=false")
    wait_for(lambda: world.kube.job(name) is None, 90, "the RLHFJob gone")
    wait_for(lambda: not world.kube.pods(name), 60, "pods gone")
    wait_for(lambda: not _job_processes(name), 30, "every process of the job ended")
    assert not [n for n in world.net.namespaces() if n.startswith(f"default.{name}-")], "a pod sandbox is left"
    for kind in ("v1/configmaps", "v1/services"):
        assert not [o for o in world.api.objects(kind, "default") if o["metadata"]["name"].startswith(f"{name}-")]
