"""The lake on S3: a local S3-compatible server (moto's server mode, from PyPI, with atomic
conditional puts: tests/support/s3_server.py) started by the test, several writers per
table, commits made safe by conditional put."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import orjson
import pyarrow as pa
import pytest

from gateway.datasets import DatasetOptions, DatasetStore
from ingest.commands.simulate import SimulationConfig, open_loop_groups
from ingest.io.broker import free_port
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake, TxnMark
from ingest.sdk.publisher import RolloutPublisher
from schemas.events import event_group_key
from schemas.tables import STEP_METRICS
from tests.integration.pipeline import assert_keys_once, ordered_kafka, run_processor, run_rows
from tests.support.engine_server import ROOT

pytestmark = pytest.mark.one_broker("the object store's commits; the broker path is tested on both engines elsewhere")

BUCKET = "rolloutlake"
SIM = SimulationConfig(
    run_id="s3run", steps=8, rollout_batch_size=3, n_samples=4, response_len_mean=24,
    prompt_len=8, compaction_rate=0.15, duplicate_rate=0.05, abort_rate=0.03,
    missing_reward_rate=0.03, seed=4, mode="open", surplus_per_step=1,
)


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory):
    """AWS_* settings of a moto S3 server on a free loopback port, bucket created."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.support.s3_server", "127.0.0.1", str(port)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, "moto did not start"
            time.sleep(0.1)
    env = {
        "AWS_ACCESS_KEY_ID": "rolloutlake",
        "AWS_SECRET_ACCESS_KEY": "rolloutlake-secret",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    ).create_bucket(Bucket=BUCKET)
    yield env
    server.terminate()
    server.wait(timeout=10)
    log.close()


def _lake(env: dict[str, str], prefix: str) -> Lake:
    return Lake(f"s3://{BUCKET}/{prefix}", storage_options=env)


def test_concurrent_writers_of_one_table_lose_no_commit(s3_env):
    """Four writers (separate Lake instances, as separate processes would be) append to
    one table at once; every commit and every app-transaction mark survives."""
    writers, commits = 4, 6

    def write(writer: int) -> None:
        lake = _lake(s3_env, "concurrent")
        for n in range(commits):
            row = {"run_id": "r", "step": n, "key": f"w{writer}", "value": float(n)}
            lake.append(STEP_METRICS.name, pa.Table.from_pylist([row], schema=STEP_METRICS.schema),
                        marks=[TxnMark(f"writer-{writer}", n)])

    _lake(s3_env, "concurrent").ensure(STEP_METRICS.name)
    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lake = _lake(s3_env, "concurrent")
    for compacted in (False, True):  # then compacted on the object store: the same rows
        got = lake.read(STEP_METRICS.name, columns=["key", "step"]).to_pylist()
        assert sorted((r["key"], r["step"]) for r in got) == sorted(
            (f"w{w}", n) for w in range(writers) for n in range(commits)), compacted
        assert [lake.txn_version(STEP_METRICS.name, f"writer-{w}") for w in range(writers)] == [
            commits - 1] * writers
        if not compacted:
            assert lake.compact(STEP_METRICS.name) == {"added": 1, "removed": writers * commits}
            assert lake.active_files(STEP_METRICS.name) == 1


def _publish(kafka: KafkaSettings, pause_s: float) -> None:
    with RolloutPublisher(kafka) as pub:
        pub.run_started(SIM.run_id, SIM.run_config(), event_id="run")
        pub.flush()
        for n, group in enumerate(open_loop_groups(SIM)):
            for body in group.events:
                pub.send_raw(pub.topics.events, event_group_key(SIM.run_id, body["group_index"]),
                             orjson.dumps(body))
            if n % 5 == 0:  # hostile input: dead letters next to the groups
                pub.send_raw(pub.topics.events, event_group_key(SIM.run_id, 0), b"{not json")
            pub.flush()
            time.sleep(pause_s)


