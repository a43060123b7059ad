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
    """How many more groups an open step needs, published after a decision changed it.

    `groups_needed = max(0, rollout_batch_size - kept - in_flight)`: `kept` counts the kept
    groups in the step's batch, `in_flight` the groups issued for the step (their
    `group_started` seen by the processor) that are not decided yet.
    """

    type: Literal["demand"] = "demand"
    step: NonNegativeInt
    groups_needed: NonNegativeInt
    kept: NonNegativeInt
    in_flight: NonNegativeInt | None = None
    issued: NonNegativeInt | None = Field(
        default=None, description="Groups issued for the step that the processor has seen.")


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
