"""Reads of what the processor wrote: step manifests, step metrics, lineage (audit) of a
group and of a trainer step (`ingest.io.lineage`).

Tables that do not exist yet read as empty (`Lake.read`), so a fresh run answers with an
empty list or a 404 that says what is missing, never a 500.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import pyarrow.compute as pc
from fastapi import APIRouter, Path, Query
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gateway.deps import INT64_MAX, LakeDep, ReadRun, RunIdPath
from gateway.errors import ApiError
from gateway.responses import AUTH, errors
from ingest.io.lake import Lake
from ingest.io.lineage import (
    GroupLineage,
    RowLineage,
    TrainerStepLineage,
    group_lineage,
    parse_as_of,
    row_lineage,
    trainer_step_lineage,
)

router = APIRouter(tags=["reads"])
T = TypeVar("T")

NonNegative = Annotated[int, Path(ge=0, le=INT64_MAX)]


class StepManifest(BaseModel):
    run_id: str
    step: int
    manifest: dict[str, Any]
    """The `steps` row: n_groups, n_samples, sealed_at, batch_version, content_sha256, ..."""
    training_rows: int
    """`training_batches` rows of the step at `batch_version`."""
    groups: dict[str, int]
    """Groups decided into this step (their `step`), by decision."""


class StepMetrics(BaseModel):
    step: int
    metrics: dict[str, float]


class RunMetrics(BaseModel):
    run_id: str
    steps: list[StepMetrics]


AsOfQuery = Annotated[str | None, Query(
    max_length=64, description="Read the lake as it was: a training_batches version (as of "
                               "its commit) or an ISO 8601 timestamp.")]


def _run(run_id: str, *more: pc.Expression) -> pc.Expression:
    expr = pc.field("run_id") == run_id
    for extra in more:
        expr = expr & extra
    return expr


def _manifest(lake: Lake, run_id: str, step: int) -> StepManifest:
    steps = lake.read("steps", filter=_run(run_id, pc.field("step") == step)).to_pylist()
    if not steps:
        raise ApiError(404, f"step {step} of run {run_id!r} is not sealed (no `steps` row)")
    row = steps[0]
    batch = lake.read("training_batches", filter=_run(run_id, pc.field("step") == step),
                      columns=["position"], version=row["batch_version"])
    decided = lake.read("groups", filter=_run(run_id, pc.field("step") == step),
                        columns=["decision"])
    counts = decided["decision"].value_counts().to_pylist() if decided.num_rows else []
    return StepManifest(run_id=run_id, step=step, manifest=row, training_rows=batch.num_rows,
                        groups={c["values"]: c["counts"] for c in counts})


@router.get("/v1/runs/{run_id}/steps/{step}",
            responses=errors(*AUTH, 422, described={404: "The step is not sealed."}))
async def get_step(run_id: RunIdPath, step: NonNegative, _: ReadRun,
                   lake: LakeDep) -> StepManifest:
    """The manifest of a sealed step, its training row count and its groups by decision."""
    return await run_in_threadpool(_manifest, lake, run_id, step)


def _metrics(lake: Lake, run_id: str, since_step: int | None) -> RunMetrics:
    expr = _run(run_id) if since_step is None else _run(run_id, pc.field("step") > since_step)
    rows = lake.read("step_metrics", filter=expr).sort_by([("step", "ascending"),
                                                          ("key", "ascending")])
    steps: dict[int, dict[str, float]] = {}
    for step, key, value in zip(rows["step"].to_pylist(), rows["key"].to_pylist(),
                                rows["value"].to_pylist(), strict=True):
        steps.setdefault(step, {})[key] = value
    return RunMetrics(run_id=run_id,
                      steps=[StepMetrics(step=s, metrics=m) for s, m in steps.items()])


@router.get("/v1/runs/{run_id}/metrics", responses=errors(*AUTH, 422))
async def get_metrics(run_id: RunIdPath, _: ReadRun, lake: LakeDep,
                      since_step: Annotated[int | None, Query(
                          ge=-1, le=INT64_MAX, description="Only steps after this one.")] = None) -> RunMetrics:
    """Step metrics (Miles keys, CONTRACT section 5) per step, oldest first."""
    return await run_in_threadpool(_metrics, lake, run_id, since_step)


def _lineage(find: Callable[..., T], lake: Lake, as_of: str | None, *key: Any) -> T:
    """`find` over the lake as of `as_of`, in the thread pool's thread (Delta reads block).
    A missing run, group, row or step is a 404, a bad as-of a 422 (gateway.app maps the
    domain errors)."""
    return find(parse_as_of(lake, as_of), *key)


@router.get("/v1/runs/{run_id}/groups/{group_index}", responses=errors(
    *AUTH, 422, described={404: "Nothing is known about the group yet."}))
async def get_group_audit(run_id: RunIdPath, group_index: NonNegative, _: ReadRun,
                          lake: LakeDep, as_of: AsOfQuery = None) -> GroupLineage:
    """Lineage of one group: its events with their Kafka positions, dead letters, decision
    and reason, samples, the training rows it fed, the steps that sealed them and the
    trainer steps that trained on them."""
    return await run_in_threadpool(_lineage, group_lineage, lake, as_of, run_id,
                                   group_index)


@router.get("/v1/runs/{run_id}/steps/{step}/rows/{position}", responses=errors(
    *AUTH, 422, described={404: "No training_batches row at that step and position."}))
async def get_row_audit(run_id: RunIdPath, step: NonNegative, position: NonNegative,
                        _: ReadRun, lake: LakeDep, as_of: AsOfQuery = None) -> RowLineage:
    """Lineage of one training_batches row: the row and the lineage of its group."""
    return await run_in_threadpool(_lineage, row_lineage, lake, as_of, run_id, step,
                                   position)


@router.get("/v1/runs/{run_id}/trainer-steps/{step}", responses=errors(
    *AUTH, 422, described={404: "The step has no trainer_steps row."}))
async def get_trainer_step_audit(run_id: RunIdPath, step: NonNegative, _: ReadRun,
                                 lake: LakeDep, as_of: AsOfQuery = None) -> TrainerStepLineage:
    """Lineage of a trained step: the groups and events it consumed, at the batch version
    it trained on."""
    return await run_in_threadpool(_lineage, trainer_step_lineage, lake, as_of, run_id,
                                   step)
