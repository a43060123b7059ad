"""Event time: timeouts after downtime, and decisions independent of consumption order."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import write_deltalake

from ingest.commands.simulate import SimulationConfig
from ingest.io.kafka import key_partition
from ingest.io.lake import Lake
from ingest.processor.batch_stage import BatchStage
from ingest.processor.config import ProcessorConfig
from ingest.processor.group_stage import GroupStage
from ingest.processor.main import Processor
from schemas.events import event_group_key
from schemas.tables import EVENTS
from tests.integration.pipeline import (
    by_group,
    event,
    ordered_kafka,
    publish,
    publish_open_loop,
    run_processor,
    sample,
)
from tests.support.suite_kafka import suite_kafka

# Longer than the first run below takes on a starved machine: a clean-clone run's first
# run outlasted 15 s (the process unscheduled for seconds at a time) and, still running,
# rightly timed the group out.
TIMEOUT_S = 30.0


def test_downtime_longer_than_the_timeout_does_not_time_out_a_group_completed_meanwhile(
        kafka, lake_root):
    run = "downtime"
    t0 = time.time()
    publish(kafka, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1,
                         "group_timeout_s": TIMEOUT_S}, [
        event("group_started", run, group_index=0, step=0, n_samples=2, ts=t0),
        sample(run, 0, 0, 1.0, ts=t0),
    ])
    run_processor(kafka, lake_root, idle_s=1.0)
    assert time.time() < t0 + TIMEOUT_S, "the first run outlasted the timeout it is to test"
    assert by_group(lake_root, run) == {}, "decided before its last event"
    # The last event comes 3 s (event time) after the first, while the processor is down
    # for longer than the timeout.
    publish(kafka, run, None, [sample(run, 0, 1, 0.0, ts=t0 + 3)])
    time.sleep(max(0.0, t0 + TIMEOUT_S + 2 - time.time()))
    run_processor(kafka, lake_root, idle_s=1.0)
    group = by_group(lake_root, run)[0]
    assert (group["decision"], group["reason"]) == ("kept", None)


SIM = SimulationConfig(run_id="order", steps=4, rollout_batch_size=3, n_samples=4,
                       response_len_mean=24, prompt_len=8, compaction_rate=0.1,
                       duplicate_rate=0.05, abort_rate=0.05, seed=23, mode="open",
                       surplus_per_step=3)


def _steps(lake_root: str) -> dict[int, str]:
    table = Lake(lake_root).read("steps", filter=pc.field("run_id") == SIM.run_id)
    return dict(zip(table.column("step").to_pylist(), table.column("content_sha256").to_pylist(),
                    strict=True))


def _decisions(lake_root: str) -> list[tuple]:
    table = Lake(lake_root).read("groups", filter=pc.field("run_id") == SIM.run_id)
    return sorted(zip(*(table.column(c).to_pylist()
                        for c in ("group_index", "decision", "reason", "batch_step")), strict=True))


def test_four_partitions_live_and_from_backlog_give_the_same_steps_and_replay_agrees(
        broker, tmp_path):
    kafka = suite_kafka(broker.bootstrap_servers,
                        topic_prefix=f"o{uuid.uuid4().hex[:8]}.", event_partitions=4,
                        decision_partitions=2)
    kafka.ensure_topics()
    live, backlog = str(tmp_path / "live"), str(tmp_path / "backlog")
    # Live: the events stream in while the processor runs, few records per poll.
    streaming = threading.Thread(target=publish_open_loop, args=(kafka, SIM),
                                 kwargs={"pause_s": 0.03})
    streaming.start()
    processor = threading.Thread(target=run_processor, args=(kafka, live),
                                 kwargs={"idle_s": 4.0, "max_poll_records": 3, "compact_every": 2,
                                         "consumer_group": f"{kafka.topic_prefix}order-live"})
    processor.start()
    streaming.join()
    processor.join()
    # The same events again, all there at once, consumed in large polls.
    run_processor(kafka, backlog, idle_s=4.0, consumer_group=f"{kafka.topic_prefix}order-backlog")

    # The live run's stages compacted the tables they append to every poll as they went
    # (every 2 commits): far fewer files than commits, and the replays below still agree.
    compacted = Lake(live)
    for table in ("events", "groups"):
        assert compacted.active_files(table) < compacted.version(table) / 2, table
    steps = _steps(live)
    assert sorted(steps) == list(range(SIM.steps))
    assert _steps(backlog) == steps
    assert _decisions(backlog) == _decisions(live)
    assert any(d[1] == "surplus" for d in _decisions(live))
    for lake in (live, backlog):
        result = subprocess.run(
            [sys.executable, "-m", "ingest.cli", "replay", "--lake", lake, "--run", SIM.run_id,
             "--into", str(tmp_path / f"replayed-{os.path.basename(lake)}"), "--check"],
            capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_groups_complete_before_their_run_started_take_their_completion_order(kafka, lake_root,
                                                                             tmp_path):
    run = "late-run"
    processor = Processor(ProcessorConfig(kafka=kafka, lake=lake_root, until_idle_s=4.0))
    running = threading.Thread(target=processor.run)
    running.start()
    deadline = time.monotonic() + 60
    while not all(stage.joined for stage in processor.stages):
        assert time.monotonic() < deadline, "the processor did not join"
        time.sleep(0.1)
    # Group 0 starts first but completes last; group 1 completes first. Both are kept for
    # step 0, which takes one group: the first to complete fills it, the other is surplus.
    publish(kafka, run, None, [
        event("group_started", run, group_index=0, step=0, n_samples=2),
        event("group_started", run, group_index=1, step=0, n_samples=2),
        sample(run, 0, 0, 1.0), sample(run, 1, 0, 1.0), sample(run, 1, 1, 0.0),
    ])
    time.sleep(0.5)
    publish(kafka, run, None, [sample(run, 0, 1, 0.0)])
    time.sleep(2.0)  # both complete, waiting for their run's config
    publish(kafka, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1}, [])
    running.join(timeout=120)
    assert not running.is_alive()
    decided = by_group(lake_root, run)
    assert {g: (d["decision"], d["batch_step"]) for g, d in decided.items()} == {
        0: ("surplus", None), 1: ("kept", 0)}
    result = subprocess.run(
        [sys.executable, "-m", "ingest.cli", "replay", "--lake", lake_root, "--run", run,
         "--into", str(tmp_path / "replayed"), "--check"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_a_lake_from_before_event_time_gets_the_column_and_keeps_its_rows(tmp_path):
    root = tmp_path / "old-lake"
    older = pa.schema([f for f in EVENTS.schema if f.name != "event_time"])
    row = {"run_id": "r", "event_id": "e0", "type": "group_started", "group_index": 0,
           "rollout_id": None, "topic": "rollout.events", "partition": 0, "offset": 0,
           "ingested_at": datetime.now(UTC), "payload": "{}", "step": 0}
    write_deltalake(str(root / "events"), pa.Table.from_pylist([row], schema=older),
                    partition_by=list(EVENTS.partition_by) or None)
    lake = Lake(str(root))
    lake.append("events", pa.Table.from_pylist(
        [{**row, "event_id": "e1", "offset": 1, "event_time": datetime.now(UTC)}],
        schema=EVENTS.schema))
    archived = sorted(lake.read("events").to_pylist(), key=lambda r: r["offset"])
    assert [(r["event_id"], r["event_time"] is None) for r in archived] == [
        ("e0", True), ("e1", False)]


def test_a_record_that_reached_the_broker_keeps_its_time_while_other_partitions_are_read(
        broker, tmp_path):
    """A partition is idle only when the broker has nothing more for it. The high watermark
    of its last fetch can be seconds old (Apache Kafka answers with every partition's
    records, and kafka-python fetches a partition again once they are consumed): taking it
    for idle would give a record already in the broker a later time than its own."""
    kafka = suite_kafka(broker.bootstrap_servers,
                        topic_prefix=f"i{uuid.uuid4().hex[:8]}.", event_partitions=2,
                        decision_partitions=1)
    kafka.ensure_topics()
    run, lake_root = "idle", str(tmp_path / "lake")
    on = {p: [g for g in range(400) if key_partition(event_group_key(run, g), 2) == p]
          for p in (0, 1)}
    publish(kafka, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1}, [])

    def started(producer, group_index: int):
        return producer.send(kafka.topics.events, key=event_group_key(run, group_index),
                      value=orjson.dumps(event("group_started", run, group_index=group_index,
                                               step=0, n_samples=2)))

    producer = kafka.producer()
    for group_index in on[0][:60] + on[1][:60]:
        started(producer, group_index)
    producer.flush()
    # One record per poll, each committed: a partition's records take seconds to read.
    stage = GroupStage(ProcessorConfig(kafka=kafka, lake=lake_root, max_poll_records=1,
                                       consumer_group=f"{kafka.topic_prefix}idle-check"),
                       Lake(lake_root))
    try:
        deadline = time.monotonic() + 120
        while 59 not in stage.recorded.values() and time.monotonic() < deadline:
            stage.poll_once()
        [drained] = [p for p, offset in stage.recorded.items() if offset == 59]
        assert (stage.recorded.get(1 - drained) or 0) < 40, "the other partition read too fast"
        sent = started(producer, on[drained][60]).get(timeout=30)
        while stage.recorded.get(drained) != 60 and time.monotonic() < deadline:
            stage.poll_once()
    finally:
        stage.close()
        producer.close()
    [late] = Lake(lake_root).read(
        "events", filter=(pc.field("group_index") == on[drained][60]) & (pc.field("run_id") == run)
    ).to_pylist()
    assert late["event_time"] == datetime.fromtimestamp(sent.timestamp / 1000, UTC)


def test_a_decision_is_applied_with_the_watermark_sent_after_it_not_a_later_event(
        broker, tmp_path):
    """The watermark sent with a decision is at the decision's own event time: it releases
    the decision, so the `groups` row does not wait for the partition's next event or its
    idle advance (a group interval or `watermark_lag_s` on every decision)."""
    run, lake_root = "released", str(tmp_path / "lake")
    kafka = ordered_kafka(broker.bootstrap_servers, f"rel{uuid.uuid4().hex[:8]}.")
    events = [event("group_started", run, group_index=0, step=0, n_samples=2),
              sample(run, 0, 0, 1.0), sample(run, 0, 1, 0.0)]
    publish(kafka, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1}, events)
    # The group stage stops once it archived the last event and published its decision:
    # no later event and no idle advance can release it.
    stage = GroupStage(ProcessorConfig(kafka=kafka, lake=lake_root,
                                       consumer_group=f"{kafka.topic_prefix}groups"),
                       Lake(lake_root))
    archived, deadline = None, time.monotonic() + 60
    try:
        while archived != len(events) - 1 and time.monotonic() < deadline:
            stage.poll_once()
            archived = stage.recorded.get(0)
    finally:
        stage.close()
    assert archived == len(events) - 1
    batches = BatchStage(ProcessorConfig(kafka=kafka, lake=lake_root,
                                         consumer_group=f"{kafka.topic_prefix}batches"),
                         Lake(lake_root))
    group, deadline = None, time.monotonic() + 30
    try:
        while group is None and time.monotonic() < deadline:
            batches.poll_once()
            group = by_group(lake_root, run).get(0)
    finally:
        batches.close()
    assert group is not None, "the decision is still held"
    assert (group["decision"], group["batch_step"]) == ("kept", 0)
