"""Unauthenticated ops endpoints: liveness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.deps import ConfigDep, MetricsDep, ProducerDep
from schemas.errors import AccessRefusedError

router = APIRouter(tags=["ops"])


@router.get("/healthz")
def get_health(producer: ProducerDep, config: ConfigDep) -> dict[str, str]:
    """Liveness (always 200 while the process serves) and whether Kafka is connected:
    `kafka` is `connected`, `unavailable` (no broker answers) or `refused` (the broker's
    ACLs refuse the gateway's principal); `kafka_error` says why when it is not connected."""
    error = producer.connect_error
    kafka = ("connected" if producer.connected
             else "refused" if isinstance(error, AccessRefusedError) else "unavailable")
    return {"status": "ok", "kafka": kafka, "lake": config.lake,
            **({"kafka_error": str(error)} if error is not None else {})}


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def get_metrics(metrics: MetricsDep) -> Response:
    """Prometheus metrics: requests, latency, publish errors, events, prompt groups."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
