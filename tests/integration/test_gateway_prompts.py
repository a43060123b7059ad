"""Prompt serving over HTTP: seeded epochs, rollover, recycling, group_started events, a
cursor that survives a restart exactly, and concurrent consumers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest

from schemas.events import decode_event
from tests.integration.gateway_support import (
    RunningGateway,
    consume_all,
    gateway_config,
    unique_run,
)

N_ROWS = 7


@pytest.fixture
def config(kafka, lake_root, tmp_path):
    return gateway_config(kafka, lake_root, tmp_path / "state", max_prompts_per_request=64)


def _start(client, n_rows=N_ROWS, **extra):
    body = b"".join(orjson.dumps({"input": f"p{i}", "label": i}) + b"\n" for i in range(n_rows))
    client.post("/v1/datasets/math", params={"filename": "m.jsonl", "label_key": "label"},
                content=body).raise_for_status()
    run_id = unique_run()
    config = {"n_samples_per_prompt": 4, "rollout_batch_size": 2, **extra}
    client.post("/v1/runs", json={"run_id": run_id, "config": config,
                                  "dataset": "math"}).raise_for_status()
    return run_id


def _serve(client, run_id, count, **params):
    response = client.post(f"/v1/runs/{run_id}/prompts", params={"count": count, **params})
    assert response.status_code == 200, response.text
    return response.json()["groups"]


def _expected_rows(seed, epochs):
    return [r for e in range(epochs) for r in np.random.default_rng(seed + e).permutation(N_ROWS)]


def test_seeded_epochs_straddle_and_publish_group_started(config, kafka):
    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client, rollout_seed=7)
        first = _serve(client, run_id, 5)
        second = _serve(client, run_id, 5, step=3)  # rows 5..6 of epoch 0, 0..2 of epoch 1
        assert "gateway_prompt_groups_served_total 10.0" in client.get("/metrics").text
    groups = first + second
    assert [g["group_index"] for g in groups] == list(range(10))
    assert [g["prompt_ref"]["row"] for g in groups] == _expected_rows(7, 2)[:10]
    assert [g["epoch"] for g in second] == [0, 0, 1, 1, 1]
    assert all(g["prompt"] == f"p{g['label']}" and g["n_samples"] == 4 for g in groups)
    assert {g["step"] for g in first} == {0} and {g["step"] for g in second} == {3}
    started = [decode_event(r.value) for r in consume_all(kafka, kafka.topics.events)]
    assert sorted(e.group_index for e in started) == list(range(10))
    by_index = {e.group_index: e for e in started}
    assert by_index[6].prompt == groups[6]["prompt"] and by_index[6].step == 3
    assert by_index[6].prompt_ref.row == groups[6]["prompt_ref"]["row"]


def test_unshuffled_run_serves_the_original_order(config):
    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client, rollout_shuffle=False)
        rows = [g["prompt_ref"]["row"] for g in _serve(client, run_id, 9)]
    assert rows == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_cursor_and_recycle_buffer_survive_a_restart_exactly(config):
    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client)
        served = _serve(client, run_id, 4)
        recycled = client.post(f"/v1/runs/{run_id}/prompts/recycle",
                               json={"group_indices": [1, 3, 1]})
        assert recycled.status_code == 200
        assert recycled.json()["cursor"]["recycle_groups"] == [1, 3]
        cursor = client.get(f"/v1/runs/{run_id}/prompts/cursor").json()
    with RunningGateway(config) as gw, gw.client() as client:
        assert client.get(f"/v1/runs/{run_id}/prompts/cursor").json() == cursor
        after = _serve(client, run_id, 6)
    assert [g["recycled_from"] for g in after[:2]] == [1, 3]
    assert [g["prompt_ref"]["row"] for g in after[:2]] == [served[1]["prompt_ref"]["row"],
                                                           served[3]["prompt_ref"]["row"]]
    assert [g["group_index"] for g in after] == list(range(4, 10))
    assert [g["prompt_ref"]["row"] for g in after[2:]] == _expected_rows(42, 2)[4:8]


def test_two_concurrent_consumers_never_get_the_same_group(config):
    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client)

        def consume(_: int) -> list[int]:
            with gw.client() as own:
                return [g["group_index"] for _ in range(10) for g in _serve(own, run_id, 3)]

        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(consume, range(2))
        cursor = client.get(f"/v1/runs/{run_id}/prompts/cursor").json()
    assert not set(a) & set(b)
    assert sorted(a + b) == list(range(60))
    assert cursor["next_group_index"] == 60
    assert cursor["epoch"] == 60 // N_ROWS and cursor["offset"] == 60 % N_ROWS


def test_prompt_errors(config):
    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client)
        assert client.post("/v1/runs/nope/prompts").status_code == 404
        assert client.get("/v1/runs/nope/prompts/cursor").status_code == 404
        too_many = client.post(f"/v1/runs/{run_id}/prompts", params={"count": 65})
        assert too_many.status_code == 422 and "limit of 64" in too_many.json()["detail"]
        assert client.post(f"/v1/runs/{run_id}/prompts", params={"count": 0}).status_code == 422
        unknown = client.post(f"/v1/runs/{run_id}/prompts/recycle", json={"group_indices": [0]})
        assert unknown.status_code == 404 and "not issued" in unknown.json()["detail"]
        client.post("/v1/runs", json={"run_id": "bare", "config": {
            "n_samples_per_prompt": 1, "rollout_batch_size": 1}}).raise_for_status()
        no_dataset = client.post("/v1/runs/bare/prompts")
        assert no_dataset.status_code == 409 and "without a dataset" in no_dataset.json()["detail"]
    with RunningGateway(config) as gw, gw.client("run-a-reader") as reader:
        assert reader.post(f"/v1/runs/{run_id}/prompts").status_code == 403
