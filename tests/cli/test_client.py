"""The Python client (issue 30 item 3): the same calls against a cluster and against local runs. On the cluster: the
real operator over HTTP against the kube-apiserver double, its pods driven by the kubelet double, a real driver
exporter (JobMetrics) on loopback giving the steps the operator reads: submit, wait with progress, the driver's log,
a failure raised with the driver's words. Locally: the session's run of examples/tiny-grpo.yaml is itself submitted
and waited for through the client (conftest.tiny_example_job); its step log, checkpoints and export are read
through both backends (the cluster's from where a pod would mount the job's checkpoint claim)."""
from __future__ import annotations

import copy
import signal
import threading
from pathlib import Path

import pytest
import yaml
from kube.apiserver_double import RunningApiServer
from kube.harness import Kube, free_port, wait_for
from kube.operator_cluster import _started_cluster

from hybridflow import client
from hybridflow.api import SpecError, dump_job, parse_job
from hybridflow.client.jobs import Snapshot, manifest, progress_line

from support.paths import ROOT

TINY = ROOT / "examples" / "tiny-grpo.yaml"


def test_a_manifest_is_taken_as_a_path_yaml_a_dict_or_a_job_and_bad_ones_are_named():
    by_path = manifest(TINY)
    text = TINY.read_text()
    assert manifest(str(TINY)) == by_path == manifest(text) == manifest(yaml.safe_load(text))
    assert manifest(by_path, name="try-2", namespace="ml").metadata.model_dump(exclude_none=True) == \
        {"name": "try-2", "namespace": "ml"}
    doc = yaml.safe_load(text)
    doc["spec"]["trainer"]["steps"] = 0
    with pytest.raises(SpecError, match=r"spec.trainer.steps"):
        manifest(doc)
    with pytest.raises(SpecError, match="no such file"):
        manifest("examples/nope.yaml")
    with pytest.raises(SpecError, match="not valid YAML"):
        manifest("apiVersion: [\n")


def test_progress_lines_say_step_throughput_eta_and_why_a_job_waits():
    assert progress_line("j", Snapshot("Running", 12, 40, 1234.4, 65.0)) == \
        "j: Running step 12/40 (30%) 1234 tok/s ETA 0:01:05"
    assert progress_line("j", Snapshot("Queued", 0, 40, message="waits for admission in LocalQueue a")) == \
        "j: Queued step 0/40 (0%) (waits for admission in LocalQueue a)"
    assert progress_line("j", Snapshot("Succeeded", 40, 40, 900.0, 0.0)) == "j: Succeeded step 40/40 (100%) 900 tok/s"


def _kubelet(api, kube, name, exporter, steps, log, exit_code=0):
    """The kubelet double's part of a job's life: its pods Running (the head on loopback, where the exporter
    serves), one step a second on the exporter (the operator reads them from it), the driver's log, the head's end."""
    wait_for(lambda: len(kube.pods(name)) == 2, 30, "the pods")
    for p in kube.pods(name):
        kube.set_pod_phase(p.metadata.name, "Running", pod_ip="127.0.0.1")
    for step in range(1, steps + 1):
        exporter.record_step({"step": step, "tokens": 100.0, "throughput_tokens_per_s": 1000.0 + step,
                              "throughput_per_device": 1.0, "generation_tokens_per_s": 1.0, "iteration_seconds": 1.0,
                              "eta_seconds": float(steps - step)}, {})
        wait_for(lambda: kube.status(name).get("step") == step, 30, f"step {step} in status")
    api.put_log(kube.namespace, f"{name}-head-g0", log)
    kube.set_pod_phase(f"{name}-head-g0", "Succeeded" if exit_code == 0 else "Failed", exit_code=exit_code)


