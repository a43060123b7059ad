"""POST /v1/events against the real app, broker and lake: validation, keying, duplicates,
limits, auth, and a broker outage (503, then a safe retry)."""

from __future__ import annotations

import logging
import re
import time

import orjson
import pytest

from gateway.producer import RECONNECT_INTERVAL_S, GatewayProducer
from ingest.io.broker import ENGINES, EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings
from schemas.events import decode_event
from tests.support.gateway_support import (
    RunningGateway,
    consume_all,
    gateway_config,
    sample_events,
)
from tests.support.suite_kafka import SUITE_BROKER_START_S


@pytest.fixture
def gw(kafka, lake_root, tmp_path):
    with RunningGateway(gateway_config(kafka, lake_root, tmp_path / "state",
                                       body_limit_bytes=256 * 1024)) as running:
        yield running


def test_json_array_is_published_keyed_by_group(gw, kafka):
    events = sample_events("run-a", 3) + sample_events("run-a", 4)
    with gw.client() as client:
        response = client.post("/v1/events", json=events)
    assert response.status_code == 202
    assert response.json() == {"accepted": 6, "duplicates": 0}
    records = consume_all(kafka, kafka.topics.events)
    assert sorted(decode_event(r.value).event_id for r in records) == sorted(
        e["event_id"] for e in events)
    for record in records:
        assert record.key == f"run-a:{decode_event(record.value).group_index}".encode()
    by_group = {r.key: r.partition for r in records}
    assert all(by_group[r.key] == r.partition for r in records)


def test_ndjson_and_run_started_go_to_their_topics(gw, kafka):
    run_started = {"event_id": "rs-1", "type": "run_started", "schema_version": 1,
                   "run_id": "run-n", "config": {"n_samples_per_prompt": 2,
                                                 "rollout_batch_size": 1}}
    body = b"\n".join(orjson.dumps(e) for e in [run_started, *sample_events("run-n", 0)]) + b"\n\n"
    with gw.client() as client:
        response = client.post("/v1/events", content=body,
                               headers={"Content-Type": "application/x-ndjson"})
    assert response.status_code == 202, response.text
    assert response.json()["accepted"] == 4
    runs = consume_all(kafka, kafka.topics.runs)
    assert [(r.key, decode_event(r.value).event_id) for r in runs] == [(b"run-n", "rs-1")]
    assert len(consume_all(kafka, kafka.topics.events)) == 3


def test_one_bad_event_rejects_the_batch_with_index_field_reason(gw, kafka):
    events = sample_events("run-a", 0)
    events[1]["loss_mask"] = [1]  # wrong length
    del events[2]["status"]
    events.append({"type": "nope", "event_id": "x"})
    with gw.client() as client:
        response = client.post("/v1/events", json=events)
    assert response.status_code == 422
    errors = response.json()["errors"]
    assert [(e["index"], e["field"]) for e in errors] == [(1, "loss_mask"), (2, "status"),
                                                          (3, "type")]
    assert "loss_mask has 1 entries" in errors[0]["reason"]
    assert "nothing was published" in response.json()["detail"]
    assert consume_all(kafka, kafka.topics.events) == []


