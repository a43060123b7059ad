"""Prompt serving over HTTP: seeded epochs, rollover, recycling, group_started events, a
cursor that survives a restart exactly, and concurrent consumers."""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pyarrow.compute as pc
import pytest

from ingest.io.broker import free_port
from ingest.io.lake import Lake
from ingest.sdk.publisher import RolloutPublisher
from ingest.workers import prompts as worker_prompts
from ingest.workers.prompts import GatewayPrompts, PartialSample
from schemas.events import decode_event
from tests.support.gateway_support import (
    GatewayProcess,
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


def test_a_log_that_contradicts_the_replay_is_a_500_naming_the_group(config, kafka):
    """A `group_started` in the log for a row the cursor's order does not give (another
    writer, a changed dataset) stops the restore with a one-line 500, and nothing is served."""
    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client, rollout_shuffle=False)  # group 0 would serve row 0
        version = client.get("/v1/datasets/math").json()["version"]
        with RolloutPublisher(kafka, create_topics=False) as publisher:
            publisher.group_started(run_id, group_index=0, step=0, n_samples=4,
                                    prompt_ref={"dataset": "math", "version": version, "row": 5})
        refused = client.post(f"/v1/runs/{run_id}/prompts")
    assert refused.status_code == 500
    assert refused.json() == {"detail": (
        f"cannot restore the prompt cursor of run {run_id!r}: group 0 was published with "
        f"prompt [('math', {version}, 5)], the replay gives row 0")}
    assert _started(kafka, run_id) == [(0, 5)]


def test_a_logged_prompt_ref_without_a_version_does_not_break_the_restore(config, kafka):
    """A producer that re-sent a served group's `group_started` without `version` (the
    contract allows it): the first-serve restore pins the version the gateway's own
    event names and continues after that group."""
    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client, rollout_shuffle=False)
        version = client.get("/v1/datasets/math").json()["version"]
        with RolloutPublisher(kafka, create_topics=False) as publisher:
            for ref in ({"dataset": "math", "version": version, "row": 0},
                        {"dataset": "math", "row": 0}):
                publisher.group_started(run_id, group_index=0, step=0, n_samples=4,
                                        prompt_ref=ref)
        served = _serve(client, run_id, 2)
    assert [(g["group_index"], g["prompt_ref"]) for g in served] == [
        (1, {"dataset": "math", "version": version, "row": 1}),
        (2, {"dataset": "math", "version": version, "row": 2})]


def _started(kafka, run_id):
    """group_index -> rows of every `group_started` of the run on the events topic."""
    events = [decode_event(r.value) for r in consume_all(kafka, kafka.topics.events)]
    return [(e.group_index, e.prompt_ref.row) for e in events
            if e.type == "group_started" and e.run_id == run_id]


def _checkpoints(lake_root, run_id):
    table = Lake(lake_root).read("prompt_cursor", filter=pc.field("run_id") == run_id)
    return table.sort_by("seq")


def _recycle(client, run_id, groups):
    response = client.post(f"/v1/runs/{run_id}/prompts/recycle", json={"group_indices": groups})
    assert response.status_code == 200, response.text
    return response.json()["cursor"]


def test_sigkill_with_a_stale_checkpoint_rolls_forward_exactly(kafka, lake_root, tmp_path):
    """Kill -9 the gateway process while its Delta checkpoint is behind: the restarted
    process rolls forward over the acknowledged group_started events and continues with
    the very next group (none served twice, none skipped), recycle buffer included."""
    config = gateway_config(kafka, lake_root, tmp_path / "state", max_prompts_per_request=64,
                            prompt_checkpoint_groups=1_000_000, prompt_checkpoint_interval_s=3600)
    with GatewayProcess(config, tmp_path / "gw1.json") as gw, gw.client() as client:
        run_id = _start(client)
        served = _serve(client, run_id, 5)  # groups 0-4, epoch 0 rows 0-4
        assert _recycle(client, run_id, [1, 3])["recycle_groups"] == [1, 3]  # checkpoint
        served += _serve(client, run_id, 3)  # 5-7: recycled 1 and 3, then epoch 0 row 5
        served += [g for _ in range(4) for g in _serve(client, run_id, 1)]  # 8-11
        before = client.get(f"/v1/runs/{run_id}/prompts/cursor").json()
        gw.kill()
    assert before["next_group_index"] == 12 and before["recycle_groups"] == []
    assert _checkpoints(lake_root, run_id)["next_group_index"].to_pylist()[-1] == 5  # behind

    config = config.model_copy(update={"port": free_port()})
    with GatewayProcess(config, tmp_path / "gw2.json") as gw, gw.client() as client:
        assert client.get(f"/v1/runs/{run_id}/prompts/cursor").json() == before
        served += _serve(client, run_id, 6)  # 12-17
        # Groups issued after the checkpoint (known only from the log) can be recycled.
        _recycle(client, run_id, [9, 12])
        again = _serve(client, run_id, 3)  # 18-20: recycled 9 and 12, then the dataset
        served += again
    indices = [g["group_index"] for g in served]
    assert indices == list(range(21))
    rows = {g["group_index"]: g["prompt_ref"]["row"] for g in served}
    order = _expected_rows(42, 4)
    assert [rows[i] for i in (5, 6)] == [rows[1], rows[3]]
    assert [g["recycled_from"] for g in again[:2]] == [9, 12]
    assert [rows[i] for i in (18, 19)] == [rows[9], rows[12]]
    epoch_groups = [i for i in range(21) if i not in (5, 6, 18, 19)]
    assert [rows[i] for i in epoch_groups] == order[:len(epoch_groups)]
    started = _started(kafka, run_id)
    assert sorted(started) == sorted(rows.items())  # each group published exactly once

    # Graceful shutdown wrote a final checkpoint: a third start needs no roll-forward.
    table = _checkpoints(lake_root, run_id)
    assert table["next_group_index"].to_pylist()[-1] == 21
    issued = pc.list_flatten(table["issued_groups"]).to_pylist()
    assert sorted(issued) == list(range(21))  # every group in exactly one checkpoint


