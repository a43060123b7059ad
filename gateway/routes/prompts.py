"""Prompt serving: the next prompt groups of a run, recycling, and the cursor."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.deps import INT64_MAX, ConfigDep, MetricsDep, PromptsDep, ReadRun, RunIdPath, WriteRun
from gateway.errors import ApiError
from gateway.responses import AUTH, errors

router = APIRouter(tags=["prompts"])


class PromptCursor(BaseModel):
    dataset: str
    dataset_version: int
    seed: int
    shuffle: bool
    epoch: int
    offset: int
    """Position in the epoch's order of the next row to serve."""
    next_group_index: int
    recycle_groups: list[int]
    """Recycled groups waiting to be served again, oldest first."""
    seq: int


INT32_MAX = 2**31 - 1
NonNegative = Annotated[int, Field(ge=0, le=INT64_MAX)]


class Segment(BaseModel):
    """A run of response tokens generated under one weight version."""

    model_config = ConfigDict(extra="forbid")
    tokens: Annotated[int, Field(ge=0, le=INT32_MAX)]
    weight_version: NonNegative


class RecycledSample(BaseModel):
    """What one sample of a recycled group had generated (partial rollout): served back
    with the group's next serve so that the sample continues from it."""

    model_config = ConfigDict(extra="forbid")
    group_index: NonNegative
    """The recycled group (one of `group_indices`)."""
    rollout_id: NonNegative
    status: Literal["completed", "truncated", "aborted"]
    """`completed`/`truncated`: finished, served back as it is; `aborted`: continues."""
    response_tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]]
    rollout_log_probs: list[Annotated[float, Field(allow_inf_nan=False)]]
    loss_mask: list[Literal[0, 1]]
    segments: list[Segment]
    """The weight versions that generated `response_tokens`, in order; their `tokens`
    add up to its length."""
    start_rollout_id: NonNegative
    """The step that first generated the sample (Miles `metadata["start_rollout_id"]`)."""

    @model_validator(mode="after")
    def _per_token_lengths_match(self) -> RecycledSample:
        n = len(self.response_tokens)
        for name in ("rollout_log_probs", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries but "
                                 f"response_tokens has {n}")
        if sum(s.tokens for s in self.segments) != n:
            raise ValueError(f"segments cover {sum(s.tokens for s in self.segments)} tokens "
                             f"but response_tokens has {n}")
        return self


class PromptGroup(BaseModel):
    group_index: int
    step: int
    n_samples: int
    prompt: str | list[dict[str, Any]]
    label: Any
    metadata: dict[str, Any]
    prompt_ref: dict[str, Any]
    epoch: int | None
    """The epoch it was drawn from; null for a recycled group."""
    recycled_from: int | None
    """The group it re-serves, for a recycled group."""
    samples: list[RecycledSample] = []
    """For a recycled group: what its samples had generated when it was recycled."""


class PromptBatch(BaseModel):
    run_id: str
    groups: list[PromptGroup]
    cursor: PromptCursor


class RecycleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_indices: Annotated[list[NonNegative], Field(min_length=1)]
    samples: list[RecycledSample] = []
    """Partial rollout: what the groups' samples had generated, at most one entry per
    (group, rollout); stored with the recycle and served back with each group."""

    @model_validator(mode="after")
    def _samples_of_these_groups(self) -> RecycleRequest:
        groups = set(self.group_indices)
        seen: set[tuple[int, int]] = set()
        for sample in self.samples:
            key = (sample.group_index, sample.rollout_id)
            if sample.group_index not in groups:
                raise ValueError(f"samples: group {sample.group_index} is not in group_indices")
            if key in seen:
                raise ValueError(f"samples: group {key[0]} rollout {key[1]} is given twice")
            seen.add(key)
        return self


class RecycleResult(BaseModel):
    run_id: str
    cursor: PromptCursor


_RUN_ERRORS = errors(*AUTH, 422, described={
    404: "Unknown run (or group, for recycling).",
    409: "The run has no dataset, or the cursor moved under another gateway.",
    503: "Kafka unavailable (`Retry-After`); nothing was handed out.",
})


@router.post("/v1/runs/{run_id}/prompts", responses=_RUN_ERRORS, response_model=PromptBatch)
async def serve_prompts(
    run_id: RunIdPath, _: WriteRun, prompts: PromptsDep, config: ConfigDep, metrics: MetricsDep,
    count: Annotated[int, Query(ge=1, le=INT64_MAX, description=(
        "Prompt groups wanted, at most the gateway's `max_prompts_per_request` (the "
        "document's maximum)."))] = 1,
    step: Annotated[int | None, Query(ge=0, le=INT64_MAX, description="The step whose weights generate "
                                      "these groups; default: number of sealed steps.")] = None,
) -> Response:
    """Hand out the next `count` prompt groups of the run's dataset and publish their
    `group_started` events.

    Recycled groups come first, then the dataset in the order of the current epoch (a
    seeded shuffle, `rollout_seed + epoch`), rolling over into the next epochs as needed.
    Concurrent callers never get the same group; every group's `group_started` is
    acknowledged by Kafka before the answer, and that log (checkpointed to Delta) lets a
    restarted gateway continue exactly where it stopped.
    """
    if count > config.max_prompts_per_request:
        raise ApiError(422, f"count: {count} is above the limit of "
                            f"{config.max_prompts_per_request} groups per request")
    # The service builds the answer from validated events: encode it directly (orjson),
    # without a second pydantic pass; `response_model` still documents it.
    batch = await prompts.serve(run_id, count, step)
    metrics.prompts_served.inc(len(batch["groups"]))
    return Response(orjson.dumps(batch), media_type="application/json")


@router.post("/v1/runs/{run_id}/prompts/recycle", responses={**_RUN_ERRORS, **errors(413)})
async def recycle_prompts(run_id: RunIdPath, body: RecycleRequest, _: WriteRun,
                          prompts: PromptsDep) -> RecycleResult:
    """Put issued groups back (partial rollout): their prompts are served again first, as
    new groups, before the dataset continues, each with the `samples` given for it.
    Stored and checkpointed to Delta before the answer; recycling a group that waits to
    be served again changes nothing."""
    return RecycleResult.model_validate(await prompts.recycle(
        run_id, body.group_indices, [s.model_dump() for s in body.samples]))


@router.get("/v1/runs/{run_id}/prompts/cursor", responses=errors(
    *AUTH, 422, 503, described={404: "No prompt served for this run yet."}))
async def get_prompt_cursor(run_id: RunIdPath, _: ReadRun, prompts: PromptsDep) -> PromptCursor:
    """Where the run's prompt stream stands: epoch, offset, next group index, recycle FIFO."""
    return PromptCursor.model_validate(await prompts.cursor(run_id))