def test_the_client_submits_waits_and_reads_a_job_on_the_cluster(tmp_path, capsys):
    from hybridflow.metrics import JobMetrics

    with _started_cluster(tmp_path) as (api, kubeconfig, _):
        jobs = client.connect(namespace="ml", kubeconfig=kubeconfig)
        kube = Kube(kubeconfig, namespace="ml")
        port = free_port()
        exporter = JobMetrics("cj")
        exporter.serve(port, "127.0.0.1")
        exporter.total_steps.labels("cj").set(3)
        doc = dump_job(manifest(TINY))
        doc["spec"]["metrics"] = {"port": port}
        doc["spec"]["trainer"]["steps"] = 3
        job = jobs.submit(doc, name="cj")
        assert kube.job("cj")["spec"]["trainer"]["steps"] == 3
        log = "loading the model\nstep 1/3 ...\nstep 3/3 ... done"
        kubelet = threading.Thread(target=_kubelet, args=(api, kube, "cj", exporter, 3, log), daemon=True)
        kubelet.start()
        final = job.wait(timeout=90, poll=0.2)
        kubelet.join(30)
        assert final.phase == "Succeeded" and final.step == 3 and final.total_steps == 3
        progress = capsys.readouterr().err.splitlines()
        assert any("cj: Running step 1/3 (33%)" in line and "tok/s" in line and "ETA" in line for line in progress)
        assert progress[-1].startswith("cj: Succeeded step 3/3 (100%)")
        assert list(job.logs()) == log.splitlines()
        assert jobs.get("cj").status() == final
        with pytest.raises(FileExistsError, match="RLHFJob ml/cj exists already"):
            jobs.submit(doc, name="cj")
        with pytest.raises(SpecError, match="keeps its checkpoints inside its pods only"):
            job.checkpoints()

        failing = copy.deepcopy(doc)
        job2 = jobs.submit(failing, name="cj-fails")
        wait_for(lambda: len(kube.pods("cj-fails")) == 2, 30, "the pods")
        api.put_log("ml", "cj-fails-head-g0", "error: spec.data.train: 'x.jsonl' does not exist")
        kube.set_pod_phase("cj-fails-head-g0", "Failed", exit_code=2)  # the driver rejects its input
        with pytest.raises(client.JobFailed, match="job cj-fails failed: the driver rejected the job's input"):
            job2.wait(timeout=30, poll=0.2, progress=False)
        assert list(job2.logs())[-1].endswith("'x.jsonl' does not exist")
        job2.delete()
        wait_for(lambda: kube.job("cj-fails") is None, 30, "deleted")
        with pytest.raises(LookupError, match="RLHFJob ml/cj-fails"):
            job2.status()


def test_local_runs_are_known_to_any_client_and_delete_stops_them(tmp_path, monkeypatch):
    """A relative workdir and a relative data path mean what they mean where the script runs; a run that fails says
    why (the driver's words), to this client and to another one; delete() interrupts a run and leaves nothing of
    its session behind."""
    import os

    monkeypatch.chdir(tmp_path)  # where examples/gsm8k-style.yaml's relative data files are not
    doc = yaml.safe_load((ROOT / "examples" / "gsm8k-style.yaml").read_text())
    jobs = client.local("runs")
    failing = jobs.submit(doc, name="no-prompts")
    assert failing.root == tmp_path / "runs" / "no-prompts"
    with pytest.raises(client.JobFailed, match="examples/data/gsm8k_style/train.parquet"):
        failing.wait(timeout=120, poll=0.2, progress=False)
    assert f"relative to {tmp_path})" in failing.status().message  # the script's directory, not the run's
    again = client.local(tmp_path / "runs").get("no-prompts")  # another client, from the files alone
    assert again.status().failed and again.status().message == failing.status().message
    assert again.status().message.startswith("exit code 2: ")
    with pytest.raises(FileExistsError, match="a run of job no-prompts is there already"):
        jobs.submit(doc, name="no-prompts")

    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script in a non-interactive shell's background has
    try:  # it (CI's): the run must take an interrupt all the same
        running = jobs.submit(TINY, name="stopped")
    finally:
        signal.signal(signal.SIGINT, ignored)
    pgid = int((running.root / "pgid").read_text())
    wait_for(lambda: any(line.startswith("job stopped:") for line in running.logs()), 120, "the driver started")
    running.delete()
    st = running.status()
    assert st.failed and st.reason == "Deleted" and st.step < st.total_steps, st
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # the run, its supervisor and anything they started: gone


