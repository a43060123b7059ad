"""Runs: start one (`run_started` on the runs topic), list them, read one."""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from gateway.datasets import DATASET_NAME
from gateway.deps import (
    DatasetsDep,
    PrincipalDep,
    ProducerDep,
    ReadRun,
    RunIdPath,
    RunsDep,
    WriterDep,
    require,
)
from gateway.errors import ApiError
from gateway.responses import AUTH, errors
from gateway.runs import RunInfo
from ingest.sdk.publisher import event_record
from schemas.errors import EventValidationError
from schemas.events import RunId

router = APIRouter(tags=["runs"])


class RunCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: RunId
    config: dict[str, Any]
    """The run config of CONTRACT section 2 (`n_samples_per_prompt`, `rollout_batch_size`,
    ...); unknown keys are kept. Prompt serving also reads `rollout_seed` (default 42) and
    `rollout_shuffle` (default true)."""
    dataset: str | None = None
    """Name of an uploaded dataset to serve prompts from."""


class RunOut(BaseModel):
    run_id: str
    config: dict[str, Any]
    dataset: str | None
    started_at: float | None
    """`ts` of the latest `run_started`."""
    first_started_at: float | None
    event_id: str


def _out(info: RunInfo) -> RunOut:
    return RunOut(run_id=info.run_id, config=info.config.model_dump(mode="json"),
                  dataset=info.dataset, started_at=info.started_at,
                  first_started_at=info.first_started_at, event_id=info.event_id)


@router.post("/v1/runs", status_code=201, responses=errors(401, 413, 503, described={
    403: "The token may not write this run.",
    422: "Invalid config (the message names the field), unknown dataset, or a `run_started` "
         "over the 8 MiB event limit.",
}))
async def start_run(body: RunCreate, principal: WriterDep, producer: ProducerDep,
                    datasets: DatasetsDep, runs: RunsDep) -> RunOut:
    """Start (or reconfigure) a run: validate its config and publish `run_started`.

    A later `run_started` for the same run replaces the config from that point on.
    """
    require(principal, "write", body.run_id)
    if body.dataset is not None and (
        not re.match(DATASET_NAME, body.dataset) or datasets.table(body.dataset) is None
    ):
        raise ApiError(422, f"dataset: {body.dataset!r} does not exist; upload it first with "
                            "POST /v1/datasets/{name}", field="dataset")

    def publish() -> RunOut:
        publisher = producer.publisher()
        try:
            event = publisher.build("run_started", body.run_id, config=body.config,
                                    **({"dataset": body.dataset} if body.dataset else {}))
        except EventValidationError as err:
            raise ApiError(422, str(err), field=err.field) from None
        producer.send([event_record(event, producer.topics)])
        info = runs.get(body.run_id)
        if info is None:  # acked but not yet readable: report what was published
            raise ApiError(503, f"run {body.run_id!r} was published but is not readable yet",
                           headers={"Retry-After": "1"})
        return _out(info)

    return await run_in_threadpool(publish)


@router.get("/v1/runs", responses=errors(401, 503))
def list_runs(principal: PrincipalDep, runs: RunsDep) -> list[RunOut]:
    """Every run announced on the runs topic that the token may read."""
    return [_out(info) for info in runs.all() if principal.allows("read", info.run_id)]


@router.get("/v1/runs/{run_id}",
            responses=errors(*AUTH, 422, 503, described={404: "Unknown run."}))
def get_run(run_id: RunIdPath, _: ReadRun, runs: RunsDep) -> RunOut:
    """One run: its latest config and dataset."""
    info = runs.get(run_id)
    if info is None:
        raise ApiError(404, f"run {run_id!r} is unknown (no run_started on the runs topic)")
    return _out(info)
