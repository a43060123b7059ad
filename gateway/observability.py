"""Request-level ops: Prometheus metrics, one structured access-log line per request, and
the request body limit. All three are plain ASGI middleware so they also see requests
that never reach a route (413, 404).
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import HTTPException
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("gateway.access")


class GatewayMetrics:
    """The gateway's Prometheus collectors, in a registry of their own per app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gateway_requests_total", "HTTP requests by route and status.",
            ["method", "route", "status"], registry=self.registry,
        )
        self.latency = Histogram(
            "gateway_request_seconds", "HTTP request latency by route.", ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
            registry=self.registry,
        )
        self.publish_errors = Counter(
            "gateway_publish_errors_total", "Requests refused with 503 because Kafka failed.",
            registry=self.registry,
        )
        self.events_accepted = Counter(
            "gateway_events_accepted_total", "Events published.", registry=self.registry,
        )
        self.event_duplicates = Counter(
            "gateway_event_duplicates_total", "Events skipped as already accepted.",
            registry=self.registry,
        )
        self.prompts_served = Counter(
            "gateway_prompt_groups_served_total", "Prompt groups handed out.",
            registry=self.registry,
        )


def _route_of(scope: Scope) -> str:
    # The route template, not the raw path: run ids in label values would explode cardinality.
    route = scope.get("route")
    return getattr(route, "path", "unmatched")


class ObserveRequests:
    """Counts, times and logs every HTTP request. Logs no headers, so never a token."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            elapsed = time.perf_counter() - start
            route = _route_of(scope)
            self.metrics.requests.labels(scope["method"], route, str(status)).inc()
            self.metrics.latency.labels(scope["method"], route).observe(elapsed)
            if access_log.isEnabledFor(logging.INFO):
                access_log.info(json.dumps({
                    "method": scope["method"],
                    "route": route,
                    "path": scope["path"],
                    "status": status,
                    "ms": round(elapsed * 1000, 2),
                    "client": (scope.get("client") or ("-",))[0],
                    "principal": scope.get("state", {}).get("principal"),
                }))


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the limit of {limit} bytes ({_human(limit)})")


class LimitBody:
    """413 for bodies over the limit: at once from Content-Length, else while streaming."""

    def __init__(self, app: ASGIApp, *, limit: int, dataset_limit: int):
        self.app = app
        self.limit = limit
        self.dataset_limit = dataset_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Dataset uploads stream to disk, so they get their own (much larger) limit.
        limit = self.dataset_limit if scope["path"].startswith("/v1/datasets/") else self.limit
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            err = BodyTooLarge(limit)
            body = json.dumps({"detail": err.detail}).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counting_receive, send)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.4g} {unit}"
        size /= 1024
    return f"{size:.4g} GiB"
