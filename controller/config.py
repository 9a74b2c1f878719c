"""The controller's settings (the `controller:` block of the app config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ControllerConfig(BaseModel):
    """The adaptive controller: a detached Ray actor that retunes every replica's policy."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=False, description="run the controller and let it push policies")
    period_s: float = Field(default=1.0, gt=0, description="control period (seconds)")
    objective: Literal["goodput", "latency", "tpot_slo"] = Field(
        default="goodput", description="what a policy maximises: accepted tokens/s, lowest mean "
        "latency at the predicted load, or most tokens/s with TPOT <= tpot_slo_s")
    tpot_slo_s: float | None = Field(default=None, gt=0, description="TPOT SLO (seconds), tpot_slo only")
    half_life_s: float = Field(
        default=20.0, gt=0, description="half-life of the acceptance model's decayed counts (seconds)")
    hysteresis: float = Field(
        default=0.05, ge=0, description="switch a bucket's config only when the predicted gain over the one in "
        "force exceeds this fraction (0.05 = 5%)")
    checkpoint_dir: str | None = Field(
        default=None, description="where models and policies are saved; default "
        "$ADASPEC_CONTROLLER_DIR or ~/.cache/adaspec/controller")
    profile_path: str | None = Field(
        default=None, description="step records from `adaspec profile` to start the step-time model")
    shipped_profile: bool = Field(
        default=True, description="without profile_path, start from the profile adaspec ships for an embedded "
        "model on the same engine (the default app's), if there is one")
    probe_every_s: float = Field(
        default=30.0, gt=0, description="while a replica's bucket runs `off`, try chain1 there "
        "for one period this often, so a change of workload is noticed (seconds)")
    safety_margin: float = Field(
        default=0.03, ge=0, description="in the batch bucket a replica runs in, speculation measured more than this "
        "fraction slower per token than `off` gives way to `off` (0.03 = 3%)")
    safety_recheck_s: float = Field(
        default=60.0, gt=0, description="while a bucket speculates, run `off` there for one period when it has "
        "not been measured this long (seconds), so the safety rule has a recent `off` to compare with")
    max_exploration_share: float = Field(
        default=0.05, ge=0, le=1, description="most of a replica's (recent) steps that may run a config tried "
        "only to measure it (0.05 = 5%)")
    replica_timeout_s: float = Field(default=5.0, gt=0, description="drop replicas silent this long (seconds)")
    refit_every_s: float = Field(default=10.0, gt=0, description="step-time model refit period (seconds)")

    @model_validator(mode="after")
    def _slo(self) -> ControllerConfig:
        if self.objective == "tpot_slo" and self.tpot_slo_s is None:
            raise ValueError("objective tpot_slo needs tpot_slo_s")
        return self
