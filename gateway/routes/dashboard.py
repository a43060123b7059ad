"""The live metric dashboard: its pages, its static files and the two JSON reads it needs.

The pages are a static shell (no data, so no auth); the script reads everything through
bearer-authenticated /v1 routes, with the token the user opened the page with
(`?token=`, kept in sessionStorage and sent as an Authorization header, also on the
event streams, which the page reads with fetch rather than EventSource for that reason).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse
from pydantic import BaseModel

from gateway.deps import FeedsDep, LakeDep, PrincipalDep, ReadRun, RunIdPath
from gateway.errors import ApiError
from gateway.responses import AUTH, errors

STATIC = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(tags=["dashboard"])


@router.get("/", include_in_schema=False)
def get_index() -> FileResponse:
    """The dashboard shell; without a run in the path it offers the runs to open."""
    return FileResponse(STATIC / "dashboard.html")


@router.get("/runs/{run_id}", include_in_schema=False)
def get_run_page(run_id: RunIdPath) -> FileResponse:
    """The dashboard of one run (`?compare=a,b` overlays other runs)."""
    return FileResponse(STATIC / "dashboard.html")


@router.get("/dashboard/static/{path:path}", include_in_schema=False)
def get_static(path: str) -> FileResponse:
    """Dashboard script, styles and the vendored chart library (no CDN: works offline)."""
    target = (STATIC / path).resolve()
    if not target.is_file() or not target.is_relative_to(STATIC):
        raise ApiError(404, f"no static file {path!r}")
    return FileResponse(target, headers={"Cache-Control": "no-cache"})


class RunSummary(BaseModel):
    run_id: str
    steps: int
    last_step: int
    last_sealed_at: str


@router.get("/v1/dashboard/runs", responses=errors(401))
def list_dashboard_runs(lake: LakeDep, principal: PrincipalDep) -> list[RunSummary]:
    """Runs with sealed steps that the token may read, most recently sealed first."""
    if not lake.exists("steps"):
        return []
    steps = lake.read("steps", columns=["run_id", "step", "sealed_at"])
    if steps.num_rows == 0:
        return []
    per_run = steps.group_by("run_id").aggregate(
        [("step", "count"), ("step", "max"), ("sealed_at", "max")]
    ).sort_by([("sealed_at_max", "descending")])
    return [
        RunSummary(run_id=r["run_id"], steps=r["step_count"], last_step=r["step_max"],
                   last_sealed_at=r["sealed_at_max"].isoformat())
        for r in per_run.to_pylist()
        if principal.allows("read", r["run_id"])
    ]


class LengthHistogram(BaseModel):
    edges: list[float]
    counts: dict[str, list[int]]
    mean: dict[str, float]
    n: dict[str, int]


@router.get("/v1/runs/{run_id}/response-lengths", responses=errors(*AUTH, 422))
async def get_response_lengths(
    run_id: RunIdPath, feeds: FeedsDep, _: ReadRun,
    last_steps: Annotated[int | None, Query(ge=1, description="only the latest N steps")] = None,
    bins: Annotated[int, Query(ge=2, le=200)] = 40,
) -> LengthHistogram:
    """Response length (tokens per fragment, from `samples`) of kept, dropped and
    cancelled-at-seal groups: the cancelled ones are the answers the rewards never see."""
    feed = feeds.get(run_id)
    async with feed.watching():  # brings the feed up to date when nobody streams the run
        return LengthHistogram(**feed.response_lengths(last_steps, bins))