@pytest.mark.parametrize("body, content_type, reason", [
    (b"{not json", "application/json", "body is not valid JSON"),
    (b'{"event_id": "x"}', "application/json", "must be a JSON array"),
    (b'{"a": 1}\nnot json\n', "application/x-ndjson", "line is not valid JSON"),
])
def test_undecodable_bodies_are_422(gw, body, content_type, reason):
    with gw.client() as client:
        response = client.post("/v1/events", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 422
    assert reason in response.json()["errors"][0]["reason"]


def test_duplicates_are_counted_not_republished_also_after_restart(kafka, lake_root, tmp_path):
    config = gateway_config(kafka, lake_root, tmp_path / "state")
    events = sample_events("run-a", 0)
    with RunningGateway(config) as gw, gw.client() as client:
        assert client.post("/v1/events", json=events).json() == {"accepted": 3, "duplicates": 0}
        again = client.post("/v1/events", json=[events[0], events[0], *sample_events("run-a", 1)])
        assert again.json() == {"accepted": 3, "duplicates": 2}
    with RunningGateway(config) as gw, gw.client() as client:
        assert client.post("/v1/events", json=events).json() == {"accepted": 0, "duplicates": 3}
    assert len(consume_all(kafka, kafka.topics.events)) == 6


def test_body_over_the_limit_is_413_naming_the_limit(gw):
    big = sample_events("run-a", 0, n=8, tokens=8000)
    with gw.client() as client:
        response = client.post("/v1/events", json=big)
        assert response.status_code == 413
        assert "262144 bytes (256 KiB)" in response.json()["detail"]

        def chunks():  # no Content-Length: the limit applies while streaming
            yield orjson.dumps(big)

        streamed = client.post("/v1/events", content=chunks(),
                               headers={"Content-Type": "application/json"})
        assert streamed.status_code == 413


def test_oversized_single_event_is_422(kafka, lake_root, tmp_path):
    config = gateway_config(kafka, lake_root, tmp_path / "state")
    event = sample_events("run-a", 0, n=1, tokens=1_200_000)[1]
    with RunningGateway(config) as gw, gw.client() as client:
        response = client.post("/v1/events", json=[event])
    assert response.status_code == 422
    assert "the limit is 8388608 bytes" in response.json()["errors"][0]["reason"]


def test_auth_401_and_403(gw):
    events = sample_events("run-a", 0)
    with gw.client(token=None) as anonymous:
        missing = anonymous.post("/v1/events", json=events)
    assert missing.status_code == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
    with gw.client(token="wrong") as bad:
        assert bad.post("/v1/events", json=events).status_code == 401
    with gw.client(token="reader-token") as reader:
        assert reader.post("/v1/events", json=events).status_code == 403
    with gw.client(token="run-a-writer") as writer:
        assert writer.post("/v1/events", json=events).status_code == 202
        other = writer.post("/v1/events", json=events + sample_events("run-b", 0))
        assert other.status_code == 403 and "run-b" in other.json()["detail"]


@pytest.mark.parametrize("engine", ENGINES)
def test_broker_down_is_503_with_retry_after_and_retry_is_safe(engine, lake_root, tmp_path):
    port = free_port()
    broker = EmbeddedBroker(port, engine=engine).start(SUITE_BROKER_START_S)
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, request_timeout_ms=2000)
    config = gateway_config(kafka, lake_root, tmp_path / "state", publish_timeout_s=2,
                            retry_after_s=3)
    try:
        with RunningGateway(config) as gw, gw.client() as client:
            assert client.post("/v1/events", json=sample_events("run-a", 0)).status_code == 202
            broker.stop()
            events = sample_events("run-a", 1)
            down = client.post("/v1/events", json=events)
            assert down.status_code == 503
            assert down.headers["Retry-After"] == "3"
            assert client.get("/healthz").json()["kafka"] == "unavailable"
            broker = EmbeddedBroker(port, engine=engine).start(SUITE_BROKER_START_S)
            for _ in range(60):
                retry = client.post("/v1/events", json=events)
                if retry.status_code != 503:
                    break
                time.sleep(0.5)  # the gateway reconnects in the background
            assert retry.status_code == 202
            assert retry.json() == {"accepted": 3, "duplicates": 0}
            metrics = client.get("/metrics").text
            refused = re.search(r"^gateway_publish_errors_total (\S+)$", metrics, re.M)
            assert float(refused.group(1)) >= 1  # plus any retry made while reconnecting
    finally:
        broker.stop()


def test_an_outage_is_logged_once_not_at_every_reconnect(lake_root, tmp_path, caplog):
    """No broker at the address: the connector tries every RECONNECT_INTERVAL_S and says so
    once, until the cause changes."""
    kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}",
                          bootstrap_timeout_ms=200)
    producer = GatewayProducer(kafka, publish_timeout_s=1)
    caplog.set_level(logging.INFO, logger="gateway.producer")
    try:
        producer.start(wait_s=4 * RECONNECT_INTERVAL_S)
    finally:
        producer.close()
    warned = [r.getMessage() for r in caplog.records if r.name == "gateway.producer"]
    assert len(warned) == 1 and warned[0].startswith(
        f"kafka not reachable, retrying: no Kafka broker answers at {kafka.bootstrap_servers}")
    assert str(producer.connect_error) in warned[0]
