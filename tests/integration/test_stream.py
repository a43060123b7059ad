"""The metric and decision event streams, over HTTP against a live gateway and a real lake.

Rows are appended with Lake while a stream is open; the gateway is stopped (cutting the
stream) and a fresh one resumes from Last-Event-ID.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.feeds import POLL_S
from ingest.io.lake import Lake
from tests.support.metric_fixtures import (
    READER_TOKEN,
    contract_table,
    gateway,
    simulate_step,
    write_steps,
)

RUN = "dapo-stream"
AUTH = {"Authorization": f"Bearer {READER_TOKEN}"}
TIMEOUT = httpx.Timeout(20.0)


def events(response: httpx.Response) -> Iterator[tuple[str, str, dict]]:
    """(id, event, data) of each server-sent event; comments and `retry:` are skipped."""
    event_id, kind, data = None, None, []
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and data:
            yield event_id, kind, json.loads("".join(data))
            event_id, kind, data = None, None, []


def take(stream: Iterator[tuple[str, str, dict]], n: int) -> list[tuple[str, str, dict]]:
    return [next(stream) for _ in range(n)]


def expected_metrics(step: int) -> dict[str, float]:
    return {r["key"]: r["value"] for r in simulate_step(RUN, step)["step_metrics"]}


def test_every_sealed_step_once_in_order_across_a_gateway_restart(kafka, lake_root, tmp_path):
    lake = Lake(lake_root)
    write_steps(lake, RUN, range(0, 3))
    write_steps(lake, "other-run", range(0, 2))  # must not leak into RUN's stream
    received: list[dict] = []

    with gateway(kafka, lake_root, tmp_path) as server, httpx.Client(
        base_url=server.url, headers=AUTH, timeout=TIMEOUT
    ) as client, client.stream("GET", f"/v1/runs/{RUN}/metrics/stream") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = events(response)
        received += [data for _, _, data in take(stream, 3)]
        for step in (3, 4):  # sealed while the stream is open
            write_steps(lake, RUN, range(step, step + 1))
            event_id, kind, data = next(stream)
            assert (event_id, kind) == (str(step), "step")
            received.append(data)
    # The gateway is gone; steps keep sealing.
    write_steps(lake, RUN, range(5, 7))
    last_id = str(received[-1]["step"])

    with gateway(kafka, lake_root, tmp_path) as server, httpx.Client(
        base_url=server.url, headers={**AUTH, "Last-Event-ID": last_id}, timeout=TIMEOUT
    ) as client, client.stream("GET", f"/v1/runs/{RUN}/metrics/stream") as response:
        stream = events(response)
        received += [data for _, _, data in take(stream, 2)]
        write_steps(lake, RUN, range(7, 8))
        received.append(next(stream)[2])

    assert [d["step"] for d in received] == list(range(8))
    for data in received:
        assert data["run_id"] == RUN
        assert data["metrics"] == pytest.approx(expected_metrics(data["step"]))
        assert data["n_groups"] == 8 and data["sealed_at"]


def test_a_step_waits_for_its_metrics_and_query_cursor_resumes(kafka, lake_root, tmp_path):
    lake = Lake(lake_root)
    write_steps(lake, RUN, range(0, 2))
    rows = simulate_step(RUN, 2)
    with gateway(kafka, lake_root, tmp_path) as server, httpx.Client(
        base_url=server.url, headers=AUTH, timeout=TIMEOUT
    ) as client:
        with client.stream("GET", f"/v1/runs/{RUN}/metrics/stream?after=0") as response:
            stream = events(response)
            assert next(stream)[0] == "1"
            # The steps row commits before the metrics: the step is held until both exist.
            lake.append("steps", contract_table("steps", rows["steps"]))
            lake.append("step_metrics", contract_table("step_metrics", rows["step_metrics"]))
            event_id, _, data = next(stream)
            assert event_id == "2"
            assert data["metrics"] == pytest.approx(expected_metrics(2))


def test_decision_stream_sends_latest_groups_then_new_decisions(kafka, lake_root, tmp_path):
    lake = Lake(lake_root)
    write_steps(lake, RUN, range(0, 10))
    with gateway(kafka, lake_root, tmp_path) as server, httpx.Client(
        base_url=server.url, headers=AUTH, timeout=TIMEOUT
    ) as client, client.stream("GET", f"/v1/runs/{RUN}/decisions/stream") as response:
        stream = events(response)
        backlog = take(stream, 50)  # GROUP_BACKLOG latest decisions
        assert all(kind == "group" for _, kind, _ in backlog)
        decided = [d["decided_at"] for _, _, d in backlog]
        assert decided == sorted(decided)
        assert backlog[-1][2]["step"] == 9
        write_steps(lake, RUN, range(10, 11))
        fresh = next(stream)[2]
        assert fresh["step"] == 10 and fresh["decision"] in {"kept", "dropped"}
        assert set(fresh) >= {"group_index", "decision", "reason", "mean_reward", "decided_at"}


def test_streams_need_a_token_with_read_scope_on_the_run(kafka, lake_root, tmp_path):
    write_steps(Lake(lake_root), RUN, range(0, 1))
    with gateway(kafka, lake_root, tmp_path) as server, httpx.Client(
        base_url=server.url, timeout=TIMEOUT
    ) as client:
        assert client.get(f"/v1/runs/{RUN}/metrics/stream").status_code == 401
        other = {"Authorization": "Bearer run-a-reader"}  # read scope on run-a only
        denied = client.get(f"/v1/runs/{RUN}/metrics/stream", headers=other)
        assert denied.status_code == 403 and "read" in denied.json()["detail"]
        assert client.get(f"/v1/runs/{RUN}/decisions/stream", headers=other).status_code == 403


def test_a_lake_that_fails_every_poll_is_logged_once_and_the_stream_resumes(
        kafka, lake_root, tmp_path, caplog):
    """The shared poller retries four times a second, and logged a traceback at every try
    while the lake failed. Now it says so once, and once more when the lake reads again;
    the stream stays open throughout and carries on with the next step."""
    lake = Lake(lake_root)
    write_steps(lake, RUN, range(0, 2))
    log_dir = Path(lake.uri("steps")) / "_delta_log"
    unreadable = log_dir / f"{max(int(p.stem) for p in log_dir.glob('*.json')) + 1:020d}.json"
    with gateway(kafka, lake_root, tmp_path) as server, httpx.Client(
        base_url=server.url, headers=AUTH, timeout=TIMEOUT
    ) as client, client.stream("GET", f"/v1/runs/{RUN}/metrics/stream") as response:
        stream = events(response)
        assert [data["step"] for _, _, data in take(stream, 2)] == [0, 1]
        unreadable.write_text("not a Delta commit\n")
        time.sleep(8 * POLL_S)
        unreadable.unlink()
        write_steps(lake, RUN, range(2, 3))
        assert [data["step"] for _, _, data in take(stream, 1)] == [2]
    said = [r.getMessage() for r in caplog.records if r.name == "gateway.feeds"]
    assert said == [f"polling run {RUN} failed; retrying every {POLL_S:g} s",
                    f"polling run {RUN} works again"]
