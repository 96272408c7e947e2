"""spec.kubernetes: the pod-level settings of a job's head and pool pods (image, volumes, Secrets by reference,
requests). Its own module: the rest of the spec says what the job computes, this what its pods are made of."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.api.fields import ObjectName, Quantity, SpecModel


class Kubernetes(SpecModel):
    """Pod-level settings of the job's head and pool pods."""

    image: str = Field(
        "hybridflow/worker-cpu:0.1.0", min_length=1, max_length=1024,
        description="Image with Ray and this project installed."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")
    checkpoint_pvc: ObjectName | None = Field(
        None, description="PersistentVolumeClaim mounted at trainer.checkpointDir (needed to resume after a restart)."
    )
    tracking_secret: ObjectName | None = Field(
        None, description="Secret with the experiment trackers' credentials: its keys MLFLOW_TRACKING_TOKEN, "
        "MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD and WANDB_API_KEY become those variables in the head pod "
        "(where the driver logs to spec.tracking); its other keys are ignored. Passed by reference (secretKeyRef), "
        "never read by the operator."
    )
    checkpoint_secret: ObjectName | None = Field(
        None, description="Secret with the object-storage credentials of an s3:// (or az://) trainer.checkpointDir: "
        "its keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION (and the "
        "AZURE_STORAGE_* ones) become those variables in the head and pool pods; its other keys are ignored. The "
        "operator passes it by reference (secretKeyRef) and never reads it."
    )
    model_pvc: ObjectName | None = Field(
        None, description="PersistentVolumeClaim mounted read-only at /models (point models.*.path into it)."
    )
    ray_auth_secret: ObjectName | None = Field(
        None, description="Secret with key `token` shared by Ray head, workers and driver (RAY_AUTH_TOKEN), one the "
        "job's author may read; unset: the operator makes a random token for the job. Ray's token authentication is "
        "always on."
    )
    head_cpu: Quantity = Field("1", description="CPU request of the head pod (Ray head + controller; a Kubernetes "
                               "quantity, e.g. 500m).")
    head_memory: Quantity = Field("4Gi", description="Memory request and limit of the head pod (a Kubernetes "
                                  "quantity).")
    service_account_name: ObjectName | None = Field(None, description="ServiceAccount of the job's pods.")
    data_pvc: ObjectName | None = Field(
        None, description="PersistentVolumeClaim with the prompt files, mounted read-only in the head pod; "
        "spec.data.train and eval are paths inside it."
    )
    reward_config_map: ObjectName | None = Field(None, description="The job's code ConfigMap (named so for "
        "compatibility: it held only the reward file once): each code file under the key its field names (models."
        "reward.function.path, rollout.agent.toolsFile, environmentFile), copied at acceptance into the job's own "
        "immutable ConfigMap (sha256 in status.codeDigests) its pods mount: later edits change nothing. Never dataPvc.")
