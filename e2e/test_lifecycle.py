"""Scenario: lifecycle. One job through a whole life: suspended mid-run (pods and their processes go, the job keeps
its status and checkpoints), resumed (continues where it stopped), deleted mid-run (every process and object of it
goes, its checkpoint claim stays), and resized: a new job with a pool of one pod instead of two resumes from the
deleted job's checkpoint on the same claim."""
from __future__ import annotations

from pathlib import Path

import yaml
from kube.harness import wait_for

from e2e.helpers import job_variant, live_pod_names, phase
from e2e.worlds import LocalWorld

STEPS = 80  # long enough (about 30 s here) that the suspend and the delete land mid-run


def _suspend(world, name: str, suspend: bool) -> None:
    world.kubectl("patch", "rlhfjob", name, "--type=merge", "-p",
                  '{"spec":{"runPolicy":{"suspend":%s}}}' % ("true" if suspend else "false"))


def _checkpoint(world, name: str, after: int = 0) -> int:
    return wait_for(lambda: (c := world.kube.status(name).get("lastCheckpointStep", 0)) > after and c, 300,
                    f"{name}: a checkpoint after step {after}")


def _mounts(world, pod: str) -> dict[str, tuple[str, set[str]]]:
    """Mount point -> (the directory of its filesystem it shows, its options) as the pod's running container sees
    them (the kubelet double's process for it; local world only)."""
    rp = next(p for p in list(world.kubelet.pods.values()) if p.name == pod and not p.deleted)
    out = {}
    for line in Path(f"/proc/{rp.procs[-1].pid}/mountinfo").read_text().splitlines():
        f = line.split()
        out[f[4]] = (f[3], set(f[5].split(",")))
    return out


def test_suspend_resume_delete_and_resize_mid_run(world, tmp_path):
    old, new = "life-two", "life-one"
    changes = {"trainer": {"steps": STEPS, "saveFreq": 3}, "metrics": {"port": 8000, "lingerSeconds": 0}}
    world.kubectl("apply", "--validate=false", "-f", str(job_variant(tmp_path, old, **changes)))
    wait_for(lambda: phase(world, old) == "Running", 300, f"{old} Running")
    assert len(live_pod_names(world.kube, old)) == 3  # the head and a pool of two
    _checkpoint(world, old)

    # suspend mid-run: the pods and their processes go; the status and the checkpoints stay
    _suspend(world, old, True)
    wait_for(lambda: phase(world, old) == "Suspended", 60, "phase Suspended")
    wait_for(lambda: not live_pod_names(world.kube, old), 120, "pods deleted")
    wait_for(lambda: not world.leftovers(old), 60, "the pods' processes ended")
    stopped_at = world.step_log(old)[-1]
    assert stopped_at < STEPS, "the job finished before the suspend landed"
    sealed = world.kube.status(old)["lastCheckpointStep"]

    # resume: the job continues from its checkpoint, each step exactly once
    _suspend(world, old, False)
    wait_for(lambda: phase(world, old) == "Running", 300, f"{old} Running again")
    sealed = _checkpoint(world, old, after=max(sealed, stopped_at))
    logged = world.step_log(old)
    assert logged == list(range(1, logged[-1] + 1)), "a step was lost or repeated across the suspend"

    # delete mid-run: the job, its pods, ConfigMap, Service, pod sandboxes and every process go
    if world.local:
        assert world.leftovers(old), "the job's pods run no processes?"
    sealed = world.kube.status(old)["lastCheckpointStep"]
    world.kubectl("delete", "rlhfjob", old, "--wait=false")
    wait_for(lambda: world.kube.job(old) is None, 120, "the RLHFJob gone")
    wait_for(lambda: not world.kube.pods(old), 120, "pods gone")
    wait_for(lambda: not world.leftovers(old), 60, "every process and pod sandbox of the job gone")
    for kind, lister in (("configmap", world.kube.core.list_namespaced_config_map),
                         ("service", world.kube.core.list_namespaced_service),
                         ("secret", world.kube.core.list_namespaced_secret)):
        left = [o.metadata.name for o in lister("default").items if o.metadata.name.startswith(f"{old}-")]
        assert not left, f"{kind}s left: {left}"
    ran_to = world.step_log(old)[-1]
    assert ran_to < STEPS, "the job finished before the delete landed"

    # resize: a job's spec is immutable but for runPolicy, so a new job with the new pool names the old one's
    # checkpoints (`trainer.resumeFrom: <old job>`, on the same claim); what two pods wrote re-shards onto one. It
    # runs a few steps past the old job's last, not on to STEPS: those steps would only repeat what it shows.
    resized_steps = ran_to + 3
    pvc, doc = yaml.safe_load_all(job_variant(tmp_path, new, trainer={"steps": resized_steps, "saveFreq": 3,
                                                                      "resumeFrom": old},
                                              metrics={"port": 8000, "lingerSeconds": 0}).read_text())
    doc["spec"]["resourcePools"] = [{"name": "default", "nodes": 1, "devicesPerNode": 1}]
    doc["spec"]["kubernetes"]["checkpointPvc"] = f"{old}-checkpoints"  # where the old job's checkpoints are
    manifest = tmp_path / f"{new}-only.yaml"
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
    world.kubectl("apply", "--validate=false", "-f", str(manifest))
    wait_for(lambda: phase(world, new) == "Running", 300, f"{new} Running")
    assert len(live_pod_names(world.kube, new)) == 2  # the head and a pool of one
    if isinstance(world, LocalWorld):  # issue 24 N6: the claim by subPath only, the old job's read-only
        for pod in live_pod_names(world.kube, new):
            seen = _mounts(world, pod)
            own, source = seen["/var/lib/hybridflow/checkpoints/default/" + new], \
                seen["/var/lib/hybridflow/resume-from/default/" + old]
            assert own[0].endswith(f"/{old}-checkpoints/default/{new}") and "rw" in own[1], (pod, own)
            assert source[0].endswith(f"/{old}-checkpoints/default/{old}") and "ro" in source[1], (pod, source)
            assert "/var/lib/hybridflow/checkpoints" not in seen, pod  # never the whole claim
    wait_for(lambda: phase(world, new) in ("Succeeded", "Failed"), 600, "the resized job's end")
    st = world.kube.status(new)
    assert st["phase"] == "Succeeded", st
    steps = world.step_log(new, claim=f"{old}-checkpoints")
    resumed_at = steps[0] - 1
    assert sealed <= resumed_at <= ran_to and resumed_at % 3 == 0, (sealed, resumed_at, ran_to)
    assert steps == list(range(resumed_at + 1, resized_steps + 1)), "each step after the checkpoint exactly once"
