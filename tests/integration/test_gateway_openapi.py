"""/openapi.json describes the gateway as it answers: every error status a route can give,
with the body it really has, and the limits it enforces. Real requests over HTTP are
checked against the served document with schemathesis' conformance checks."""

from __future__ import annotations

import re

import httpx
import pytest
from schemathesis.checks import (
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ingest.io.broker import free_port
from ingest.io.kafka import KafkaSettings
from tests.support.gateway_support import RunningGateway, gateway_config, sample_events
from tests.support.suite_kafka import suite_kafka

pytestmark = pytest.mark.one_broker(
    "the document and the answers' shapes; the broker path runs on both engines in test_gateway_events")

BODY_LIMIT = 64 * 1024

# (method, path) -> the statuses besides success it documents.
EXPECTED_ERRORS = {
    ("post", "/v1/events"): {"401", "403", "413", "422", "503"},
    ("get", "/v1/runs"): {"401", "503"},
    ("post", "/v1/runs"): {"401", "403", "413", "422", "503"},
    ("get", "/v1/runs/{run_id}"): {"401", "403", "404", "422", "503"},
    ("post", "/v1/datasets/{name}"): {"401", "403", "413", "415", "422"},
    ("get", "/v1/datasets/{name}"): {"401", "403", "404", "422"},
    ("get", "/v1/datasets/{name}/rows"): {"401", "403", "404", "422"},
    ("post", "/v1/runs/{run_id}/prompts"): {"401", "403", "404", "409", "422", "503"},
    ("post", "/v1/runs/{run_id}/prompts/recycle"): {"401", "403", "404", "409", "413", "422",
                                                    "503"},
    ("get", "/v1/runs/{run_id}/prompts/cursor"): {"401", "403", "404", "422", "503"},
    ("get", "/v1/runs/{run_id}/steps/{step}"): {"401", "403", "404", "422"},
    ("get", "/v1/runs/{run_id}/metrics"): {"401", "403", "422"},
    ("get", "/v1/runs/{run_id}/groups/{group_index}"): {"401", "403", "404", "422"},
    ("get", "/v1/runs/{run_id}/trainer-steps/{step}"): {"401", "403", "404", "422"},
    ("get", "/v1/runs/{run_id}/steps/{step}/rows/{position}"): {"401", "403", "404", "422"},
    ("get", "/v1/runs/{run_id}/metrics/stream"): {"401", "403", "422"},
    ("get", "/v1/runs/{run_id}/decisions/stream"): {"401", "403", "422"},
    ("get", "/v1/dashboard/runs"): {"401"},
    ("get", "/v1/runs/{run_id}/response-lengths"): {"401", "403", "422"},
    ("get", "/healthz"): set(),
    ("get", "/metrics"): set(),
}


@pytest.fixture(scope="module")
def gw(broker, tmp_path_factory):
    kafka = suite_kafka(broker.bootstrap_servers, topic_prefix="openapi.")
    kafka.ensure_topics()
    root = tmp_path_factory.mktemp("openapi")
    config = gateway_config(kafka, str(root / "lake"), root / "state",
                            body_limit_bytes=BODY_LIMIT)
    with RunningGateway(config) as running:
        yield running


def _document(gw: RunningGateway) -> dict:
    return httpx.get(f"{gw.url}/openapi.json", timeout=30).json()


def test_every_route_documents_the_errors_it_can_answer(gw):
    paths = _document(gw)["paths"]
    documented = {
        (method, path): {s for s in op["responses"] if not s.startswith("2")}
        for path, ops in paths.items() for method, op in ops.items()
    }
    assert documented == EXPECTED_ERRORS


def test_limits_are_in_the_document(gw):
    paths = _document(gw)["paths"]
    count = next(p for p in paths["/v1/runs/{run_id}/prompts"]["post"]["parameters"]
                 if p["name"] == "count")
    assert (count["schema"]["minimum"], count["schema"]["maximum"]) == (1, 4096)
    slice_param = next(p for p in paths["/v1/datasets/{name}"]["post"]["parameters"]
                       if p["name"] == "slice")
    pattern = re.compile(slice_param["schema"]["pattern"])
    assert all(pattern.match(s) for s in ("@[1:-1]", "[:10]", "@[-5:]"))
    assert not any(pattern.match(s) for s in ("@[1:2:3]", "1:2", "@[a:b]"))
    assert f"Limit: {BODY_LIMIT} bytes." in paths["/v1/events"]["post"]["responses"]["413"][
        "description"]


def _conforms(schema, method: str, path: str, expected_status: int, *, token: str | None,
              **case_fields) -> httpx.Response:
    if "body" in case_fields:
        case_fields["media_type"] = "application/json"
    case = schema[path][method.upper()].Case(**case_fields)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = case.call(headers=headers, timeout=30)
    assert response.status_code == expected_status, response.text
    case.validate_response(response, checks=[status_code_conformance, response_schema_conformance,
                                             response_headers_conformance])
    return response


def test_error_answers_match_their_documented_bodies(gw):
    schema = gw.openapi_schema()
    events = sample_events("run-a", 0)
    _conforms(schema, "post", "/v1/events", 401, token=None, body=events)
    _conforms(schema, "post", "/v1/events", 403, token="reader-token", body=events)
    _conforms(schema, "post", "/v1/events", 413, token="admin-token",
              body=[{"pad": "x" * BODY_LIMIT}])
    _conforms(schema, "post", "/v1/events", 422, token="admin-token", body=[{"type": "nope"}])
    _conforms(schema, "post", "/v1/runs/{run_id}/prompts", 403, token="run-a-reader",
              path_parameters={"run_id": "run-a"})
    # A rule the route checks: one line naming the field.
    over = _conforms(schema, "post", "/v1/runs/{run_id}/prompts", 422, token="admin-token",
                     path_parameters={"run_id": "run-a"}, query={"count": 5000})
    assert over.json()["detail"].startswith("count: 5000 is above the limit of 4096")
    # The declared schema: FastAPI's list of field errors.
    bad_step = _conforms(schema, "get", "/v1/runs/{run_id}/steps/{step}", 422,
                         token="admin-token", path_parameters={"run_id": "run-a", "step": -1})
    assert bad_step.json()["detail"][0]["loc"] == ["path", "step"]
    _conforms(schema, "get", "/v1/dashboard/runs", 401, token="not-a-token")


def test_kafka_unavailable_answer_matches_its_documented_body(tmp_path):
    # Nothing listens on this port: the gateway starts after its Kafka wait and answers 503.
    kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}", request_timeout_ms=2000)
    config = gateway_config(kafka, str(tmp_path / "lake"), tmp_path / "state",
                            publish_timeout_s=1)
    with RunningGateway(config) as gw:
        schema = gw.openapi_schema()
        _conforms(schema, "post", "/v1/events", 503, token="admin-token",
                  body=sample_events("run-a", 0))
