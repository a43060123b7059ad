"""Exactly once across kill -9: tables after repeated crashes equal an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pyarrow.compute as pc
import pytest

from ingest.kafka_io import KafkaSettings
from ingest.lake import Lake
from ingest.publisher import RolloutPublisher
from ingest.simulate import SimulationConfig, open_loop_groups
from schemas.events import event_group_key
from schemas.tables import TABLES
from tests.integration.pipeline import ordered_kafka, run_processor

SIM = SimulationConfig(
    run_id="crashy", steps=20, rollout_batch_size=4, n_samples=4, response_len_mean=48,
    prompt_len=16, compaction_rate=0.15, duplicate_rate=0.05, abort_rate=0.03,
    missing_reward_rate=0.03, seed=11, mode="open", surplus_per_step=1,
)
KILLS = 6


def _publish(kafka: KafkaSettings, pause_s: float = 0.0) -> None:
    import orjson

    with RolloutPublisher(kafka) as pub:
        pub.run_started(SIM.run_id, SIM.run_config(), event_id="run")
        pub.flush()
        for group in open_loop_groups(SIM):
            for body in group.events:
                pub.send_raw(pub.topics.events, event_group_key(SIM.run_id, body["group_index"]),
                             orjson.dumps(body))
            if pause_s:
                pub.flush()
                time.sleep(pause_s)


def _spawn(kafka: KafkaSettings, lake: str, attempt: int, until_idle: float | None = None):
    cmd = [sys.executable, "-m", "ingest.cli", "process", "--bootstrap-servers",
           kafka.bootstrap_servers, "--lake", lake, "--topic-prefix", kafka.topic_prefix,
           "--event-partitions", "1",
           # Offsets come from Delta, not the consumer group, so a fresh group per restart
           # is equivalent and spares the wait for the killed member's session to expire.
           "--consumer-group", f"crash-{attempt}"]
    if until_idle is not None:
        cmd += ["--until-idle", str(until_idle)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _table(lake: Lake, name: str, columns: list[str]) -> list[tuple]:
    table = lake.read(name, columns=columns, filter=pc.field("run_id") == SIM.run_id)
    return sorted(zip(*(table.column(c).to_pylist() for c in columns), strict=True))


@pytest.mark.slow
def test_kill_9_at_random_moments_changes_nothing(broker, tmp_path):
    reference_lake = str(tmp_path / "reference")
    reference = ordered_kafka(broker.bootstrap_servers, "ref.")
    _publish(reference)
    run_processor(reference, reference_lake, idle_s=2.0)

    crashed_lake = str(tmp_path / "crashed")
    crashed = ordered_kafka(broker.bootstrap_servers, "crash.")
    streaming = threading.Thread(target=_publish, args=(crashed, 0.08))
    streaming.start()
    rng = random.Random(5)
    for attempt in range(KILLS):
        process = _spawn(crashed, crashed_lake, attempt)
        time.sleep(rng.uniform(2.0, 6.0))
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    streaming.join()
    final = _spawn(crashed, crashed_lake, KILLS, until_idle=3.0)
    assert final.wait(timeout=240) == 0, final.stderr.read().decode()[-2000:]

    ref, got = Lake(reference_lake), Lake(crashed_lake)
    for spec in TABLES.values():
        if not got.exists(spec.name):
            continue
        keys = got.read(spec.name, columns=list(spec.key))
        rows = list(zip(*(keys.column(c).to_pylist() for c in spec.key), strict=True))
        assert len(rows) == len(set(rows)), f"{spec.name} holds a key twice"
    steps = ["step", "n_groups", "n_samples", "content_sha256"]
    assert len(_table(ref, "steps", steps)) == SIM.steps
    assert _table(got, "steps", steps) == _table(ref, "steps", steps)
    decisions = ["group_index", "decision", "reason", "batch_step"]
    assert _table(got, "groups", decisions) == _table(ref, "groups", decisions)
    fragments = ["group_index", "rollout_id", "fragment_index", "decision"]
    assert _table(got, "samples", fragments) == _table(ref, "samples", fragments)
    assert _table(got, "events", ["event_id"]) == _table(ref, "events", ["event_id"])
    metric_keys = ["step", "key"]
    assert _table(got, "step_metrics", metric_keys) == _table(ref, "step_metrics", metric_keys)
