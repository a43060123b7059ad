"""Messages on `rollout.control` (CONTRACT section 1): processor and trainer to controllers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.events import NonNegativeInt, RunId


class _Control(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    run_id: RunId


class StepSealed(_Control):
    """A step's batch is complete; workers cancel that step's in-flight requests."""

    type: Literal["step_sealed"] = "step_sealed"
    step: NonNegativeInt
    sealed_at: float = Field(description="Seconds since the epoch.")


class Demand(_Control):
    """How many more groups a step still needs (kept + in flight cannot reach the batch)."""

    type: Literal["demand"] = "demand"
    step: NonNegativeInt
    groups_needed: NonNegativeInt
    kept: NonNegativeInt


class WeightsUpdated(_Control):
    """The trainer saved new weights; rollout engines reload them."""

    type: Literal["weights_updated"] = "weights_updated"
    step: NonNegativeInt
    path: str
    version: NonNegativeInt


ControlMessage = StepSealed | Demand | WeightsUpdated
CONTROL_MODELS: dict[str, type[_Control]] = {
    "step_sealed": StepSealed,
    "demand": Demand,
    "weights_updated": WeightsUpdated,
}