def _instance(kafka: KafkaSettings, lake: str, env: dict[str, str], until_idle: float | None,
              log: Path) -> subprocess.Popen:
    """A processor instance whose stderr goes to `log` (a pipe nobody reads could fill and
    block it)."""
    cmd = [sys.executable, "-m", "ingest.cli", "process", "--bootstrap-servers",
           kafka.bootstrap_servers, "--lake", lake, "--topic-prefix", kafka.topic_prefix,
           "--event-partitions", "1", "--consumer-group", f"{kafka.topic_prefix}s3-pair"]
    if until_idle is not None:
        cmd += ["--until-idle", str(until_idle)]
    with log.open("ab") as stderr:
        return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                stderr=stderr)


def _tails(*logs: Path) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)


def _table(lake: Lake, name: str, columns: list[str]) -> list[tuple]:
    return run_rows(lake, name, columns, SIM.run_id)


@pytest.mark.slow
def test_two_instances_on_an_s3_lake_write_exactly_once(broker, s3_env, tmp_path):
    reference_kafka = ordered_kafka(broker.bootstrap_servers, "s3ref.")
    _publish(reference_kafka, 0.0)
    reference_root = str(tmp_path / "reference")
    run_processor(reference_kafka, reference_root, idle_s=2.0)

    kafka = ordered_kafka(broker.bootstrap_servers, "s3pair.")
    lake_root = f"s3://{BUCKET}/pair"
    streaming = threading.Thread(target=_publish, args=(kafka, 0.05))
    streaming.start()
    logs = [tmp_path / f"{name}.log" for name in ("first", "second", "first-again", "last")]
    first = _instance(kafka, lake_root, s3_env, None, logs[0])
    second = _instance(kafka, lake_root, s3_env, None, logs[1])
    time.sleep(8)
    # One instance dies mid-run; the other takes its partitions, then it comes back in
    # the same consumer group.
    assert first.poll() is None, _tails(logs[0])
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    time.sleep(4)
    first = _instance(kafka, lake_root, s3_env, 8.0, logs[2])
    streaming.join()
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=120) == 0, _tails(logs[1])
    assert first.wait(timeout=240) == 0, _tails(logs[2])
    # A last pass in the same group picks up whatever the pair left when it stopped.
    last = _instance(kafka, lake_root, s3_env, 4.0, logs[3])
    assert last.wait(timeout=240) == 0, _tails(logs[3])
    assert "Traceback" not in logs[3].read_text()

    reference, got = Lake(reference_root), _lake(s3_env, "pair")
    assert_keys_once(got)
    steps = ["step", "n_groups", "n_samples", "content_sha256"]
    assert len(_table(reference, "steps", steps)) == SIM.steps
    assert _table(got, "steps", steps) == _table(reference, "steps", steps), (
        "dead letters: " + repr(sorted(set(got.read("dead_letters").column("error").to_pylist())))
        + "\n" + _tails(*logs))
    decisions = ["group_index", "decision", "reason", "batch_step"]
    assert _table(got, "groups", decisions) == _table(reference, "groups", decisions)
    assert _table(got, "events", ["event_id"]) == _table(reference, "events", ["event_id"])
    dead = got.read("dead_letters").num_rows
    assert dead == reference.read("dead_letters").num_rows > 0


def test_gateway_datasets_use_the_lake_options_on_s3(s3_env, tmp_path, monkeypatch):
    """The dataset store reaches S3 through the same options as `Lake` (the AWS_*
    environment), so datasets live next to the tables, versioned."""
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    store = DatasetStore(f"s3://{BUCKET}/gateway-lake", tmp_path, tokenizers={},
                         line_limit=1 << 20)
    assert store.storage_options["AWS_CONDITIONAL_PUT"] == "etag"
    upload = tmp_path / "prompts.jsonl"
    for version, prompts in enumerate((["a", "b"], ["c", "d", "e"])):
        upload.write_text("".join(orjson.dumps({"input": p}).decode() + "\n" for p in prompts))
        report = store.ingest("math", upload, "jsonl", DatasetOptions())
        assert (report.version, report.rows_kept) == (version, len(prompts))
    assert store.table("math", 0).to_pyarrow_dataset().count_rows() == 2
    assert store.table("math").to_pyarrow_dataset().count_rows() == 3
