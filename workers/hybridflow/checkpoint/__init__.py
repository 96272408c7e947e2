"""Checkpoints in one package, torch-free at this level: the store (local or object storage, `store`), whose
checkpoint it is (`identity`), writing, sealing, verifying and pruning (`sealing`), the step and rollout logs
(`steplog`), and one job's checkpointDir owning the three (`root`: CheckpointRoot); with torch, the DCP shards
(`dcp`), the role side (`role`) and the controller's `checkpointer` (cadence, save, resume), imported as
submodules. The names below are the package's interface for the rest of the runtime and the CLI."""
from __future__ import annotations

from hybridflow.checkpoint.identity import check_compatible, identity, model_architecture, read_identity
from hybridflow.checkpoint.root import CheckpointRoot
from hybridflow.checkpoint.sealing import (
    checkpoint_at, latest_good, remove_unsealed, seal, staging_dir, verify, verify_once, writing,
)
from hybridflow.checkpoint.steplog import (
    STEP_LOG, append_step_log, read_rollouts, read_step_log, rewind_rollouts, rewind_step_log, rollout_path,
    rollout_steps, write_rollouts,
)
from hybridflow.checkpoint.store import (
    MANIFEST, TRAINER_STATE, CheckpointError, StoragePath, is_remote, list_checkpoints, load_tensors, open_root,
    relative, sha256, size_bytes, step_dir, storage_path,
)

__all__ = [
    "MANIFEST", "STEP_LOG", "TRAINER_STATE", "CheckpointError", "CheckpointRoot", "StoragePath", "append_step_log",
    "check_compatible", "checkpoint_at", "identity", "is_remote", "latest_good", "list_checkpoints", "load_tensors",
    "model_architecture", "open_root", "read_identity", "read_rollouts", "read_step_log", "relative", "remove_unsealed",
    "rewind_rollouts", "rewind_step_log", "rollout_path", "rollout_steps", "seal", "sha256", "size_bytes",
    "staging_dir", "step_dir", "storage_path", "verify", "verify_once", "write_rollouts", "writing",
]
