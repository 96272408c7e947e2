"""Experiment trackers: after every step the driver hands each tracker what that step set on its Prometheus endpoint
(metrics.step_scalars), under the endpoint's names, so a curve has one name in Grafana and in the tracker.

A tracker is one entry of TRACKERS, named after its field of spec.tracking, built once the job knows the step it
resumed from: a tracker keeps one run per job across restarts, and a resumed job redoes the steps after its
checkpoint, whose earlier points must not stay beside the new ones.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import uuid
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

from hybridflow.api import RLHFJob, dump_job
from hybridflow.api.storage import is_url
from hybridflow.checkpoint.store import storage_path, write_json
from hybridflow.registry import Registry

log = logging.getLogger("hybridflow.trainer.tracking")


class Tracker(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self, finished: bool) -> None:
        """`finished`: the job ran its last step (else it failed or stopped, and a restart continues the run)."""


TrackerFactory = Callable[[RLHFJob, int], Tracker]  # (job, the step it resumed from: 0 for a fresh start)
TRACKERS: Registry[TrackerFactory] = Registry("experiment tracker")


class TensorBoardTracker:
    """Event files in <checkpointDir>/tensorboard, flushed after every step (a killed pod loses no logged step).
    Opened with purge_step = the step the job resumed from (0 for a fresh start): TensorBoard hides the points an
    earlier run wrote from that step on, the steps done after the checkpoint, which are done again now, and the
    resumed step itself, which the driver logs again from its step record (an earlier run may have been killed
    between sealing that step and logging it)."""

    def __init__(self, log_dir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_step)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


@TRACKERS.register("tensorboard")
def tensorboard_tracker(job: RLHFJob, resumed_step: int) -> Tracker:
    return TensorBoardTracker(Path(job.spec.trainer.checkpoint_dir) / "tensorboard", resumed_step)


MLFLOW_RUN_FILE = "mlflow-run.json"  # in checkpointDir: the job's run, found again by a restarted or resumed job
MLFLOW_BATCH = 1000  # metrics per log_batch request (MLflow's limit)
MLFLOW_PARAMS_BATCH = 100  # params per request (MLflow's limit)


class MlflowTracker:
    """The job's MLflow run. A logging request that fails is reported (once per step) and dropped: the tracking
    server being away does not stop training; the step log and Prometheus still have every step."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in scalars.items() if math.isfinite(v)]
        try:
            for i in range(0, len(metrics), MLFLOW_BATCH):
                self.client.log_batch(self.run_id, metrics=metrics[i:i + MLFLOW_BATCH], synchronous=True)
        except Exception as e:  # noqa: BLE001 - the tracker's outage is not the job's failure
            log.warning("spec.tracking.mlflow: step %d not logged to run %s (%s: %s)", step, self.run_id,
                        type(e).__name__, str(e).strip().splitlines()[0][:300] if str(e).strip() else "")

    def close(self, finished: bool) -> None:
        if finished:
            self.client.set_terminated(self.run_id, "FINISHED")


def spec_params(job: RLHFJob) -> dict[str, str]:
    """The resolved spec as MLflow parameters: one per leaf (spec.<camelCase path>), lists as JSON."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = (node if isinstance(node, str) else json.dumps(node))[:6000]
    walk("spec", dump_job(job)["spec"])
    return out


@TRACKERS.register("mlflow")
def mlflow_tracker(job: RLHFJob, resumed_step: int) -> Tracker:
    """The run kept in <checkpointDir>/mlflow-run.json when it is on the same tracking server (set RUNNING again),
    else a new run in the experiment, its parameters the resolved spec."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # an unreachable server: an error in seconds
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    cfg = job.spec.tracking.mlflow
    assert cfg is not None  # open_trackers calls this only when the field is set
    record = storage_path(job.spec.trainer.checkpoint_dir) / MLFLOW_RUN_FILE
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    try:
        kept = json.loads(record.read_text()) if record.exists() else {}
        if kept.get("tracking_uri") == cfg.tracking_uri:
            client.update_run(kept["run_id"], status="RUNNING")
            return MlflowTracker(client, kept["run_id"])
        name = cfg.experiment or job.metadata.name
        found = client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else client.create_experiment(name)
        run = client.create_run(experiment, run_name=job.metadata.name,
                                tags={"hybridflow.job": job.metadata.name,
                                      "hybridflow.checkpointDir": str(job.spec.trainer.checkpoint_dir)})
        params = [Param(k, v) for k, v in spec_params(job).items()]
        for i in range(0, len(params), MLFLOW_PARAMS_BATCH):
            client.log_batch(run.info.run_id, params=params[i:i + MLFLOW_PARAMS_BATCH])
    except Exception as e:
        raise RuntimeError(f"spec.tracking.mlflow: cannot log to {cfg.tracking_uri} ({type(e).__name__}: "
                           f"{str(e).strip()[:300]}); check trackingUri and the MLFLOW_TRACKING_* credentials") from e
    write_json(record, {"run_id": run.info.run_id, "tracking_uri": cfg.tracking_uri})
    return MlflowTracker(client, run.info.run_id)


