"""Live server-sent event streams of a run: sealed steps with their metrics, group decisions.

The events come from the run's `gateway.feeds.RunFeed`. The step stream's event id is the
step number: a client that reconnects with `Last-Event-ID: s` (browsers do it on their
own) gets every sealed step after s exactly once, in order, also from a gateway that
restarted in between, because the feed is rebuilt from Delta.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.responses import StreamingResponse

from gateway.deps import FeedsDep, ReadRun, RunIdPath
from gateway.feeds import RunFeed
from gateway.responses import AUTH, errors

KEEPALIVE_S = 15.0  # proxies close idle connections; a comment line keeps them open

router = APIRouter(tags=["stream"])


def _parse_cursor(value: str) -> tuple[int, int] | None:
    try:
        micros, group_index = value.split(".")
        return int(micros), int(group_index)
    except ValueError:
        return None


async def _stream(
    feed: RunFeed, events: list[bytes], start: Callable[[], int]
) -> AsyncIterator[bytes]:
    async with feed.watching():
        position = start()  # after the first poll, so the backlog is complete
        yield b"retry: 1000\n\n"
        while True:
            changed = feed.changed
            if position < len(events):
                chunk = events[position:]
                position += len(chunk)
                yield b"".join(chunk)
                continue
            try:
                await asyncio.wait_for(changed.wait(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keepalive\n\n"


def _sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    # no-transform and X-Accel-Buffering keep proxies from buffering the stream.
    return StreamingResponse(body, media_type="text/event-stream", headers={
        "Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no",
    })


LastEventId = Annotated[str | None, Header(alias="Last-Event-ID")]
LastEventQuery = Annotated[
    str | None, Query(description="Same as the Last-Event-ID header, for a first connection")
]


@router.get("/v1/runs/{run_id}/metrics/stream", responses=errors(*AUTH, 422))
async def stream_metrics(
    run_id: RunIdPath, feeds: FeedsDep, _: ReadRun,
    last_event_id: LastEventId = None, after: LastEventQuery = None,
) -> StreamingResponse:
    """Sealed steps as server-sent events `step` (id = step, data = the step's metrics).

    Every sealed step is sent once, in step order; on reconnect the `Last-Event-ID`
    header (or `?after=`) resumes after that step.
    """
    cursor = last_event_id or after
    try:
        last_step = int(cursor) if cursor else None
    except ValueError:
        last_step = None  # a foreign id: start from the beginning rather than skip steps
    feed = feeds.get(run_id)
    return _sse_response(
        _stream(feed, feed.step_events, lambda: feed.step_position_after(last_step))
    )


@router.get("/v1/runs/{run_id}/decisions/stream", responses=errors(*AUTH, 422))
async def stream_groups(
    run_id: RunIdPath, feeds: FeedsDep, _: ReadRun,
    last_event_id: LastEventId = None, after: LastEventQuery = None,
) -> StreamingResponse:
    """Group decisions as server-sent events `group`, in decision order.

    A fresh connection starts with the latest decisions; `Last-Event-ID` resumes.
    """
    cursor = last_event_id or after
    after_key = _parse_cursor(cursor) if cursor else None
    feed = feeds.get(run_id)
    return _sse_response(
        _stream(feed, feed.group_events, lambda: feed.group_position_after(after_key))
    )
