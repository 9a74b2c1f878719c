"""The controller's checkpoint: what a restarted controller needs to resume, as versioned JSON.

`ControllerCheckpoint` is the file's schema (`ControllerCore.state()` builds one,
`ControllerCore.load_state` restores from one; `controller.checkpoint_file` reads and writes
the file). It holds what the controller learned: per deployment the step-time model's samples
and fit (the XGBoost booster as its JSON model), the steps seen per (batch bucket, config) and
the recent finished requests; per replica the acceptance counts, the load estimates and the
policy in force; the counters. It leaves out
- what is derived and rebuilt on the next decision: the cost table, the last decision;
- settings (half-lives, priors, sample limits): a restarted controller takes them from its
  config and code, so a changed setting applies after a restart.

In Python the booster is an `xgboost.Booster`, in the file its JSON text (as `SpecConfig` is a
value in Python and its text on the wire): building a checkpoint copies references and lists,
cheap enough for the actor's event loop, and the slow part, the booster's text (hundreds of ms),
is made by `model_dump_json`, which the actor runs in a thread.

`format_version` changes whenever a reader of the old format would misread the new one.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, model_validator

from adaspec.policy import SpecConfig, SpecPolicy
from adaspec.telemetry import EngineCapabilities, RequestRecord, StepRecord
from controller.acceptance import MAX_DEPTH, MAX_RANK, AcceptanceModel
from controller.step_time import FEATURES, XGB_PARAMS, FitReport, StepTimeModel, StepTimeScale

# 2: deployments keyed by model, engine and accelerator (EngineCapabilities.deployment_key), not model id
FORMAT_VERSION = 2

# JSON has no inf or NaN, and pydantic writes them as null, which would make the whole file
# unreadable; written as the constants Infinity and NaN, they read back.
_STATE = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


def _load_booster(value: Any):
    """A booster from its JSON text (a file) or as it is (a live model's, Python mode)."""
    import xgboost

    if isinstance(value, xgboost.Booster):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected an XGBoost model as JSON text, got {type(value).__name__}")
    booster = xgboost.Booster()
    booster.load_model(bytearray(value, "utf-8"))
    booster.set_param({"nthread": XGB_PARAMS["nthread"]})
    return booster


@functools.lru_cache(maxsize=4)
def _booster_text(booster) -> str:
    # Read only: a booster is replaced on refit, never changed, so the actor's thread may
    # write it out while the event loop predicts with it, and a checkpoint every few seconds
    # makes its text once per fit (cached by identity), not every time.
    return booster.save_raw(raw_format="json").decode()


# An xgboost.Booster in Python, its JSON model text in a file.
BoosterJSON = Annotated[Any, PlainValidator(_load_booster), PlainSerializer(_booster_text, return_type=str)]


class AcceptanceState(BaseModel):
    """An acceptance model's decayed counts, [depth][sibling rank] (controller.acceptance)."""

    model_config = _STATE

    reached: list[list[float]]  # decayed candidates that reached (depth, rank)
    accepted: list[list[float]]  # decayed candidates accepted there
    last_time: float | None  # unix seconds the counts are decayed to

    @model_validator(mode="after")
    def _shape(self) -> AcceptanceState:
        for name in ("reached", "accepted"):
            rows = getattr(self, name)
            if len(rows) != MAX_DEPTH or any(len(r) != MAX_RANK for r in rows):
                raise ValueError(f"{name} must be {MAX_DEPTH} x {MAX_RANK} (depth x rank)")
        return self

    @classmethod
    def of(cls, model: AcceptanceModel) -> AcceptanceState:
        return cls(reached=model.reached.tolist(), accepted=model.accepted.tolist(), last_time=model.last_time)

    def model(self, half_life_s: float) -> AcceptanceModel:
        return AcceptanceModel(half_life_s=half_life_s, reached=np.array(self.reached, dtype=float),
                               accepted=np.array(self.accepted, dtype=float), last_time=self.last_time)


class StepTimeState(BaseModel):
    """A step-time model's samples and fit (controller.step_time)."""

    model_config = _STATE

    x: list[list[float]]  # features per sample, in FEATURES order
    y: list[float]  # step seconds per sample
    coef: list[float] | None  # the roofline's coefficients; None before the first fit
    booster: BoosterJSON | None  # the XGBoost correction; None before min_samples_xgb samples
    report: FitReport  # the last fit

    @model_validator(mode="after")
    def _samples(self) -> StepTimeState:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} feature rows for {len(self.y)} step times")
        if any(len(row) != len(FEATURES) for row in self.x):
            raise ValueError(f"every feature row must have {len(FEATURES)} values ({', '.join(FEATURES)})")
        return self

    @classmethod
    def of(cls, model: StepTimeModel) -> StepTimeState:
        coef = None if model.coef is None else model.coef.tolist()
        # Validation copies x and y, so the model may grow on while this is written out.
        return cls(x=model.x, y=model.y, coef=coef, booster=model.booster, report=model.report)

    def model(self) -> StepTimeModel:
        coef = None if self.coef is None else np.array(self.coef, dtype=float)
        # The model grows its own lists (rows and reports are never changed, only replaced).
        return StepTimeModel(x=list(self.x), y=list(self.y), coef=coef, booster=self.booster, report=self.report)


