"""Records on `rollout.partial` (a contract addition, `docs/worker.md`): the groups a seal
cancelled that a worker with `--partial-rollout` keeps, with their tokens, for a later step.

The topic is compacted, one partition, keyed `"{run_id}:{group_index}"` of the cancelled
group; a null value (tombstone) means the group was continued.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from schemas.events import JsonObject, JsonValue, NonNegativeInt, RunId

PartialStatus = Literal["completed", "truncated", "cancelled", "unsent"]


class PartialSample(BaseModel):
    """One rollout of a cancelled group: finished before the seal (`completed`,
    `truncated`), cut off mid-generation (`cancelled`), or never sent (`unsent`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: NonNegativeInt
    status: PartialStatus
    tokens: list[int] = []
    """Response tokens generated so far."""
    log_probs: list[float] = []
    """Their rollout log-probs."""
    versions: list[NonNegativeInt] = []
    """The weight version each token was generated under."""

    @model_validator(mode="after")
    def _one_entry_per_token(self) -> PartialSample:
        if not len(self.tokens) == len(self.log_probs) == len(self.versions):
            raise ValueError(f"rollout {self.rollout_id}: {len(self.tokens)} tokens, "
                             f"{len(self.log_probs)} log-probs, {len(self.versions)} versions")
        return self


class PartialPrompt(BaseModel):
    """The group's prompt as the worker sent it, so continuing needs no dataset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    label: JsonValue = None
    metadata: JsonObject = {}
    tokens: list[int]


class PartialGroup(BaseModel):
    """A cancelled group as it stood at its seal: `pending` until a worker claims it for a
    continuing group (`claimed`, naming that group and its step)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: Literal["pending", "claimed"] = "pending"
    run_id: RunId
    group_index: NonNegativeInt
    step: NonNegativeInt
    """The step that cancelled it."""
    prompt: PartialPrompt
    samples: list[PartialSample]
    as_group: NonNegativeInt | None = None
    """The continuing group, once claimed."""
    as_step: NonNegativeInt | None = None
    """The continuing group's step, once claimed."""

    @model_validator(mode="after")
    def _claimed_names_its_group(self) -> PartialGroup:
        claimed = self.as_group is not None and self.as_step is not None
        if (self.state == "claimed") != claimed:
            raise ValueError(f"a {self.state} group has as_group {self.as_group} and as_step "
                             f"{self.as_step}")
        return self
