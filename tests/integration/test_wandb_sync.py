"""`rolloutlake wandb-sync` against a real lake and real W&B offline run files."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io.lake import Lake
from ingest.processor.wandb_sink import follow_all_runs, last_synced_step, sync_run
from tests.integration.pipeline import ordered_kafka, run_processor
from tests.support.metric_fixtures import step_metric_keys, write_steps

pytestmark = pytest.mark.one_broker(
    "the sync reads the lake; the broker only builds it")

RUN = "dapo-wb"
BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, version
RECORD = struct.Struct("<IHB")  # crc32c, length, type (leveldb log format)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Records of a `.wandb` file (W&B's leveldb-log framing of protobuf `Record`s)."""
    data = path.read_bytes()
    ident, magic, _ = HEADER.unpack_from(data)
    assert (ident, magic) == (b":W&B", 0xBEE1)
    records, pos, pending = [], HEADER.size, b""
    while pos + RECORD.size <= len(data):
        if BLOCK - pos % BLOCK < RECORD.size:  # block trailer too small for a header
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = RECORD.unpack_from(data, pos)
        pos += RECORD.size
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            continue
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def logged_steps(wandb_dir: Path, timeout: float = 20.0) -> list[dict]:
    """Every history row in every offline run under `wandb_dir`, with its step.

    W&B's service writes run files asynchronously, also after `finish()` returned: wait
    until each file ends with its `exit` record.
    """
    deadline = time.monotonic() + timeout
    while True:
        files = [read_wandb_records(p)
                 for p in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))]
        if all(r and r[-1].WhichOneof("record_type") == "exit" for r in files):
            break
        assert time.monotonic() < deadline, "W&B did not finish writing its run files"
        time.sleep(0.1)
    rows = []
    for records in files:
        for record in records:
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                rows.append(items)
    return rows


def synced(rows: list[dict]) -> Counter:
    return Counter(int(r["_step"]) for r in rows)


def test_every_step_once_with_miles_keys_and_resume_does_not_duplicate(lake_root, tmp_path):
    lake = Lake(lake_root)
    write_steps(lake, RUN, range(0, 5))
    assert sync_run(lake, RUN, wandb_dir=tmp_path) == 5
    assert last_synced_step(lake, project="rolloutlake", wandb_id=RUN) == 4

    # A restart with new steps sealed meanwhile logs only those.
    write_steps(lake, RUN, range(5, 8))
    assert sync_run(lake, RUN, wandb_dir=tmp_path) == 3
    assert sync_run(lake, RUN, wandb_dir=tmp_path) == 0

    rows = logged_steps(tmp_path)
    assert synced(rows) == Counter(range(8))  # every step exactly once, across 3 runs
    for row in rows:
        step = int(row["_step"])
        metric_keys = {k for k in row if not k.startswith("_")}
        assert metric_keys == step_metric_keys(RUN, step)
        assert "rollout/raw_reward_unfiltered" in metric_keys


def test_follow_logs_steps_as_they_seal_until_stopped(lake_root, tmp_path):
    lake = Lake(lake_root)
    write_steps(lake, RUN, range(0, 2))
    stop = threading.Event()
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(
        sync_run(lake, RUN, wandb_dir=tmp_path, follow=True, poll_s=0.1, stop=stop)))
    worker.start()
    for step in range(2, 5):
        write_steps(Lake(lake_root), RUN, range(step, step + 1))
        time.sleep(0.3)
    deadline = time.monotonic() + 30
    while last_synced_step(Lake(lake_root), project="rolloutlake", wandb_id=RUN) != 4:
        assert time.monotonic() < deadline, "follow did not reach step 4"
        time.sleep(0.1)
    stop.set()
    worker.join(60)
    assert result == [5]
    assert synced(logged_steps(tmp_path)) == Counter(range(5))


def test_cli_is_offline_by_default_and_rejects_a_wrong_lake(lake_root, tmp_path):
    write_steps(Lake(lake_root), RUN, range(0, 3))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "ingest.cli", "wandb-sync", "--lake", lake_root, "--run", RUN,
           "--wandb-dir", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "logged 3 steps" in done.stdout
    assert synced(logged_steps(tmp_path)) == Counter(range(3))

    bad = subprocess.run([*cmd[:4], "--lake", str(tmp_path / "nowhere"), "--run", RUN],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "no steps table" in bad.stderr


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default must be offline


def test_a_run_that_appears_as_the_processor_stops_is_still_synced(lake_root, tmp_path):
    """A processor that stops within one poll of learning a run (fast on Apache Kafka)."""
    write_steps(Lake(lake_root), RUN, range(0, 2))
    stop = threading.Event()
    looks: list[int] = []

    def run_ids() -> list[str]:
        looks.append(1)
        if len(looks) == 1:
            stop.set()  # the run becomes known only after the processor was told to stop
            return []
        return [RUN]

    follow_all_runs(Lake(lake_root), run_ids, stop, wandb_dir=tmp_path, poll_s=30.0)
    assert synced(logged_steps(tmp_path)) == Counter(range(2))


def test_processor_option_logs_every_sealed_step(broker, tmp_path):
    kafka = ordered_kafka(broker.bootstrap_servers, "wb.")
    sim = SimulationConfig(run_id="wb-run", steps=3, rollout_batch_size=2, n_samples=4,
                           response_len_mean=16, prompt_len=4, mode="open", seed=1)
    run_simulation(kafka, sim)
    run_processor(kafka, str(tmp_path / "lake"), wandb=True, wandb_dir=str(tmp_path))
    counts = synced(logged_steps(tmp_path))
    assert sorted(counts) == [0, 1, 2] and set(counts.values()) == {1}
