"""What the controller may call on each role, as typing Protocols: the driver's side of the driver-worker boundary.

A handle on a role (hybridflow.single_controller.worker_group.RoleHandle) is typed by one of these:
`handle.typed(ActorRole).call.compute_log_prob(batch)` is checked like any call. Each method is the worker class's
registered method (same name, parameters and defaults) as the controller sees it through its transfer protocol
(single_controller.protocol): a RANK_ZERO method returns rank 0's result, ONE_TO_ALL a list of every rank's,
DP_COMPUTE the data-parallel shards' results joined (a Batch) or listed, and a non-blocking one a `Pending` of that,
which another role's DP_COMPUTE call takes as it is (`BatchIn`). tests/roles/test_role_protocols.py holds every worker
class (hybridflow.api.roles names them) to its Protocol, so renaming a worker method fails there, not in a job.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Union

from hybridflow.single_controller.batch import Batch

if TYPE_CHECKING:
    from hybridflow.single_controller.worker_group import PendingResult as Pending

# A DP_COMPUTE method's batch from the controller: the data itself, or another call's pending result (its futures
# go straight to the ranks that hold the matching shards).
BatchIn = Union[Batch, "Pending[Batch]"]


class CheckpointedRole(Protocol):
    """A role with state to save: the actor and the critics (hybridflow.checkpoint.role.CheckpointMixin)."""

    def save_checkpoint(self, directory: str, asynchronous: bool = False) -> list[dict[str, str] | None]: ...
    def checkpoint_written(self) -> list[bool]: ...
    def finish_checkpoint(self) -> list[dict[str, str]]: ...
    def load_checkpoint(self, directory: str) -> list[None]: ...


class ReferenceRole(Protocol):
    """The frozen initial policy (hybridflow.roles.reference.ReferenceWorker; a LoRA actor's base, adapters off)."""

    def compute_ref_log_prob(self, batch: BatchIn) -> Pending[Batch]: ...


class ActorRole(CheckpointedRole, ReferenceRole, Protocol):
    """The policy being trained (hybridflow.roles.actor.ActorWorker); with LoRA also the reference (its base)."""

    def compute_log_prob(self, batch: BatchIn) -> Pending[Batch]: ...
    def update_actor(self, batch: BatchIn) -> list[dict[str, float]]: ...
    def num_parameters(self) -> int: ...
    def open_weight_stream(self, size: int, timeout_s: float) -> tuple[str, int]: ...
    def join_weight_stream(self, members: list[int], timeout_s: float) -> Pending[list[None]]: ...
    def send_weights(self, version: int, dtype: str) -> Pending[list[dict[str, float]]]: ...
    def weight_checksums_as(self, dtype: str) -> list[dict[str, float]]: ...


class RolloutRole(Protocol):
    """Generation, whichever worker serves it: beside the actor or as replicas of a pool of their own."""

    def generate(self, batch: BatchIn, greedy: bool = False) -> Pending[Batch]: ...
    def generation_dtype_name(self) -> str: ...
    def weight_checksums(self) -> list[dict[str, float]]: ...
    def instance_id(self) -> list[str]: ...


class ColocatedRolloutRole(RolloutRole, Protocol):
    """Generation on the actor's devices, fed in memory (hybridflow.roles.rollout.RolloutWorker)."""

    def sync_weights(self, version: int | None = None, profile: bool = False) -> list[dict[str, float]]: ...
    def train_checksum(self) -> list[dict[str, float]]: ...


class PooledRolloutRole(RolloutRole, Protocol):
    """Generation replicas on a pool of their own, fed by the actor's stream
    (hybridflow.roles.rollout.PooledRolloutWorker)."""

    def join_weight_stream(self, host: str, port: int, members: list[int],
                           timeout_s: float) -> Pending[list[int]]: ...
    def sync_weights(self, version: int) -> Pending[list[dict[str, float]]]: ...
    def continue_generation(self, batch: BatchIn) -> Pending[list[dict[str, Any]]]: ...
    def policy_version(self) -> list[int]: ...


class CriticRole(CheckpointedRole, Protocol):
    """A value model: of the reward (critic) or of the cost (cost_critic) (hybridflow.roles.critic.CriticWorker)."""

    def compute_values(self, batch: BatchIn) -> Pending[Batch]: ...
    def update_critic(self, batch: BatchIn) -> list[dict[str, float]]: ...


class RewardModelRole(Protocol):
    """A reward or cost model (hybridflow.roles.reward_model.RewardModelWorker)."""

    def compute_rm_scores(self, batch: BatchIn) -> Pending[Batch]: ...


class JudgeRole(Protocol):
    """A generative judge (hybridflow.roles.judge.JudgeWorker): the controller's reward sends it rendered questions
    (column `judge_prompt_ids`) and reads its greedy answers' ids (`verdict_ids`)."""

    def judge(self, batch: BatchIn) -> Batch: ...
