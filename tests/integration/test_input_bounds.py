"""Input at the edges: the gateway (real HTTP) and the SDK (real broker) refuse what the
tables cannot store, authorize before they validate, and know an event by its run."""

from __future__ import annotations

import math
import subprocess
import sys

import orjson
import pytest

from ingest.sdk.publisher import RolloutPublisher
from schemas.errors import EventValidationError
from tests.support.gateway_support import (
    RunningGateway,
    consume_all,
    gateway_config,
    sample_events,
)

# What is refused never reaches the broker; the publish path runs on both engines in
# test_gateway_events.
REFUSED_BEFORE_THE_BROKER = pytest.mark.one_broker("what is refused never reaches the broker")


@pytest.fixture
def gw(kafka, lake_root, tmp_path):
    with RunningGateway(gateway_config(kafka, lake_root, tmp_path / "state")) as running:
        yield running


def _nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def _with(event: dict, **fields) -> bytes:
    """The event as JSON with raw JSON text for some fields (NaN, deep nesting)."""
    body = orjson.dumps({k: v for k, v in event.items() if k not in fields})
    extra = b"".join(b',"' + k.encode() + b'":' + v for k, v in fields.items())
    return body[:-1] + extra + b"}"


@REFUSED_BEFORE_THE_BROKER
@pytest.mark.parametrize(("index", "fields", "field"), [
    (1, {"response_tokens": b"[2147483648]"}, "response_tokens.0"),
    (0, {"group_index": b"9223372036854775808"}, "group_index"),
    (1, {"sample_index": b"9223372036854775808"}, "sample_index"),
    (2, {"metadata": _nested(300)}, "metadata" + ".a" * 32),
    (2, {"reward": b"NaN"}, "reward"),
    (1, {"reward": b"Infinity"}, "reward"),
    (1, {"reward": b"1e400"}, "reward"),
    (2, {"rollout_log_probs": b"[NaN" + b",-0.5" * 63 + b"]"}, "rollout_log_probs.0"),
    (0, {"run_id": b'".."'}, "run_id"),
])
def test_events_the_tables_cannot_store_are_422_naming_the_field(gw, kafka, index, fields,
                                                                field):
    """The gateway answered 202 to each of these, and the processor then stopped on them."""
    events = sample_events("run-a", 0)
    body = b"[" + b",".join(_with(e, **fields) if i == index else orjson.dumps(e)
                            for i, e in enumerate(events)) + b"]"
    with gw.client() as client:
        response = client.post("/v1/events", content=body,
                               headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert [(e["index"], e["field"]) for e in response.json()["errors"]] == [(index, field)]
    assert consume_all(kafka, kafka.topics.events) == []


@REFUSED_BEFORE_THE_BROKER
def test_authorization_is_decided_before_the_body_is_validated(gw):
    invalid = [{"type": "sample_finished", "run_id": "run-a", "event_id": "x"}]
    cases = [
        (None, "/v1/events", {"json": invalid}, 401),
        (None, "/v1/events", {"content": b"{not json"}, 401),
        ("reader-token", "/v1/events", {"json": invalid}, 403),
        ("reader-token", "/v1/events", {"content": b"{not json"}, 403),
        ("run-a-writer", "/v1/events",
         {"json": [{**invalid[0], "run_id": "run-b"}]}, 403),
        ("run-a-writer", "/v1/events", {"json": invalid}, 422),  # may write: told what is wrong
        ("reader-token", "/v1/runs", {"json": {"run_id": "run-a", "config": "none"}}, 403),
        (None, "/v1/runs", {"json": {"run_id": ".."}}, 401),
        # FastAPI decodes JSON bodies before the auth dependencies run.
        (None, "/v1/runs", {"content": b"{not json"}, 401),
        ("reader-token", "/v1/runs", {"content": b"{not json"}, 403),
        ("reader-token", "/v1/runs/run-a/prompts/recycle", {"content": b"{not json"}, 403),
        ("admin-token", "/v1/runs", {"content": b"{not json"}, 422),
    ]
    for token, path, body, status in cases:
        with gw.client(token=token) as client:
            headers = {"Content-Type": "application/json"}
            response = client.post(path, headers=headers, **body)
        assert response.status_code == status, (token, path, body, response.text)


def test_the_same_event_id_in_another_run_is_another_event(kafka, lake_root, tmp_path):
    """Duplicates are keyed (run_id, event_id): run B's event reusing an id of run A was
    answered as a duplicate and never published. Keys survive a gateway restart."""
    config = gateway_config(kafka, lake_root, tmp_path / "state")
    run_a = sample_events("run-a", 0)
    run_b = [{**event, "run_id": "run-b"} for event in run_a]
    with RunningGateway(config) as gw, gw.client() as client:
        assert client.post("/v1/events", json=run_a).json() == {"accepted": 3, "duplicates": 0}
        assert client.post("/v1/events", json=run_b).json() == {"accepted": 3, "duplicates": 0}
    with RunningGateway(config) as gw, gw.client() as client:
        assert client.post("/v1/events", json=run_b).json() == {"accepted": 0, "duplicates": 3}
    records = consume_all(kafka, kafka.topics.events)
    assert sorted(orjson.loads(r.value)["run_id"] for r in records) == ["run-a"] * 3 + ["run-b"] * 3


@REFUSED_BEFORE_THE_BROKER
@pytest.mark.parametrize("path", ["/v1/runs/%2E%2E", "/v1/runs/%2E/steps/0",
                                  "/v1/runs/%2E%2E/metrics"])
def test_path_step_run_ids_are_refused_in_paths(gw, path):
    with gw.client() as client:
        response = client.get(path)
    assert response.status_code == 422, response.text
    assert "run id" in response.text


def test_run_id_flags_refuse_path_steps(lake_root):
    for command in ("replay", "audit", "watch", "wandb-sync"):
        extra = ["--group", "0"] if command == "audit" else []
        result = subprocess.run(
            [sys.executable, "-m", "ingest.cli", command, "--lake", lake_root, "--run", "..",
             *extra], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, (command, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert "'..' is not a run id" in lines[-1] and "Traceback" not in result.stderr, command


@REFUSED_BEFORE_THE_BROKER
@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_the_sdk_refuses_non_finite_rewards_instead_of_sending_null(kafka, reward):
    with RolloutPublisher(kafka) as pub:
        with pytest.raises(EventValidationError, match=r"sample_finished event .*: reward: "):
            pub.sample_finished("run-a", group_index=0, rollout_id=0, status="completed",
                                prompt_tokens=[1], response_tokens=[2], reward=reward)
        with pytest.raises(EventValidationError, match=r"reward event .*: reward: "):
            pub.reward("run-a", group_index=0, rollout_id=0, reward=reward)
        with pytest.raises(EventValidationError, match=r"reward.score: "):
            pub.reward("run-a", group_index=0, rollout_id=0, reward={"score": reward})
    assert consume_all(kafka, kafka.topics.events) == []


@REFUSED_BEFORE_THE_BROKER
def test_the_sdk_refuses_out_of_bounds_fields_by_name(kafka):
    with RolloutPublisher(kafka) as pub:
        with pytest.raises(EventValidationError, match="response_tokens.0: "):
            pub.sample_finished("run-a", group_index=0, rollout_id=0, status="completed",
                                prompt_tokens=[1], response_tokens=[2**31], reward=1.0)
        deep: dict = {}
        for _ in range(5000):
            deep = {"a": deep}
        with pytest.raises(EventValidationError, match="nested deeper than 32 levels"):
            pub.group_started("run-a", group_index=0, step=0, n_samples=2, metadata=deep)
        with pytest.raises(EventValidationError, match="run_id: "):
            pub.group_started("..", group_index=0, step=0, n_samples=2)
    assert consume_all(kafka, kafka.topics.events) == []