WANDB_RUN_FILE = "wandb-run.json"  # in checkpointDir: the job's W&B run id, continued by a restarted or resumed job
WANDB_STEP = "hybridflow_step"  # every series is plotted against it (W&B's own step only ever grows)
# How often the run's record (<checkpointDir>/wandb/.../run-<id>.wandb) reaches the disk: W&B's default, 15 s, lost
# every step a killed pod had logged in the 15 s before (all of a short run's, in the kill test).
WANDB_FLUSH_SECONDS = 1.0


class WandbTracker:
    """The job's Weights & Biases run. Every series is defined against hybridflow_step, which each log carries: a
    resumed job logs the steps it does again with W&B's own step still growing, so nothing is dropped as out of
    order (W&B keeps each point; the step log and TensorBoard say which one the job kept)."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({**{k: float(v) for k, v in scalars.items() if math.isfinite(v)}, WANDB_STEP: step})

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


@TRACKERS.register("wandb")
def wandb_tracker(job: RLHFJob, resumed_step: int) -> Tracker:
    """The run whose id <checkpointDir>/wandb-run.json keeps (resumed), else a new one, its config the resolved
    spec (nested, as W&B shows a config). Its files (an offline run's whole record) go to <checkpointDir>/wandb on a file system, else to scratch."""
    os.environ.setdefault("WANDB_SILENT", "true")  # logs stay quiet: W&B's banner and its run summary are not ours
    import wandb

    cfg = job.spec.tracking.wandb
    assert cfg is not None  # open_trackers calls this only when the field is set
    root = storage_path(job.spec.trainer.checkpoint_dir)
    record = root / WANDB_RUN_FILE
    kept = json.loads(record.read_text()) if record.exists() else {}
    run_id = kept.get("run_id") or uuid.uuid4().hex[:12]
    where = job.spec.trainer.checkpoint_dir
    files = Path(where) / "wandb" if not is_url(where) else Path(tempfile.mkdtemp(prefix="wandb-"))
    files.mkdir(parents=True, exist_ok=True)
    try:
        run = wandb.init(project=cfg.project, entity=cfg.entity, name=job.metadata.name, id=run_id, resume="allow",
                         mode=cfg.mode, dir=str(files), config={"spec": dump_job(job)["spec"]},
                         settings=wandb.Settings(silent=True, console="off", x_disable_stats=True,
                                                 x_transaction_log_flush_interval=WANDB_FLUSH_SECONDS))
    except Exception as e:
        raise RuntimeError(f"spec.tracking.wandb: cannot start run {run_id} in project {cfg.project} "
                           f"({type(e).__name__}: {str(e).strip()[:300]}); check the project, entity and "
                           "WANDB_API_KEY (kubernetes.trackingSecret)") from e
    run.define_metric(WANDB_STEP)
    run.define_metric("*", step_metric=WANDB_STEP)
    write_json(record, {"run_id": run_id, "project": cfg.project})
    return WandbTracker(run)


def open_trackers(job: RLHFJob, resumed_step: int) -> list[Tracker]:
    """The trackers spec.tracking turns on; if one cannot open, those opened before it are closed."""
    wanted, opened = job.spec.tracking.model_dump(), []
    try:
        for name in TRACKERS.names():
            if wanted.get(name):
                opened.append(TRACKERS[name](job, resumed_step))
    except BaseException:
        close_trackers(opened, finished=False)
        raise
    return opened


def close_trackers(trackers: list[Tracker], finished: bool) -> None:
    """Each tracker closed; one that fails to is reported, not raised (it would hide the job's own error)."""
    for tracker in trackers:
        try:
            tracker.close(finished)
        except Exception as e:  # noqa: BLE001
            log.warning("experiment tracker %s did not close (%s: %s)", type(tracker).__name__, type(e).__name__, e)


@contextlib.contextmanager
def tracking(job: RLHFJob, resumed_step: int) -> Iterator[list[Tracker]]:
    """The trackers spec.tracking turns on, open for the `with` block and closed after it: finished when the block
    ended (the job ran its last step), else the job failed or stopped and a restart continues the run."""
    trackers, finished = open_trackers(job, resumed_step), False
    try:
        yield trackers
        finished = True
    finally:
        close_trackers(trackers, finished)