class SeenSteps(BaseModel):
    """Steps a deployment ran with `config` in the batch bucket starting at `batch_lo`."""

    model_config = _STATE

    batch_lo: int  # the bucket's smallest batch size (requests)
    config: SpecConfig
    steps: int


class ConfigRequests(BaseModel):
    """A deployment's recent finished requests that ran mostly under `config`."""

    model_config = _STATE

    config: SpecConfig
    records: list[RequestRecord]  # oldest first


class ReplicaState(BaseModel):
    """What the controller knows of one replica (controller.state's Replica)."""

    model_config = _STATE

    model_id: str
    capabilities: EngineCapabilities
    node_id: str = ""  # Ray node (hex id); "" in checkpoints written before it was kept
    node_ip: str = ""
    actor_id: str = ""
    started_at: float = 0.0  # unix seconds its engine was ready
    first_decision_at: float | None = None
    started_warm: bool = False
    policy_in_force: SpecPolicy
    last_seen: float  # unix seconds of its last report
    acceptance: AcceptanceState
    rate: float | None  # requests/s, decayed; None before the first report
    batch: float | None  # mean requests per step, decayed
    generated: float  # decayed output tokens produced
    finished: float  # decayed requests finished
    latency_sum: float  # decayed seconds of the finished requests with records
    latency_count: float  # decayed number of those requests
    recent_steps: list[StepRecord]  # the last steps, to compare predicted and measured step time
    last_probe: float  # unix seconds of the last chain1 probe
    # Its steps against the deployment's model; absent in checkpoints written before it was kept.
    step_scale: StepTimeScale = Field(default_factory=StepTimeScale)


class DeploymentState(BaseModel):
    """What the controller knows of one deployment (controller.state's Deployment)."""

    model_config = _STATE

    step_model: StepTimeState
    acceptance: AcceptanceState | None = None  # every replica's, pooled; None in older checkpoints
    seen: list[SeenSteps]
    context_per_seq: float | None  # KV tokens per sequence, decayed
    prefill_per_step: float | None  # prompt tokens per step, decayed
    proposal_rate: float | None  # share of decoding sequences that get a draft, decayed
    model_version: int  # fits installed so far
    samples_at_fit: int  # samples the step-time model had at its last fit
    requests: list[ConfigRequests]
    model_id: str  # the model its replicas serve (the key adds engine and accelerator)


class ControllerCheckpoint(BaseModel):
    """The controller's checkpoint file (controller.json)."""

    model_config = _STATE

    format_version: Literal[2] = FORMAT_VERSION
    replicas: dict[str, ReplicaState]  # replica id -> state
    deployments: dict[str, DeploymentState]  # deployment key (model, engine, accelerator) -> state
    paused: bool
    decisions: int
    pushed: int  # policies pushed

    @model_validator(mode="after")
    def _deployment_per_replica(self) -> ControllerCheckpoint:
        missing = sorted({r.capabilities.deployment_key(r.model_id) for r in self.replicas.values()}
                         - self.deployments.keys())
        if missing:
            raise ValueError(f"replicas of deployments with no state: {', '.join(missing)}")
        return self
