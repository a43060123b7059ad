"""`create_app(config)`: the FastAPI app of the REST gateway (CONTRACT section 6).

The app's services live on `app.state` (config, lake, producer, runs, datasets, prompts,
feeds, recent_ids, tokens, metrics), built in the lifespan and reached by routes only
through `gateway.deps`. Adding a resource means adding its router to `ROUTERS`. Services
raise the domain errors of `schemas.errors`; `ERROR_STATUS` here is the one place they
become HTTP answers.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from gateway.auth import TokenStore
from gateway.config import GatewayConfig
from gateway.datasets import DatasetStore
from gateway.dedup import RecentIds
from gateway.deps import principal_for, require_some_write
from gateway.errors import ApiError
from gateway.feeds import Feeds
from gateway.observability import GatewayMetrics, LimitBody, ObserveRequests
from gateway.producer import GatewayProducer
from gateway.prompts.service import PromptService
from gateway.routes import dashboard, datasets, events, health, prompts, reads, runs, stream
from gateway.runs import RunRegistry
from ingest.io.lake import Lake
from schemas.errors import (
    BrokerUnavailableError,
    ConflictError,
    InconsistentStateError,
    InvalidInputError,
    NotFoundError,
    RequestError,
    UnavailableError,
    UnsupportedFormatError,
)

log = logging.getLogger(__name__)

ROUTERS: list[APIRouter] = [
    health.router, events.router, runs.router, datasets.router, prompts.router, reads.router,
    stream.router, dashboard.router,
]
# How long start-up waits for Kafka before serving anyway (requests get 503 until it answers).
KAFKA_STARTUP_WAIT_S = 10.0
# The HTTP status of each domain error; a subclass answers with its nearest listed base's.
ERROR_STATUS: dict[type[RequestError], int] = {
    NotFoundError: 404,
    ConflictError: 409,
    UnsupportedFormatError: 415,
    InvalidInputError: 422,
    InconsistentStateError: 500,
    UnavailableError: 503,
}


def create_app(config: GatewayConfig) -> FastAPI:
    """Build the gateway app; nothing connects until the app starts (lifespan)."""
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = app.state
        state.lake = Lake(config.lake)
        state.producer = GatewayProducer(config.kafka, publish_timeout_s=config.publish_timeout_s)
        state.runs = RunRegistry(config.kafka)
        state.datasets = DatasetStore(config.lake, config.upload_dir,
                                      tokenizers=config.tokenizers,
                                      line_limit=config.dataset_line_limit_bytes)
        state.prompts = PromptService(
            state.lake, state.datasets, state.runs, state.producer,
            checkpoint_groups=config.prompt_checkpoint_groups,
            checkpoint_interval_s=config.prompt_checkpoint_interval_s)
        state.feeds = Feeds(state.lake)
        state.recent_ids = RecentIds(config.state_dir / "accepted_event_ids.log",
                                     config.dedup_window)
        state.producer.start(wait_s=KAFKA_STARTUP_WAIT_S)
        log.info("gateway config: %s", config.model_dump_json(exclude={"tokens"}))
        # Everything built so far lives as long as the process: move it out of the cyclic
        # GC's view, so full collections (tens of ms with all of it) stop pausing requests.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            # Graceful shutdown: uvicorn has drained requests; checkpoint the prompt
            # cursors, then flush what the requests published.
            state.prompts.close()
            state.producer.close()
            state.runs.close()
            state.recent_ids.close()
            log.info("gateway stopped; producer flushed")

    app = FastAPI(
        title="rolloutlake gateway",
        version="1",
        summary="Events, runs, datasets, prompt serving and audit reads over HTTP.",
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.tokens = TokenStore(config)
    app.state.metrics = metrics
    for router in ROUTERS:
        app.include_router(router)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse({"detail": err.message, **err.extra}, status_code=err.status,
                            headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        # FastAPI decodes a JSON body before it runs the auth dependencies: answer 401/403
        # before saying what is wrong with the input of a caller who may not send it.
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        try:
            principal = principal_for(app.state.tokens,
                                      token.strip() or None if scheme.lower() == "bearer" else None)
            if request.method != "GET":
                require_some_write(principal)
        except ApiError as denied:
            return await api_error(request, denied)
        return await request_validation_exception_handler(request, err)

    @app.exception_handler(RequestError)
    async def domain_error(request: Request, err: RequestError) -> JSONResponse:
        status = next((ERROR_STATUS[cls] for cls in type(err).__mro__ if cls in ERROR_STATUS), 500)
        return JSONResponse({"detail": str(err), **err.details}, status_code=status)

    @app.exception_handler(BrokerUnavailableError)
    async def broker_unavailable(request: Request, err: BrokerUnavailableError) -> JSONResponse:
        # An outage passes: say when to retry.
        return JSONResponse({"detail": str(err)}, status_code=503,
                            headers={"Retry-After": str(config.retry_after_s)})

    # Outermost first: the observer also times and counts 413s from the limiter.
    app.add_middleware(LimitBody, limit=config.body_limit_bytes,
                       dataset_limit=config.dataset_limit_bytes)
    app.add_middleware(ObserveRequests, metrics=metrics)
    _document_configured_limits(app, config)
    return app


PROMPTS_PATH = "/v1/runs/{run_id}/prompts"
DATASET_UPLOAD_PATH = "/v1/datasets/{name}"


def _document_configured_limits(app: FastAPI, config: GatewayConfig) -> None:
    """Make /openapi.json state the limits this gateway enforces from its config (the
    routes are declared once, for any config): the most prompt groups per request and
    the body size behind each 413."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for param in schema["paths"][PROMPTS_PATH]["post"]["parameters"]:
            if param["name"] == "count":
                param["schema"]["maximum"] = config.max_prompts_per_request
        for path, operations in schema["paths"].items():
            for method, operation in operations.items():
                too_large = operation.get("responses", {}).get("413")
                if too_large is not None:
                    limit = (config.dataset_limit_bytes
                             if (path, method) == (DATASET_UPLOAD_PATH, "post")
                             else config.body_limit_bytes)
                    too_large["description"] += f" Limit: {limit} bytes."
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
