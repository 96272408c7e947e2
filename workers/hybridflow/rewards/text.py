"""Rewards over decoded responses: built-in scorers (in the driver) or a user's function (in sandboxed workers: on
this machine, or in the job's sandbox pool when the operator gave this process its replicas), behind one call that
applies the job's error policy.

A sample whose scoring fails scores `errorScore` and is counted; when more than `maxErrorFraction` of a batch fails,
the job stops with the first failing sample, the function and the exception, since training on mostly-default
rewards would only waste the run.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from hybridflow.rewards.remote import RemoteRewardFunction
from hybridflow.rewards.sandbox import RewardError, RewardFunction, RewardResult
from hybridflow.rewards.scorers import weighted
from hybridflow.sandbox_pool import SERVES_REWARDS, pool_from_env


class _Function(Protocol):
    path: str
    name: str
    batched: bool


class _Scorer(Protocol):
    name: str
    weight: float

    def options(self) -> dict[str, Any]: ...


class RewardSettings(Protocol):
    """What a reward over text reads of spec.models.reward (hybridflow.api.RewardSpec): typed structurally so that
    the rewards stay below the API layer whose rules validate their names."""

    @property
    def type(self) -> str: ...
    @property
    def function(self) -> _Function | None: ...
    @property
    def scorers(self) -> Sequence[_Scorer]: ...
    workers: int
    timeout_seconds: float
    error_score: float
    max_error_fraction: float


class RewardFailure(RuntimeError):
    """Too many samples of a batch could not be scored."""


def check_failures(what: str, errors: Sequence[RewardError], n: int, spec: RewardSettings) -> None:
    """The job's error policy: more failed samples than maxErrorFraction of the batch stop the job, naming the
    first."""
    if errors and len(errors) / max(1, n) > spec.max_error_fraction:
        raise RewardFailure(
            f"reward {what}: {len(errors)} of {n} samples failed, more than spec.models.reward.maxErrorFraction = "
            f"{spec.max_error_fraction:g}; first: {errors[0]}")


class TextReward:
    def __init__(self, spec: RewardSettings, kind: str | None = None) -> None:
        """`kind`: function or scorer (default: the spec's type), one part of a combined reward."""
        self.spec = spec
        self.function: RewardFunction | RemoteRewardFunction | None = None
        if (kind or spec.type) == "function":
            assert spec.function is not None
            f = spec.function
            self.what = f"{f.path}:{f.name}"
            # on Kubernetes: the job's sandbox pool (its reward replicas), the only pods without its credentials
            pool = pool_from_env(SERVES_REWARDS)
            if pool is not None:
                self.function = RemoteRewardFunction(pool, self.what, f.batched, spec.timeout_seconds, spec.workers,
                                                     spec.error_score)
            else:
                self.function = RewardFunction(f.path, f.name, f.batched, workers=spec.workers,
                                               timeout_seconds=spec.timeout_seconds, error_score=spec.error_score)
        else:
            self.scorer = weighted([(p.name, p.weight, p.options()) for p in spec.scorers])
            self.what = " + ".join(f"{p.weight:g} * {p.name}" for p in spec.scorers)

    def close(self) -> None:
        if self.function is not None:
            self.function.close()

    def score(self, data_sources: Sequence[str], solutions: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict[str, Any]]) -> RewardResult:
        if self.function is not None:
            out = self.function.score(data_sources, solutions, ground_truths, extra_infos)
        else:
            out = RewardResult(scores=[])
            for i, args in enumerate(zip(data_sources, solutions, ground_truths, extra_infos)):
                try:
                    out.scores.append(float(self.scorer(*args)))
                except Exception as err:  # noqa: BLE001 - reported with its sample, like a user's function
                    out.errors.append(RewardError(i, solutions[i], ground_truths[i], f"{type(err).__name__}: {err}"))
                    out.scores.append(self.spec.error_score)
        check_failures(self.what, out.errors, len(solutions), self.spec)
        return out
