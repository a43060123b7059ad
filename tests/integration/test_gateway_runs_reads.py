"""Runs, reads of processor tables (rows written through `Lake` here), ops endpoints,
config validation and the `rolloutlake gateway` command line."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime

import orjson
import pyarrow as pa
import pytest

from gateway.config import load_config
from ingest.io.lake import Lake
from schemas.errors import ConfigError
from schemas.tables import TABLES
from tests.support.gateway_support import RunningGateway, gateway_config

REFUSED_BEFORE_THE_BROKER = pytest.mark.one_broker("answered without the broker")

CONFIG = {"n_samples_per_prompt": 2, "rollout_batch_size": 1}
NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def gw(kafka, lake_root, tmp_path):
    with RunningGateway(gateway_config(kafka, lake_root, tmp_path / "state")) as running:
        yield running


def _write(lake: Lake, table: str, rows: list[dict]) -> int:
    return lake.append(table, pa.Table.from_pylist(rows, schema=TABLES[table].schema))


def test_start_list_and_get_runs(gw):
    with gw.client() as client:
        created = client.post("/v1/runs", json={"run_id": "run-a", "config": CONFIG})
        assert created.status_code == 201
        assert created.json()["config"]["advantage_estimator"] == "grpo"
        changed = client.post("/v1/runs", json={"run_id": "run-a", "config": {
            **CONFIG, "rollout_batch_size": 3, "my_filter_arg": 1}})
        assert changed.json()["config"]["rollout_batch_size"] == 3
        client.post("/v1/runs", json={"run_id": "run-b", "config": CONFIG}).raise_for_status()
        run = client.get("/v1/runs/run-a").json()
        assert run["config"]["my_filter_arg"] == 1
        assert run["first_started_at"] <= run["started_at"]
        assert [r["run_id"] for r in client.get("/v1/runs").json()] == ["run-a", "run-b"]
        assert client.get("/v1/runs/zzz").status_code == 404
    with gw.client("run-a-reader") as reader:
        assert [r["run_id"] for r in reader.get("/v1/runs").json()] == ["run-a"]
        assert reader.get("/v1/runs/run-b").status_code == 403
        assert reader.post("/v1/runs", json={"run_id": "run-a", "config": CONFIG}).status_code == 403


@REFUSED_BEFORE_THE_BROKER
@pytest.mark.parametrize("body, field", [
    ({"run_id": "r", "config": {"rollout_batch_size": 1}}, "n_samples_per_prompt"),
    ({"run_id": "r", "config": {**CONFIG, "over_sampling_batch_size": 0}},
     "over_sampling_batch_size"),
    ({"run_id": "r", "config": {**CONFIG, "advantage_estimator": "ppo"}}, "advantage_estimator"),
])
def test_invalid_run_config_is_422_naming_the_field(gw, body, field):
    with gw.client() as client:
        response = client.post("/v1/runs", json=body)
    assert response.status_code == 422
    assert field in response.json()["detail"]


@REFUSED_BEFORE_THE_BROKER
def test_run_with_unknown_dataset_or_bad_id_is_422(gw):
    with gw.client() as client:
        missing = client.post("/v1/runs", json={"run_id": "r", "config": CONFIG, "dataset": "nope"})
        assert missing.status_code == 422 and "does not exist" in missing.json()["detail"]
        assert client.post("/v1/runs", json={"run_id": "a/b", "config": CONFIG}).status_code == 422


def test_step_manifest_metrics_and_default_prompt_step(gw, lake_root):
    lake = Lake(lake_root)
    with gw.client() as client:
        assert client.get("/v1/runs/run-a/metrics").json() == {"run_id": "run-a", "steps": []}
        assert client.get("/v1/runs/run-a/steps/0").status_code == 404
        rows = [{"run_id": "run-a", "step": 0, "position": p, "group_index": 0, "rollout_id": p,
                 "sample_index": p, "fragment_index": 0, "prompt_tokens": [1, 2],
                 "response_tokens": [3], "loss_mask": [1], "rollout_log_probs": [-0.1],
                 "reward": 1.0, "advantage": 0.5, "status": "completed", "weight_version": 0}
                for p in range(2)]
        version = _write(lake, "training_batches", rows)
        _write(lake, "steps", [{"run_id": "run-a", "step": 0, "n_groups": 1, "n_samples": 2,
                                "sealed_at": NOW, "batch_version": version,
                                "content_sha256": "ab" * 32, "n_rollouts": 2, "n_tokens": 6}])
        _write(lake, "groups", [
            {"run_id": "run-a", "group_index": g, "step": 0, "n_samples": 2, "decision": d,
             "reason": None if d == "kept" else "zero_std_0.0", "batch_step": 0,
             "decided_at": NOW, "mean_reward": 1.0} for g, d in ((0, "kept"), (1, "dropped"))])
        _write(lake, "step_metrics", [
            {"run_id": "run-a", "step": s, "key": k, "value": float(s)}
            for s in (0, 1) for k in ("rollout/raw_reward", "rollout/groups_kept")])
        manifest = client.get("/v1/runs/run-a/steps/0").json()
        assert manifest["manifest"]["content_sha256"] == "ab" * 32
        assert manifest["training_rows"] == 2
        assert manifest["groups"] == {"kept": 1, "dropped": 1}
        all_metrics = client.get("/v1/runs/run-a/metrics").json()["steps"]
        assert [s["step"] for s in all_metrics] == [0, 1]
        assert all_metrics[1]["metrics"] == {"rollout/groups_kept": 1.0, "rollout/raw_reward": 1.0}
        since = client.get("/v1/runs/run-a/metrics", params={"since_step": 0}).json()["steps"]
        assert [s["step"] for s in since] == [1]

        # Prompt serving without ?step= tags groups with the number of sealed steps.
        client.post("/v1/datasets/d", params={"filename": "d.jsonl"},
                    content=b'{"input": "x"}\n').raise_for_status()
        client.post("/v1/runs", json={"run_id": "run-a", "config": CONFIG,
                                      "dataset": "d"}).raise_for_status()
        served = client.post("/v1/runs/run-a/prompts").json()["groups"]
        assert served[0]["step"] == 1


TRAINER_FLOATS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "ppo_kl",
                  "entropy", "grad_norm", "lr", "seconds")


def test_group_audit(gw, lake_root):
    lake = Lake(lake_root)
    payloads = [{"type": "group_started", "event_id": "e0", "group_index": 5},
                {"type": "sample_finished", "event_id": "e1", "group_index": 5}]
    _write(lake, "events", [
        {"run_id": "run-a", "event_id": p["event_id"], "type": p["type"], "group_index": 5,
         "rollout_id": None, "topic": "rollout.events", "partition": 1, "offset": 10 - i,
         "ingested_at": NOW, "payload": orjson.dumps(p).decode()}
        for i, p in enumerate(payloads)])
    with gw.client() as client:
        undecided = client.get("/v1/runs/run-a/groups/5").json()
        assert [e["event_id"] for e in undecided["events"]] == ["e1", "e0"]  # offset order
        assert undecided["events"][0]["payload"]["type"] == "sample_finished"
        assert undecided["decision"] is None and undecided["training_rows"] == []
        _write(lake, "groups", [{"run_id": "run-a", "group_index": 5, "step": 0, "n_samples": 1,
                                 "decision": "kept", "reason": None, "batch_step": 0,
                                 "decided_at": NOW, "mean_reward": 1.0}])
        _write(lake, "samples", [{"run_id": "run-a", "group_index": 5, "rollout_id": 0,
                                  "fragment_index": 0, "status": "completed", "reward": 1.0,
                                  "response_length": 1, "decision": "kept", "reason": None}])
        _write(lake, "training_batches", [{
            "run_id": "run-a", "step": 0, "position": 0, "group_index": 5, "rollout_id": 0,
            "sample_index": 0, "fragment_index": 0, "prompt_tokens": [1], "response_tokens": [2],
            "loss_mask": [1], "rollout_log_probs": None, "reward": 1.0, "advantage": 0.0,
            "status": "completed", "weight_version": None}])
        audit = client.get("/v1/runs/run-a/groups/5").json()
        assert audit["decision"]["decision"] == "kept"
        assert audit["samples"][0]["reward"] == 1.0
        assert audit["training_rows"][0]["position"] == 0
        assert "response_tokens" not in audit["training_rows"][0]
        assert audit["events"][0]["topic"] == "rollout.events"
        assert audit["steps"] == [] and audit["trainer_steps"] == []
        assert client.get("/v1/runs/run-a/groups/6").status_code == 404
        assert client.get("/v1/runs/run-z/groups/5").status_code == 404

        # Sealed, trained, and a rejected message of the group: lineage reaches the update.
        batch_version = lake.version("training_batches")
        _write(lake, "steps", [{"run_id": "run-a", "step": 0, "n_groups": 1, "n_samples": 1,
                                "sealed_at": NOW, "batch_version": batch_version,
                                "content_sha256": "ab" * 32}])
        _write(lake, "trainer_steps", [{**{c: 0.0 for c in TRAINER_FLOATS}, "run_id": "run-a",
                                        "step": 0, "batch_version": batch_version,
                                        "content_sha256": "ab" * 32, "tokens": 2,
                                        "loss_tokens": 1, "update": 1, "trained_at": NOW,
                                        "loss": 0.25}])
        _write(lake, "dead_letters", [{"topic": "rollout.events", "partition": 1, "offset": 11,
                                       "error": "rollout 9 exceeds the group's n_samples=1",
                                       "raw": b'{"event_id": "e2"}', "at": NOW,
                                       "run_id": "run-a", "group_index": 5}])
        audit = client.get("/v1/runs/run-a/groups/5").json()
        assert audit["steps"][0]["batch_version"] == batch_version
        assert [(t["loss"], t["update"]) for t in audit["trainer_steps"]] == [(0.25, 1)]
        assert audit["dead_letters"][0]["offset"] == 11
        assert audit["dead_letters"][0]["raw_preview"] == '{"event_id": "e2"}'
        # As of the first batch version nothing was sealed or trained yet.
        then = client.get("/v1/runs/run-a/groups/5", params={"as_of": batch_version}).json()
        assert then["steps"] == [] and then["trainer_steps"] == []
        bad = client.get("/v1/runs/run-a/groups/5", params={"as_of": "later"})
        assert bad.status_code == 422 and "as of 'later'" in bad.json()["detail"]

        row = client.get("/v1/runs/run-a/steps/0/rows/0").json()
        assert (row["row"]["group_index"], row["row"]["rollout_id"]) == (5, 0)
        assert row["group"]["trainer_steps"] == audit["trainer_steps"]
        assert "response_tokens" not in row["row"]
        assert client.get("/v1/runs/run-a/steps/0/rows/1").status_code == 404

        trained = client.get("/v1/runs/run-a/trainer-steps/0").json()
        assert trained["trainer_step"]["update"] == 1
        assert [g["group_index"] for g in trained["groups"]] == [5]
        assert trained["groups"][0]["positions"] == [0]
        assert not trained["content_verified"]  # the recorded hash is not the rows' hash
        missing = client.get("/v1/runs/run-a/trainer-steps/3")
        assert missing.status_code == 404 and "trained steps 0..0" in missing.json()["detail"]
    with gw.client(token=None) as anonymous:
        assert anonymous.get("/v1/runs/run-a/groups/5").status_code == 401
    with gw.client("run-a-reader") as reader:
        assert reader.get("/v1/runs/run-a/groups/5").status_code == 200
        assert reader.get("/v1/runs/run-b/metrics").status_code == 403


@REFUSED_BEFORE_THE_BROKER
def test_health_and_metrics_are_open(gw):
    with gw.client(token=None) as client:
        assert client.get("/healthz").json()["kafka"] == "connected"
        client.get("/v1/runs/x/metrics")
        text = client.get("/metrics").text
    assert 'gateway_requests_total{method="GET",route="/v1/runs/{run_id}/metrics",status="401"}' in text
    assert "gateway_request_seconds_bucket" in text


@REFUSED_BEFORE_THE_BROKER
def test_access_log_names_the_principal_never_the_token(gw, caplog):
    with caplog.at_level("INFO", logger="gateway.access"), gw.client() as client:
        client.get("/v1/runs")
        for _ in range(100):  # the line is written just after the response is sent
            lines = [r.getMessage() for r in caplog.records if r.name == "gateway.access"]
            if lines:
                break
            time.sleep(0.02)
    assert any('"principal": "admin"' in line for line in lines)
    assert not any("admin-token" in line for line in lines)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="no bearer token is configured"):
        load_config({}, env={})
    with pytest.raises(ConfigError, match="^--body-limit-bytes: Input should be greater"):
        load_config({"allow_anonymous": True, "body_limit_bytes": 1}, env={})
    with pytest.raises(ConfigError, match="^bogus: Extra inputs are not permitted"):
        load_config({"allow_anonymous": True, "bogus": 1}, env={})
    with pytest.raises(ConfigError, match="^--tokens-file: cannot read"):
        load_config({"tokens_file": tmp_path / "missing.json"}, env={})
    with pytest.raises(ConfigError, match="ROLLOUTLAKE_GATEWAY_TOKENS is not valid JSON"):
        load_config({}, env={"ROLLOUTLAKE_GATEWAY_TOKENS": "{"})
    with pytest.raises(ConfigError, match="must hold a JSON list"):
        load_config({}, env={"ROLLOUTLAKE_GATEWAY_TOKENS": "{}"})
    env_token = '[{"name": "ci", "sha256": "' + "0" * 64 + '", "scopes": ["read"]}]'
    assert load_config({}, env={"ROLLOUTLAKE_GATEWAY_TOKENS": env_token}).tokens[0].name == "ci"


def test_cli_hashes_tokens_and_fails_in_one_line(tmp_path):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ingest.cli", "gateway", *args],
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin"})

    hashed = cli("--hash-token", "s3cret")
    assert hashed.returncode == 0 and len(hashed.stdout.strip()) == 64
    no_tokens = cli("--lake", str(tmp_path))
    assert no_tokens.returncode == 2
    assert no_tokens.stderr.strip().count("\n") == 0 and "no bearer token" in no_tokens.stderr


@REFUSED_BEFORE_THE_BROKER
def test_a_run_config_over_the_event_limit_is_a_422_naming_the_limit(gw):
    """Under the body limit, over the 8 MiB an event may have: refused before publishing."""
    big = {f"k{i}": "x" * 1_000_000 for i in range(9)}  # each value within the object bound
    with gw.client() as client:
        response = client.post("/v1/runs", json={"run_id": "big", "config": {**CONFIG, **big}})
        assert response.status_code == 422, response.text[:300]
        assert "the limit is 8388608 bytes" in response.json()["detail"]
        assert client.get("/v1/runs/big").status_code == 404
