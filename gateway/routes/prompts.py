"""Prompt serving: the next prompt groups of a run, recycling, and the cursor."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

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


class PromptBatch(BaseModel):
    run_id: str
    groups: list[PromptGroup]
    cursor: PromptCursor


class RecycleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_indices: Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(min_length=1)]


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
    new groups, before the dataset continues. Checkpointed to Delta before the answer."""
    return RecycleResult.model_validate(
        await prompts.recycle(run_id, body.group_indices))


@router.get("/v1/runs/{run_id}/prompts/cursor", responses=errors(
    *AUTH, 422, 503, described={404: "No prompt served for this run yet."}))
async def get_prompt_cursor(run_id: RunIdPath, _: ReadRun, prompts: PromptsDep) -> PromptCursor:
    """Where the run's prompt stream stands: epoch, offset, next group index, recycle FIFO."""
    return PromptCursor.model_validate(await prompts.cursor(run_id))
