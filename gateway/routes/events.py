"""`POST /v1/events`: validated, all-or-nothing event ingest for external environments."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gateway.auth import Principal
from gateway.dedup import RecentIds
from gateway.deps import MetricsDep, ProducerDep, RecentIdsDep, WriterDep, require
from gateway.errors import ApiError
from gateway.observability import GatewayMetrics
from gateway.producer import GatewayProducer
from gateway.responses import AUTH, errors
from ingest.io.kafka import Record
from ingest.sdk.publisher import event_record
from schemas.errors import BrokerUnavailableError, EventTooLargeError, EventValidationError
from schemas.events import AnyEvent, load_json, parse_event

router = APIRouter(tags=["events"])

NDJSON_TYPES = ("application/x-ndjson", "application/jsonl", "application/ndjson")


class EventsAccepted(BaseModel):
    accepted: int
    """Events published now."""
    duplicates: int
    """Events skipped because this gateway already accepted their `(run_id, event_id)`."""


class EventError(BaseModel):
    index: int | None
    """0-based position of the event in the body (NDJSON: among non-blank lines)."""
    field: str
    reason: str


class EventsRejected(BaseModel):
    detail: str
    errors: list[EventError]


_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "array", "items": {"type": "object"}}},
            "application/x-ndjson": {"schema": {"type": "string"}},
        },
    }
}


def _reject(errors: list[dict[str, Any]], total: int) -> ApiError:
    return ApiError(422, f"{len(errors)} of {total} events are invalid; nothing was published",
                    errors=errors)


def _decode(body: bytes, content_type: str) -> list[Any]:
    if content_type.split(";")[0].strip().lower() in NDJSON_TYPES:
        items, errors = [], []
        for line in (raw.strip() for raw in body.split(b"\n")):
            if not line:
                continue
            try:
                items.append(load_json(line))
            except orjson.JSONDecodeError as err:
                errors.append({"index": len(items), "field": "(event)",
                               "reason": f"line is not valid JSON: {err}"})
                items.append(None)
        if errors:
            raise _reject(errors, len(items))
        return items
    try:
        items = load_json(body)
    except orjson.JSONDecodeError as err:
        raise _reject([{"index": None, "field": "(body)",
                        "reason": f"body is not valid JSON: {err}"}], 0) from None
    if not isinstance(items, list):
        raise _reject([{"index": None, "field": "(body)",
                        "reason": "body must be a JSON array of events (or NDJSON)"}], 0)
    return items


def _require_write(items: list[Any], principal: Principal) -> None:
    """403 before validation: a caller without write access learns nothing about its input.
    Run ids are read from the raw items; an item without one is invalid anyway (422)."""
    run_ids = {item["run_id"] for item in items
               if isinstance(item, dict) and isinstance(item.get("run_id"), str)}
    for run_id in sorted(run_ids):
        require(principal, "write", run_id)


def _validate_and_publish(items: list[Any], principal: Principal, producer: GatewayProducer,
                          recent: RecentIds, metrics: GatewayMetrics) -> EventsAccepted:
    _require_write(items, principal)
    events: list[tuple[AnyEvent, Record]] = []
    errors: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        try:
            event = parse_event(item)
        except EventValidationError as err:
            errors.append({"index": index, "field": err.field or "(event)", "reason": str(err)})
            continue
        try:
            events.append((event, event_record(event, producer.topics)))
        except EventTooLargeError as err:
            errors.append({"index": index, "field": "(event)", "reason": str(err)})
    if errors:
        raise _reject(errors, len(items))
    fresh, dups = recent.claim([(event.run_id, event.event_id) for event, _ in events])
    fresh_ids = [(events[i][0].run_id, events[i][0].event_id) for i in fresh]
    try:
        producer.send([events[i][1] for i in fresh])
    except BrokerUnavailableError:
        recent.release(fresh_ids)
        metrics.publish_errors.inc()
        raise
    recent.commit(fresh_ids)
    metrics.events_accepted.inc(len(fresh))
    metrics.event_duplicates.inc(len(dups))
    return EventsAccepted(accepted=len(fresh), duplicates=len(dups))


@router.post(
    "/v1/events",
    status_code=202,
    openapi_extra=_BODY_DOC,
    responses={
        **errors(*AUTH, 413, described={
            503: "Kafka unavailable (`Retry-After`); retry with the same event ids."}),
        # The body is read by the route itself, so every 422 is this one.
        422: {"model": EventsRejected, "description": "Invalid events; none was published."},
    },
)
async def publish_events(request: Request, principal: WriterDep, producer: ProducerDep,
                         recent: RecentIdsDep, metrics: MetricsDep) -> EventsAccepted:
    """Publish a batch of events: a JSON array, or NDJSON (`application/x-ndjson`).

    Every event is validated against CONTRACT section 2 first; if any is invalid the
    answer is 422 with the index, field and reason of each bad event, and nothing is
    published. Trajectory events are keyed `run_id:group_index`, `run_started` goes to the
    runs topic. `duplicates` counts events whose `(run_id, event_id)` this gateway already
    accepted (they are not published again). On 503 nothing is acknowledged; retrying with
    the same `event_id`s is safe. Authorization comes first: 401 without a valid token and
    403 for a token that may not write every run named in the body, whatever the body holds.
    """
    items = _decode(await request.body(), request.headers.get("content-type", ""))
    return await run_in_threadpool(_validate_and_publish, items, principal, producer, recent,
                                   metrics)