def test_many_concurrent_consumers_with_background_checkpoints(kafka, lake_root, tmp_path):
    """12 callers with mixed counts while checkpoints are written in the background: every
    group goes to one caller, in the uninterrupted order, and the checkpoints and the log
    agree with what was served; a restart continues from the same cursor."""
    config = gateway_config(kafka, lake_root, tmp_path / "state", max_prompts_per_request=64,
                            prompt_checkpoint_groups=7, prompt_checkpoint_interval_s=0.05)
    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client)

        def consume(k: int) -> list[dict]:
            with gw.client() as own:
                return [g for i in range(8) for g in _serve(own, run_id, 1 + (k + i) % 3)]

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(consume, range(12)))
        cursor = client.get(f"/v1/runs/{run_id}/prompts/cursor").json()
    served = [g for result in results for g in result]
    total = len(served)
    indices = [g["group_index"] for g in served]
    assert sorted(indices) == list(range(total))
    for result in results:  # each caller's groups ascend: batches are issued in order
        assert [g["group_index"] for g in result] == sorted(g["group_index"] for g in result)
    rows = {g["group_index"]: g["prompt_ref"]["row"] for g in served}
    assert [rows[i] for i in range(total)] == _expected_rows(42, total // N_ROWS + 1)[:total]
    assert cursor["next_group_index"] == total
    started = _started(kafka, run_id)
    assert not [k for k, n in Counter(g for g, _ in started).items() if n > 1]
    assert sorted(started) == sorted(rows.items())
    table = _checkpoints(lake_root, run_id)
    assert table.num_rows > 2  # written while serving, not just at shutdown
    assert sorted(pc.list_flatten(table["issued_groups"]).to_pylist()) == list(range(total))
    with RunningGateway(config) as gw, gw.client() as client:
        after = client.get(f"/v1/runs/{run_id}/prompts/cursor").json()
        assert {**after, "seq": 0} == {**cursor, "seq": 0}
        assert [g["group_index"] for g in _serve(client, run_id, 2)] == [total, total + 1]


def _partial(group, rollout, status, tokens, versions=(0,), start=0):
    """A `RecycledSample` whose `tokens` came from `versions`, one run each (the last gets
    the rest)."""
    runs = [1] * (len(versions) - 1)
    runs.append(len(tokens) - sum(runs))
    return {"group_index": group, "rollout_id": rollout, "status": status,
            "response_tokens": tokens, "rollout_log_probs": [-0.1 * (i + 1) / 3 for i in tokens],
            "loss_mask": [1] * len(tokens),
            "segments": [{"tokens": n, "weight_version": v} for n, v in zip(runs, versions, strict=True)],
            "start_rollout_id": start}


def test_recycled_samples_survive_a_sigkill_and_come_back_once_with_their_group(
        kafka, lake_root, tmp_path):
    """Partial rollout at the gateway: a recycle carries what the groups' samples had
    generated; after a kill -9 the restarted gateway serves each recycled group once,
    with exactly those samples (a recycle repeated while the group waits adds nothing)."""
    config = gateway_config(kafka, lake_root, tmp_path / "state", max_prompts_per_request=64,
                            prompt_checkpoint_groups=1_000_000, prompt_checkpoint_interval_s=3600)
    one = [_partial(1, 0, "completed", [5, 6, 7]), _partial(1, 1, "aborted", [8, 9], (0, 2), 1)]
    two = [_partial(2, 0, "aborted", []), _partial(2, 1, "truncated", [3] * 40, (1,), 2)]
    with GatewayProcess(config, tmp_path / "gw1.json") as gw, gw.client() as client:
        run_id = _start(client)
        _serve(client, run_id, 3)
        url = f"/v1/runs/{run_id}/prompts/recycle"
        assert client.post(url, json={"group_indices": [1], "samples": one}).status_code == 200
        assert client.post(url, json={"group_indices": [2, 1],
                                      "samples": two + one[:1]}).status_code == 200
        gw.kill()
    config = config.model_copy(update={"port": free_port()})
    with GatewayProcess(config, tmp_path / "gw2.json") as gw, gw.client() as client:
        served = _serve(client, run_id, 3)
        assert [g["recycled_from"] for g in served] == [1, 2, None]
        assert served[0]["samples"] == one and served[1]["samples"] == two
        assert served[2]["samples"] == []
        gw.kill()
    with GatewayProcess(config, tmp_path / "gw3.json") as gw, gw.client() as client:
        later = _serve(client, run_id, 2)
    assert [g["recycled_from"] for g in later] == [None, None]
    assert [g["group_index"] for g in later] == [6, 7]


BAD_SAMPLES = [
    ([_partial(0, 0, "aborted", [1, 2])], "group 0 is not in group_indices"),
    ([_partial(1, 0, "aborted", [1]), _partial(1, 0, "aborted", [2])],
     "group 1 rollout 0 is given twice"),
    ([{**_partial(1, 0, "aborted", [1, 2]), "loss_mask": [1]}],
     "loss_mask has 1 entries but response_tokens has 2"),
    ([{**_partial(1, 0, "aborted", [1, 2]), "rollout_log_probs": [0.0]}],
     "rollout_log_probs has 1 entries but response_tokens has 2"),
    ([{**_partial(1, 0, "aborted", [1, 2]), "segments": [{"tokens": 1, "weight_version": 0}]}],
     "segments cover 1 tokens but response_tokens has 2"),
    ([{**_partial(1, 0, "aborted", [1]), "response_tokens": [-1]}], "response_tokens"),
    ([{**_partial(1, 0, "aborted", [1]), "loss_mask": [2]}], "loss_mask"),
    ([{**_partial(1, 0, "sealed", [1])}], "status"),
]


def test_a_recycle_with_bad_samples_is_a_422_naming_the_field_and_changes_nothing(config):
    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client)
        _serve(client, run_id, 2)
        for samples, expected in BAD_SAMPLES:
            refused = client.post(f"/v1/runs/{run_id}/prompts/recycle",
                                  json={"group_indices": [1], "samples": samples})
            assert refused.status_code == 422 and expected in str(refused.json()), refused.text
        cursor = client.get(f"/v1/runs/{run_id}/prompts/cursor").json()
    assert cursor["recycle_groups"] == []


