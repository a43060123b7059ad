"""Dependency aliases for routes: the app's shared services (from `app.state`) and auth.

Every route, including ones added by other modules, reaches the services only through
these aliases, so tests and `create_app` stay the single place that builds them:

    @router.get("/v1/runs/{run_id}/thing")
    def get_thing(run_id: RunIdPath, lake: LakeDep, _: ReadRun) -> ...
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator

from gateway.auth import Principal, TokenStore
from gateway.config import GatewayConfig, Scope
from gateway.datasets import DATASET_NAME, DatasetStore
from gateway.dedup import RecentIds
from gateway.errors import ApiError
from gateway.feeds import Feeds
from gateway.observability import GatewayMetrics
from gateway.producer import GatewayProducer
from gateway.prompts.service import PromptService
from gateway.runs import RunRegistry
from ingest.io.lake import Lake
from schemas.bounds import check_run_id

# Integers in paths and queries end up in Delta/Arrow int64 filters: bound them there.
INT64_MAX = 2**63 - 1

RunIdPath = Annotated[
    str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$", description="Run id."),
    AfterValidator(check_run_id),
]
DatasetNamePath = Annotated[
    str, Path(pattern=DATASET_NAME, description="Dataset name (also its folder name).")
]


def _state(name: str):
    async def get(request: Request):
        return getattr(request.app.state, name)

    get.__name__ = f"get_{name}"
    return get


ConfigDep = Annotated[GatewayConfig, Depends(_state("config"))]
LakeDep = Annotated[Lake, Depends(_state("lake"))]
ProducerDep = Annotated[GatewayProducer, Depends(_state("producer"))]
RunsDep = Annotated[RunRegistry, Depends(_state("runs"))]
DatasetsDep = Annotated[DatasetStore, Depends(_state("datasets"))]
PromptsDep = Annotated[PromptService, Depends(_state("prompts"))]
RecentIdsDep = Annotated[RecentIds, Depends(_state("recent_ids"))]
MetricsDep = Annotated[GatewayMetrics, Depends(_state("metrics"))]
FeedsDep = Annotated[Feeds, Depends(_state("feeds"))]

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <token>`")


def principal_for(tokens: TokenStore, token: str | None) -> Principal:
    """The token's principal; 401 without a valid token."""
    principal = tokens.authenticate(token)
    if principal is None:
        message = "invalid bearer token" if token else "missing bearer token"
        raise ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})
    return principal


async def authenticate(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller's principal; 401 without a valid bearer token."""
    principal = principal_for(request.app.state.tokens,
                              credentials.credentials if credentials else None)
    # The access log names the principal, never the token.
    request.state.principal = principal.name
    return principal


PrincipalDep = Annotated[Principal, Depends(authenticate)]


def require(principal: Principal, scope: Scope, run_id: str | None = None) -> None:
    """403 unless `principal` holds `scope` on `run_id` (or globally when run_id is None)."""
    if not principal.allows(scope, run_id):
        where = f"run {run_id!r}" if run_id is not None else "all runs (a global token)"
        raise ApiError(403, f"token {principal.name!r} lacks {scope!r} scope on {where}")


def _run_scope(scope: Scope):
    async def check(run_id: RunIdPath, principal: PrincipalDep) -> Principal:
        require(principal, scope, run_id)
        return principal

    check.__name__ = f"{scope}_run"
    return check


def _global_scope(scope: Scope):
    async def check(principal: PrincipalDep) -> Principal:
        require(principal, scope)
        return principal

    check.__name__ = f"{scope}_global"
    return check


def require_some_write(principal: Principal) -> None:
    """403 unless the token may write at least one run: checked before any body is read."""
    if "write" not in principal.scopes:
        raise ApiError(403, f"token {principal.name!r} lacks 'write' scope")


async def _some_write(principal: PrincipalDep) -> Principal:
    require_some_write(principal)
    return principal


ReadRun = Annotated[Principal, Depends(_run_scope("read"))]
WriteRun = Annotated[Principal, Depends(_run_scope("write"))]
ReadGlobal = Annotated[Principal, Depends(_global_scope("read"))]
WriteGlobal = Annotated[Principal, Depends(_global_scope("write"))]
WriterDep = Annotated[Principal, Depends(_some_write)]