def test_a_cluster_client_uses_the_context_it_is_given(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "a",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "a", "context": {"cluster": "c", "user": "u", "namespace": "team-a"}},
                     {"name": "b", "context": {"cluster": "c", "user": "u", "namespace": "team-b"}}]}))
    assert client.connect(kubeconfig=str(kubeconfig)).namespace == "team-a"
    assert client.connect(kubeconfig=str(kubeconfig), context="b").namespace == "team-b"
    assert client.connect(kubeconfig=str(kubeconfig), context="b", namespace="ml").namespace == "ml"
    with pytest.raises(LookupError, match="no context 'z'"):
        client.connect(kubeconfig=str(kubeconfig), context="z")


@pytest.mark.slow
def test_a_local_run_and_the_same_job_on_a_cluster_read_alike(tiny_example_job, tmp_path):
    """The session's tiny run, submitted and waited for through client.local (conftest): status, log, step log,
    checkpoints and export; a later client finds it by name. Then the same checkpoints as a cluster job's, read
    through client.connect where a pod mounting the job's checkpoint claim sees them."""
    job = tiny_example_job
    final = job.status()
    assert final.phase == "Succeeded", "\n".join(list(job.logs())[-30:])
    assert final.step == final.total_steps == 40 and final.tokens_per_second > 0
    steps = job.steps()
    assert [r["step"] for r in steps] == list(range(1, 41))
    found = job.checkpoints()
    assert found and found[-1] == final.last_checkpoint and found[-1].endswith("step_00000040")
    assert any("step 40/40" in line for line in job.logs())
    again = client.local(job.root.parent).get(job.name)
    assert again.status() == final and again.process is None
    model = job.export(tmp_path / "model")
    assert (model / "config.json").exists() and list(model.glob("*.safetensors"))

    mount = tmp_path / "claim"
    (mount / "ml").mkdir(parents=True)
    (mount / "ml" / "tiny-grpo").symlink_to(job.checkpoint_dir)  # the job's directory on its claim
    with RunningApiServer(str(tmp_path / "kubeconfig")) as api:
        on_cluster = client.connect(namespace="ml", kubeconfig=api.kubeconfig_path, checkpoint_mount=mount)
        doc = dump_job(parse_job(yaml.safe_load(TINY.read_text())))
        doc["spec"]["kubernetes"] = {"checkpointPvc": "ck"}
        submitted = on_cluster.submit(doc)
        # What the operator writes once the job is done (its run is the local one above; the operator's own
        # submit-wait path: test_the_client_submits_waits_and_reads_a_job_on_the_cluster). It reports the pod's path
        # of the newest checkpoint; this client reads it where it has the claim.
        from hybridflow.api.storage import CHECKPOINT_MOUNT

        Kube(api.kubeconfig_path, "ml").custom.patch_namespaced_custom_object_status(
            "hybridflow.io", "v1alpha1", "ml", "rlhfjobs", "tiny-grpo",
            {"status": {"phase": "Succeeded", "step": 40, "totalSteps": 40,
                        "lastCheckpoint": f"{CHECKPOINT_MOUNT}/ml/tiny-grpo/step_00000040"}})
        done = submitted.wait(timeout=30, poll=0.2, progress=False)
        assert done.last_checkpoint == str(mount / "ml" / "tiny-grpo" / "step_00000040")
        assert (submitted.export(tmp_path / "newest", checkpoint=done.last_checkpoint) / "config.json").exists()
        assert submitted.steps() == steps
        assert [Path(p).name for p in submitted.checkpoints()] == [Path(p).name for p in found]
        older = int(Path(found[0]).name.removeprefix("step_"))
        exported = submitted.export(tmp_path / "older", checkpoint=older)  # by step number
        assert (exported / "config.json").exists()
        with pytest.raises(SpecError, match="connect\\(checkpoint_mount=...\\)"):
            client.connect(namespace="ml", kubeconfig=api.kubeconfig_path).get("tiny-grpo").steps()