@pytest.mark.one_broker("a recycle is HTTP and Delta; the broker carries no part of it")
def test_a_recycle_refused_or_unanswered_gives_the_samples_up_once_said(config, monkeypatch,
                                                                       caplog):
    """The worker's side of partial rollout (`GatewayPrompts.recycle`): a refusal (4xx) is
    not asked again, a gateway that does not answer is asked RECYCLE_ATTEMPTS times; either
    way one warning names the group and the answer, and False tells the worker to publish
    the cancelled samples with `recyclable: false`."""
    monkeypatch.setattr(worker_prompts, "RECYCLE_RETRY_S", 0.05)
    partial = {0: PartialSample("aborted", [5, 6], [-0.5, -0.25], [(2, 0)], 0)}

    def attempts(source: GatewayPrompts, group_index: int) -> tuple[bool, int]:
        sent: list[object] = []

        async def count(request: object) -> None:
            sent.append(request)

        async def recycle() -> bool:
            source.client.event_hooks["request"] = [count]
            try:
                return await source.recycle(group_index, partial)
            finally:
                await source.aclose()
        return asyncio.run(recycle()), len(sent)

    with RunningGateway(config) as gw, gw.client() as client:
        run_id = _start(client)
        served = _serve(client, run_id, 1)[0]["group_index"]
        source = lambda: GatewayPrompts(gw.url, run_id, "admin-token", None, 4)  # noqa: E731
        assert attempts(source(), served + 1) == (False, 1)  # never issued: 404
        assert f"could not recycle group {served + 1}" in caplog.text and "404" in caplog.text
        assert attempts(source(), served) == (True, 1)
        assert _serve(client, run_id, 1)[0]["samples"][0]["response_tokens"] == [5, 6]
    gone = GatewayPrompts(f"http://127.0.0.1:{free_port()}", run_id, None, None, 4)
    assert attempts(gone, 0) == (False, worker_prompts.RECYCLE_ATTEMPTS)
    assert caplog.text.count("could not recycle group") == 2
