"""A Python client for people who script experiments: submit an RLHFJob (a manifest path, YAML text, a dict or a
parsed RLHFJob), wait with progress, read the driver's log, the status and the step log, list the checkpoints and
export one as an HF model; the same calls against a cluster (`connect`) and against local `hybridflow run`s
(`local`), so a script tried on a laptop runs unchanged on a cluster.

    from hybridflow import client

    jobs = client.local("runs")                      # or client.connect(namespace="team-a")
    job = jobs.submit("examples/tiny-grpo.yaml", name="try-1")
    final = job.wait()                               # progress on stderr; JobFailed names the driver's error
    print(job.steps()[-1]["throughput_tokens_per_s"], job.checkpoints()[-1])
    job.export("try-1-model")                        # the newest intact checkpoint, as an HF model directory
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.client.jobs import Job, JobFailed, Snapshot, Source, manifest, progress_line

if TYPE_CHECKING:
    from hybridflow.client.cluster import KubernetesJobs
    from hybridflow.client.local_runs import LocalJobs

__all__ = ["Job", "JobFailed", "Snapshot", "Source", "connect", "local", "manifest", "progress_line"]


def connect(namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None,
            checkpoint_mount: str | Path | None = None) -> KubernetesJobs:
    """RLHFJobs on the cluster of your kubeconfig (or of the pod this runs in), in `namespace` (default: the
    context's). See hybridflow.client.cluster.KubernetesJobs."""
    from hybridflow.client.cluster import KubernetesJobs

    return KubernetesJobs(namespace, kubeconfig, context, checkpoint_mount)


def local(workdir: str | Path = "hybridflow-runs", env: dict[str, str] | None = None,
          ray_temp_dir: str | None = None) -> LocalJobs:
    """Jobs run here by `hybridflow run`, each in `<workdir>/<name>/`. See hybridflow.client.local_runs.LocalJobs."""
    from hybridflow.client.local_runs import LocalJobs

    return LocalJobs(workdir, env, ray_temp_dir)
