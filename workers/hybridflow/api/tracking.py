"""spec.tracking: the experiment trackers the driver logs a job's metrics to (hybridflow.trainer.tracking builds
them, each registered under its field's name)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.api.fields import SpecModel


class MlflowTracking(SpecModel):
    tracking_uri: str = Field(
        ..., min_length=1, max_length=2048, pattern=r"^https?://",
        description="The MLflow tracking server, e.g. http://mlflow.mlflow.svc:5000. The client reads credentials "
        "from the driver's environment (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD)."
    )
    experiment: str | None = Field(
        None, min_length=1, max_length=500, description="The experiment the job's run goes to (created if "
        "missing). Default: the job's name."
    )


class WandbTracking(SpecModel):
    project: str = Field(..., min_length=1, max_length=128, pattern=r"^[^/\\#?%:]+$",
                         description="The Weights & Biases project the job's run goes to.")
    entity: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[^/\\#?%:]+$",
                               description="The team or user owning the project (default: the API key's).")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: the run is sent to W&B as it goes (WANDB_API_KEY in the driver's "
        "environment: kubernetes.trackingSecret); offline: it is written to <checkpointDir>/wandb only, to be sent "
        "later with `wandb sync` (needs a checkpointDir on a file system, as tensorboard does).")


class Tracking(SpecModel):
    """Experiment trackers the driver writes the job's metrics to, each a field named after its entry in
    hybridflow.trainer.tracking.TRACKERS."""

    tensorboard: bool = Field(
        False, description="Write the job's metrics as TensorBoard event files to <checkpointDir>/tensorboard after "
        "every step: what the step set on the driver's Prometheus endpoint, under the same names (a label's value "
        "after a slash: hybridflow_stage_duration_seconds/generate; a counter gives the step's increment), at the "
        "step's number, and the held-out reward before (step 0) and after training (the last step). One run per "
        "job: a resumed or restarted job writes to the same directory and the steps it does again replace their "
        "earlier points. Needs a checkpointDir on a file system (a PVC or a local path), not object storage."
    )
    mlflow: MlflowTracking | None = Field(
        None, description="Log the job to an MLflow run: the same series and names as tensorboard, at each step's "
        "number, and the resolved spec once as the run's parameters (spec.<field path>). One run per job: its id "
        "is kept in <checkpointDir>/mlflow-run.json, so a resumed or restarted job logs to the same run (the steps "
        "it does again get a second, later point); the run ends FINISHED when the job does."
    )
    wandb: WandbTracking | None = Field(
        None, description="Log the job to a Weights & Biases run: the same series and names as tensorboard, against "
        "hybridflow_step (so a resumed job's steps done again replace nothing and break no ordering), and the "
        "resolved spec once as its config. One run per job: its id is kept in <checkpointDir>/wandb-run.json, so a "
        "resumed or restarted job continues the same run."
    )
