"""The spec's off-policy correction (`spec.algorithm.offPolicyCorrection`): a name from the registry in
hybridflow.algorithms.corrections and the settings that correction reads."""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from hybridflow.algorithms.corrections import OFF_POLICY_CORRECTIONS, Level
from hybridflow.api.fields import SpecModel, registered


class OffPolicyCorrection(SpecModel):
    """A registered off-policy correction and its settings; unset settings the correction reads take its defaults
    (see hybridflow.algorithms.corrections), so every role reads one resolved section."""

    name: str = Field(description="tis: truncated IS, weight min(pi_old/pi_rollout, cap); masked_is: tokens (or "
                      "whole responses, level sequence) whose ratio leaves [low, high] are dropped; decoupled: the "
                      "decoupled PPO loss (ratio against the recomputed proximal policy, weight pi_prox/pi_rollout).",
                      json_schema_extra={"enum": OFF_POLICY_CORRECTIONS.names()})
    cap: float | None = Field(None, gt=0, description="tis: the largest weight (default 2); decoupled: tokens whose "
                              "weight exceeds it are dropped (unset: none).")
    low: float | None = Field(None, gt=0, description="masked_is: the band's lower end, below 1 (default 0.5).")
    high: float | None = Field(None, gt=0, description="masked_is: the band's upper end, above 1 (default 2).")
    level: Level | None = Field(None, description="masked_is: token (each token's ratio) or sequence (a "
                                "response's geometric-mean ratio masks all of it); default token.")

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        return registered(OFF_POLICY_CORRECTIONS, value)

    @model_validator(mode="after")
    def _defaults(self) -> "OffPolicyCorrection":
        for key, value in OFF_POLICY_CORRECTIONS[self.name].defaults.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        return self
