"""Two processor instances in one consumer group: one dies, the other takes over, exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ingest.commands.simulate import SimulationConfig
from ingest.io.kafka import KafkaSettings
from ingest.io.lake import Lake
from tests.integration.pipeline import (
    assert_keys_once,
    ordered_kafka,
    publish_open_loop,
    run_processor,
    run_rows,
)
from tests.support.suite_kafka import suite_kafka

# Exactly `rollout_batch_size` kept groups per step (no surplus) and no aborts: which
# groups form a step then does not depend on the order in which two instances decide them.
SIM = SimulationConfig(
    run_id="scale", steps=10, rollout_batch_size=3, n_samples=4, response_len_mean=24,
    prompt_len=8, compaction_rate=0.1, duplicate_rate=0.05, abort_rate=0.0,
    missing_reward_rate=0.0, seed=21, mode="open", surplus_per_step=0,
)


def _command(kafka: KafkaSettings, lake: str, status: Path) -> list[str]:
    return [sys.executable, "-m", "ingest.cli", "process", "--bootstrap-servers",
            kafka.bootstrap_servers, "--lake", lake, "--topic-prefix", kafka.topic_prefix,
            "--consumer-group", f"{kafka.topic_prefix}scale", "--status-dir", str(status),
            "--snapshot-every", "20"]


def _instance(kafka: KafkaSettings, lake: str, status: Path) -> subprocess.Popen:
    return subprocess.Popen(_command(kafka, lake, status), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _partitions(status: Path, stage: str) -> list[int]:
    path = status / f"{stage}.json"
    return (json.loads(path.read_text())["partitions"] or []) if path.exists() else []


def _wait(condition, what: str, timeout_s: float, *processes: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for process in processes:
            assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _table(lake: Lake, name: str, columns: list[str]) -> list[tuple]:
    return run_rows(lake, name, columns, SIM.run_id)


@pytest.mark.slow
def test_the_survivor_takes_over_a_killed_instance_exactly_once(broker, tmp_path):
    reference_lake = str(tmp_path / "reference")
    reference = ordered_kafka(broker.bootstrap_servers, f"sref{os.getpid()}.")
    publish_open_loop(reference, SIM, pause_s=0.0)
    run_processor(reference, reference_lake, idle_s=2.0)
    ref = Lake(reference_lake)
    steps = ["step", "n_groups", "n_samples", "content_sha256"]
    assert len(_table(ref, "steps", steps)) == SIM.steps

    kafka = suite_kafka(broker.bootstrap_servers,
                        topic_prefix=f"scale{os.getpid()}.", event_partitions=4,
                        decision_partitions=2)
    kafka.ensure_topics()
    lake_root = str(tmp_path / "lake")
    status_a, status_b = tmp_path / "a", tmp_path / "b"
    a = _instance(kafka, lake_root, status_a)
    b = _instance(kafka, lake_root, status_b)
    try:
        # Each instance rewrites its status file after its own rebalance callback, so for a
        # moment the first one may still list every partition: wait for a disjoint split.
        _wait(lambda: _partitions(status_a, "groups") and _partitions(status_b, "groups")
              and sorted(_partitions(status_a, "groups") + _partitions(status_b, "groups"))
              == [0, 1, 2, 3], "both instances to own disjoint events partitions", 90, a, b)
        streaming = threading.Thread(target=publish_open_loop, args=(kafka, SIM),
                                 kwargs={"pause_s": 0.1})
        streaming.start()
        lake = Lake(lake_root)
        _wait(lambda: len(_table(lake, "steps", ["step"])) >= 2, "two sealed steps", 120, a, b)
        os.kill(a.pid, signal.SIGKILL)  # its batch-stage child dies with it
        a.wait()
        _wait(lambda: _partitions(status_b, "groups") == [0, 1, 2, 3]
              and _partitions(status_b, "batches") == [0, 1],
              "the survivor to own every partition", 90, b)
        streaming.join()
        _wait(lambda: len(_table(lake, "steps", ["step"])) == SIM.steps, "every step", 180, b)
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=90) == 0, b.stderr.read()[-3000:]
    finally:
        for process in (a, b):
            if process.poll() is None:
                process.kill()
                process.wait()

    got = Lake(lake_root)
    assert_keys_once(got)
    assert _table(got, "steps", steps) == _table(ref, "steps", steps)
    decisions = ["group_index", "decision", "reason", "batch_step"]
    assert _table(got, "groups", decisions) == _table(ref, "groups", decisions)
    fragments = ["group_index", "rollout_id", "fragment_index", "decision"]
    assert _table(got, "samples", fragments) == _table(ref, "samples", fragments)
    assert _table(got, "events", ["event_id"]) == _table(ref, "events", ["event_id"])


def test_an_instance_left_without_partitions_still_finishes_when_idle(broker, tmp_path):
    """More instances than partitions: one of the two joins with nothing assigned (which
    one is up to the group's assignor) and says so; `--until-idle` still ends the later
    one, instead of a member without partitions waiting to join forever."""
    kafka = ordered_kafka(broker.bootstrap_servers, f"spare{os.getpid()}.")
    lake_root = str(tmp_path / "lake")
    busy = _instance(kafka, lake_root, tmp_path / "busy")
    try:
        _wait(lambda: _partitions(tmp_path / "busy", "groups") == [0]
              and _partitions(tmp_path / "busy", "batches") == [0], "the first instance", 90, busy)
        spare = subprocess.run([*_command(kafka, lake_root, tmp_path / "spare"), "--until-idle",
                                "2"], capture_output=True, text=True, timeout=120)
    finally:
        busy.kill()
        busy.wait()
    assert spare.returncode == 0, spare.stderr[-3000:]
    assert (f"groups stage: joined consumer group {kafka.topic_prefix}scale-groups, partitions"
            in spare.stderr)
    assert json.loads((tmp_path / "spare" / "groups.json").read_text())["state"] == "stopped"
