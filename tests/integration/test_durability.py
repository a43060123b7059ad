"""State that must outlive Kafka retention: run configs and the batch stage's progress."""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from ingest.commands.simulate import SimulationConfig, open_loop_groups
from ingest.io.kafka import KafkaSettings, read_topics
from ingest.io.lake import Lake, TxnMark
from ingest.processor.batch_stage import BatchStage
from ingest.processor.config import ProcessorConfig
from ingest.processor.decisions import decision_header
from ingest.processor.group_stage import GroupStage
from ingest.processor.main import Processor
from ingest.processor.offsets import app_id
from ingest.processor.run_configs import RunConfigs
from ingest.sdk.publisher import RolloutPublisher
from schemas.errors import RolloutlakeError
from schemas.events import event_group_key
from schemas.tables import BATCH_STATE
from tests.integration.pipeline import (
    event,
    ordered_kafka,
    poll_in_thread,
    poll_until_idle,
    publish,
    publish_open_loop,
    rows,
    run_processor,
    run_rows,
    sample,
)
from tests.support.suite_kafka import suite_kafka

SIM = SimulationConfig(
    run_id="snap", steps=8, rollout_batch_size=3, n_samples=2, response_len_mean=8,
    prompt_len=4, compaction_rate=0.1, duplicate_rate=0.05, abort_rate=0.05,
    missing_reward_rate=0.05, seed=3, mode="open", surplus_per_step=1,
)


# Many polls, so snapshots fall due while the stream is read, not only at the stop.
SMALL_POLLS = {"snapshot_every": 7, "max_poll_records": 10}


def _publish_groups(kafka: KafkaSettings, groups: list, *, with_run: bool) -> None:
    with RolloutPublisher(kafka) as pub:
        if with_run:
            pub.run_started(SIM.run_id, SIM.run_config(), event_id="run")
            pub.flush()
        for group in groups:
            for body in group.events:
                pub.send_raw(pub.topics.events, event_group_key(SIM.run_id, body["group_index"]),
                             orjson.dumps(body))


def _table(lake: Lake, name: str, columns: list[str]) -> list[tuple]:
    return run_rows(lake, name, columns, SIM.run_id)


def _batch_stage(processor) -> BatchStage:
    [stage] = [s for s in processor.stages if isinstance(s, BatchStage)]
    return stage


def test_a_restarted_batch_stage_resumes_from_its_snapshot(broker, tmp_path):
    groups = list(open_loop_groups(SIM))
    reference_lake = str(tmp_path / "reference")
    reference = ordered_kafka(broker.bootstrap_servers, f"ref{id(groups)}.")
    _publish_groups(reference, groups, with_run=True)
    run_processor(reference, reference_lake, idle_s=1.5)

    lake_root = str(tmp_path / "lake")
    kafka = ordered_kafka(broker.bootstrap_servers, f"snap{id(groups)}.")
    half = len(groups) // 2
    _publish_groups(kafka, groups[:half], with_run=True)
    run_processor(kafka, lake_root, idle_s=1.5, **SMALL_POLLS)
    lake = Lake(lake_root)
    snapshots = lake.read("batch_state").to_pylist()
    assert len(snapshots) >= 2  # due ones while running, and one at the stop
    last = max(s["offset"] for s in snapshots)
    # Before the run's first item is released (held for the watermarks) it has no batcher.
    assert all(s["runs"] in ([], [SIM.run_id]) for s in snapshots)
    assert [s["runs"] for s in snapshots if s["offset"] == last] == [[SIM.run_id]]

    _publish_groups(kafka, groups[half:], with_run=False)
    second = run_processor(kafka, lake_root, idle_s=1.5, **SMALL_POLLS)
    # It read only the decisions after the snapshot ...
    assert _batch_stage(second).resumed_from == {0: last + 1}
    # ... and the tables are those of an uninterrupted run.
    ref = Lake(reference_lake)
    steps = ["step", "n_groups", "n_samples", "content_sha256"]
    assert len(_table(ref, "steps", steps)) == SIM.steps
    assert _table(lake, "steps", steps) == _table(ref, "steps", steps)
    decisions = ["group_index", "decision", "reason", "batch_step"]
    assert _table(lake, "groups", decisions) == _table(ref, "groups", decisions)
    fragments = ["group_index", "rollout_id", "fragment_index", "decision"]
    assert _table(lake, "samples", fragments) == _table(ref, "samples", fragments)
    assert _table(lake, "step_metrics", ["step", "key"]) == _table(ref, "step_metrics",
                                                                   ["step", "key"])


def test_a_snapshot_from_another_topic_is_refused(broker, tmp_path):
    """The decisions topic recreated with as many messages as before: the message at the
    snapshot's offset is another one, so the batch stage refuses instead of resuming."""
    groups = list(open_loop_groups(SIM))[:6]
    lake_root = str(tmp_path / "lake")
    kafka = ordered_kafka(broker.bootstrap_servers, f"fp{id(groups)}.")
    _publish_groups(kafka, groups, with_run=True)
    run_processor(kafka, lake_root, idle_s=1.5, stages="all")
    [snapshot] = [s for s in Lake(lake_root).read("batch_state").to_pylist()]

    # Same topic names on the same broker are impossible to recreate here, so the
    # decisions of another run land at the same offsets of a fresh topic under the old
    # topic's name: a lake and topics that do not belong together.
    other = ordered_kafka(broker.bootstrap_servers, f"fp-other{id(groups)}.")
    with RolloutPublisher(other) as pub:
        for offset in range(snapshot["offset"] + 3):
            pub.send_raw(other.topics.decisions, b"x", f"not {offset}".encode())
    moved = suite_kafka(broker.bootstrap_servers,
                        topic_prefix=other.topic_prefix, event_partitions=1,
                        decision_partitions=1)
    renamed_lake = str(tmp_path / "renamed")
    _copy_lake_for_topic(lake_root, renamed_lake, kafka.topics.decisions, other.topics.decisions)
    with pytest.raises(RolloutlakeError, match=r"the topic was recreated \(its message at "
                       rf"offset {snapshot['offset']} is not the one the lake stored"):
        run_processor(moved, renamed_lake, idle_s=1.0, stages="batches")


def _copy_lake_for_topic(source: str, target: str, old_topic: str, new_topic: str) -> None:
    """The batch_state table of `source` as if it had been written for `new_topic`."""
    table = Lake(source).read("batch_state")
    table = table.set_column(table.schema.get_field_index("topic"), "topic",
                             pa.array([new_topic] * table.num_rows))
    Lake(target).append("batch_state", table.cast(BATCH_STATE.schema))
    assert old_topic != new_topic


def test_run_configs_outlive_the_runs_topic(broker, tmp_path):
    """After retention (here: fresh topics) the run's config still comes from the lake."""
    lake_root = str(tmp_path / "lake")
    config = {"n_samples_per_prompt": 2, "rollout_batch_size": 1}
    first = ordered_kafka(broker.bootstrap_servers, f"cfg-a{id(lake_root)}.")
    publish(first, "r", config, [
        event("group_started", "r", group_index=0, step=0, n_samples=2),
        sample("r", 0, 0, 1.0), sample("r", 0, 1, 0.0)])
    run_processor(first, lake_root, idle_s=1.0)
    [saved] = rows(lake_root, "runs", "r")
    assert orjson.loads(saved["config"]) == config

    later = ordered_kafka(broker.bootstrap_servers, f"cfg-b{id(lake_root)}.")
    registry = RunConfigs(later, lake=Lake(lake_root))
    assert registry.get("r").rollout_batch_size == 1
    registry.close()
    publish(later, "r", None, [
        event("group_started", "r", group_index=1, step=1, n_samples=2),
        sample("r", 1, 0, 1.0), sample("r", 1, 1, 0.0)])
    run_processor(later, lake_root, idle_s=1.0)
    decided = {r["group_index"]: r["decision"] for r in rows(lake_root, "groups", "r")}
    assert decided == {0: "kept", 1: "kept"}
    assert [r["error"] for r in rows(lake_root, "dead_letters")] == []


def test_a_batch_stage_behind_on_the_runs_topic_takes_a_decisions_config_from_the_lake(
        broker, tmp_path):
    """A batch stage whose reader of the runs topic lacks a run's config (a stalled fetch,
    a slow broker; here: the config was published on another deployment's runs topic and
    reached this lake after the stage started) gets a decision of that run: its group stage
    saved the config to the lake before deciding, so the decision is applied, not
    dead-lettered as one without run_started."""
    lake_root = str(tmp_path / "lake")
    config = {"n_samples_per_prompt": 2, "rollout_batch_size": 1}
    elsewhere = ordered_kafka(broker.bootstrap_servers, f"cfg-c{uuid.uuid4().hex[:8]}.")
    here = ordered_kafka(broker.bootstrap_servers, f"cfg-d{uuid.uuid4().hex[:8]}.")
    # No idle timer: the two group-stage runs below each wait for a consumer-group join.
    batches = Processor(ProcessorConfig(kafka=here, lake=lake_root, stages="batches"))
    running = threading.Thread(target=batches.run)
    running.start()
    deadline = time.monotonic() + 60
    while not all(stage.joined for stage in batches.stages):
        assert time.monotonic() < deadline and running.is_alive(), "the batch stage did not join"
        time.sleep(0.1)
    # The run's config reaches the lake (its runs table) but never this runs topic.
    publish(elsewhere, "r", config, [])
    run_processor(elsewhere, lake_root, idle_s=1.0, stages="groups")
    assert [r["run_id"] for r in rows(lake_root, "runs")] == ["r"]
    publish(here, "r", None, [event("group_started", "r", group_index=0, step=0, n_samples=2),
                              sample("r", 0, 0, 1.0), sample("r", 0, 1, 0.0)])
    run_processor(here, lake_root, idle_s=1.0, stages="groups")
    batches.drain()  # the decision is on its topic: finish it, then stop
    running.join(timeout=120)
    assert not running.is_alive()
    assert [r["error"] for r in rows(lake_root, "dead_letters")] == []
    assert [(d["group_index"], d["decision"], d["batch_step"])
            for d in rows(lake_root, "groups", "r")] == [(0, "kept", 0)]
    assert [r["step"] for r in rows(lake_root, "steps", "r")] == [0]


HELD = SimulationConfig(
    run_id="held", steps=6, rollout_batch_size=3, n_samples=2, response_len_mean=8,
    prompt_len=4, compaction_rate=0.1, duplicate_rate=0.05, abort_rate=0.05,
    missing_reward_rate=0.05, seed=5, mode="open", surplus_per_step=2,
)


def test_a_snapshot_taken_while_decisions_are_held_resumes_as_an_uninterrupted_run(
        broker, tmp_path):
    """Four events partitions: a snapshot falls between a decision and the watermarks that
    release it. The restart must still apply it in its place (the ordering state is in the
    snapshot), or steps and surplus differ from an uninterrupted run."""
    kafka = suite_kafka(broker.bootstrap_servers,
                        topic_prefix=f"held{uuid.uuid4().hex[:8]}.", event_partitions=4,
                        decision_partitions=1)
    kafka.ensure_topics()
    publish_open_loop(kafka, HELD)
    decided = str(tmp_path / "decided")
    run_processor(kafka, decided, idle_s=1.5, stages="groups",
                  consumer_group=f"{kafka.topic_prefix}held-groups")
    reference, lake_root = str(tmp_path / "reference"), str(tmp_path / "lake")
    shutil.copytree(decided, reference)
    shutil.copytree(decided, lake_root)
    run_processor(kafka, reference, idle_s=1.5, stages="batches",
                  consumer_group=f"{kafka.topic_prefix}held-ref")

    # A batch stage that stops, as if killed, right after a snapshot with decisions held.
    config = ProcessorConfig(kafka=kafka, lake=lake_root,
                             consumer_group=f"{kafka.topic_prefix}held-cut",
                             snapshot_every=5, max_poll_records=5)
    stage = BatchStage(config, Lake(lake_root))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        saved = dict(stage.snapshots.saved)
        stage.poll_once()
        if stage.snapshots.saved != saved and len(stage.merges[0]):
            break
    else:
        pytest.fail("no snapshot was taken while decisions were held")
    cut = stage.snapshots.saved[0]
    stage.close()

    second = run_processor(kafka, lake_root, idle_s=1.5, stages="batches",
                           consumer_group=f"{kafka.topic_prefix}held-cut")
    assert _batch_stage(second).resumed_from == {0: cut + 1}
    ref, lake = Lake(reference), Lake(lake_root)
    steps = ["step", "n_groups", "n_samples", "content_sha256"]
    assert len(run_rows(ref, "steps", steps, HELD.run_id)) == HELD.steps
    assert run_rows(lake, "steps", steps, HELD.run_id) == run_rows(ref, "steps", steps, HELD.run_id)
    decisions = ["group_index", "decision", "reason", "batch_step"]
    assert any(r[1] == "surplus" for r in run_rows(ref, "groups", decisions, HELD.run_id))
    assert (run_rows(lake, "groups", decisions, HELD.run_id)
            == run_rows(ref, "groups", decisions, HELD.run_id))
    fragments = ["group_index", "rollout_id", "fragment_index", "decision"]
    assert (run_rows(lake, "samples", fragments, HELD.run_id)
            == run_rows(ref, "samples", fragments, HELD.run_id))
    metrics = ["step", "key", "value"]
    assert (run_rows(lake, "step_metrics", metrics, HELD.run_id)
            == run_rows(ref, "step_metrics", metrics, HELD.run_id))


def test_groups_opened_before_their_run_started_outlive_a_restart(broker, tmp_path):
    """A worker starts groups before the run's config reaches the processor. The batch
    stage holds their opened notices until the run_started comes; a snapshot taken while
    they wait carries them, so after a restart the step still counts each group issued
    for it."""
    run = "early"
    kafka = ordered_kafka(broker.bootstrap_servers, f"early{uuid.uuid4().hex[:8]}.")
    t0 = time.time() - 10  # before the records' own timestamps, which cap an event time
    # Group 1 completes first (t0 + 0.3): both groups started before it, so their opened
    # notices pass the watermark while the run has no config yet.
    publish(kafka, run, None, [
        event("group_started", run, group_index=0, step=0, n_samples=2, ts=t0),
        event("group_started", run, group_index=1, step=0, n_samples=2, ts=t0 + 0.1),
        sample(run, 1, 0, 1.0, ts=t0 + 0.2), sample(run, 1, 1, 0.0, ts=t0 + 0.3),
        sample(run, 0, 0, 1.0, ts=t0 + 0.4), sample(run, 0, 1, 0.0, ts=t0 + 0.5),
    ])
    lake_root = str(tmp_path / "lake")
    run_processor(kafka, lake_root, idle_s=1.5, stages="groups",
                  consumer_group=f"{kafka.topic_prefix}early-groups")

    config = ProcessorConfig(kafka=kafka, lake=lake_root,
                             consumer_group=f"{kafka.topic_prefix}early-batches", snapshot_every=1)
    stage = BatchStage(config, Lake(lake_root))
    # The runs topic is read to its end at most once per poll, not once per notice of a
    # run without config (a broker round trip each).
    catch_up, catch_ups = stage.runs.catch_up, []
    stage.runs.catch_up = lambda: (catch_ups.append(1), catch_up())  # type: ignore[method-assign]
    most_in_a_poll = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        catch_ups.clear()
        stage.poll_once()
        most_in_a_poll = max(most_in_a_poll, len(catch_ups))
        if len(stage.awaiting_config.get(run, [])) == 2 and stage.snapshots.saved:
            break
    else:
        pytest.fail("the opened groups did not wait for their run's config in a snapshot")
    assert most_in_a_poll == 1
    cut = stage.snapshots.saved[0]
    stage.close()

    publish(kafka, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1}, [])
    run_processor(kafka, lake_root, idle_s=1.5, stages="groups",
                  consumer_group=f"{kafka.topic_prefix}early-groups")
    second = run_processor(kafka, lake_root, idle_s=1.5, stages="batches",
                           consumer_group=f"{kafka.topic_prefix}early-batches")
    assert _batch_stage(second).resumed_from == {0: cut + 1}
    decided = {r["group_index"]: (r["decision"], r["batch_step"])
               for r in rows(lake_root, "groups", run)}
    assert decided == {0: ("surplus", None), 1: ("kept", 0)}
    issued = {(r["step"], r["key"]): r["value"] for r in rows(lake_root, "step_metrics", run)}
    assert issued[(0, "rollout/prompts_issued")] == 2.0


class _FirstCommitHangs(Lake):
    """A lake whose first commit to `table` hangs until `release` is set, then fails (a full
    disk, an S3 outage) or goes through."""

    def __init__(self, root: str, table: str, *, fails: bool):
        super().__init__(root)
        self.table = table
        self.release = threading.Event()
        self.hanging = threading.Event()
        self.fails = fails
        self.hung_up_to = -1  # the last offset of the hung commit

    def append(self, table, rows, marks=()):
        if table == self.table and not self.hanging.is_set():
            self.hung_up_to = max((mark.version for mark in marks), default=-1)
            self.hanging.set()
            self.release.wait(timeout=60)
            if self.fails:
                raise OSError("no space left on device")
        return super().append(table, rows, marks)


@pytest.mark.parametrize("snapshot_every", [7, 100_000], ids=["snapshots due", "seals only"])
def test_a_failed_seal_stops_the_stage_and_a_restart_writes_what_it_lost(
        broker, tmp_path, snapshot_every):
    """The seal of a step commits beside later polls. When it fails, no later seal and no
    snapshot may pass it: the offsets of either would mark its rows as written, and the
    restart would skip them (its steps then have no batch)."""
    groups = list(open_loop_groups(SIM))
    half = len(groups) // 2
    kafka = ordered_kafka(broker.bootstrap_servers, f"seal{uuid.uuid4().hex[:8]}.")
    lake_root, reference = str(tmp_path / "lake"), str(tmp_path / "reference")
    _publish_groups(kafka, groups[:half], with_run=True)
    run_processor(kafka, lake_root, idle_s=1.5, stages="groups")

    config = ProcessorConfig(kafka=kafka, lake=lake_root,
                             consumer_group=f"{kafka.topic_prefix}failing",
                             snapshot_every=snapshot_every, max_poll_records=10)
    lake = _FirstCommitHangs(lake_root, "training_batches", fails=True)
    stage = BatchStage(config, lake)
    polling, failures = poll_in_thread(stage, lambda: False)
    deadline = time.monotonic() + 60
    while not (lake.hanging.is_set() and stage.sealing is not None):  # the first half's steps
        assert time.monotonic() < deadline and polling.is_alive(), "nothing was sealed"
        time.sleep(0.01)
    first_seal = stage.sealing
    # The second half's decisions arrive while that seal hangs: a stage that polls on
    # (no snapshot due) seals their steps next.
    _publish_groups(kafka, groups[half:], with_run=False)
    run_processor(kafka, lake_root, idle_s=1.5, stages="groups")
    deadline = time.monotonic() + 5
    while stage.sealing is first_seal and time.monotonic() < deadline:
        time.sleep(0.01)
    lake.release.set()
    polling.join(timeout=60)
    assert [type(e) for e in failures] == [OSError]
    stage.close()
    assert rows(lake_root, "training_batches", SIM.run_id) == []
    assert rows(lake_root, "steps", SIM.run_id) == []

    shutil.copytree(lake_root, reference)  # before the restart: the same decisions
    second = run_processor(kafka, lake_root, idle_s=1.5, stages="batches",
                           consumer_group=f"{kafka.topic_prefix}failing")
    assert not second.errors
    run_processor(kafka, reference, idle_s=1.5, stages="batches",
                  consumer_group=f"{kafka.topic_prefix}ref")
    ref, restarted = Lake(reference), Lake(lake_root)
    steps = ["step", "n_groups", "n_samples", "content_sha256"]
    assert len(_table(ref, "steps", steps)) == SIM.steps
    assert _table(restarted, "steps", steps) == _table(ref, "steps", steps)
    fragments = ["step", "position", "group_index", "rollout_id", "fragment_index"]
    assert (_table(restarted, "training_batches", fragments)
            == _table(ref, "training_batches", fragments))
    decisions = ["group_index", "decision", "reason", "batch_step"]
    assert _table(restarted, "groups", decisions) == _table(ref, "groups", decisions)


def _decided_groups(kafka: KafkaSettings) -> list[int]:
    """Group indexes of the decisions on the decisions topic, in topic order."""
    records = read_topics(kafka, [kafka.topics.decisions], what="test", timeout_s=60)
    return [header.group_index for header in map(decision_header, records)
            if header is not None]


def _archived_events(lake: Lake) -> list[tuple[int, str, int]]:
    """(group, event id, offset) of the run's archived group events."""
    table = lake.read("events", columns=["group_index", "event_id", "offset"],
                      filter=(pc.field("run_id") == SIM.run_id) & pc.field("group_index").is_valid())
    return sorted(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True))


def _archiving_stage(kafka: KafkaSettings, lake_root: str, archive_lake: Lake) -> GroupStage:
    """A group stage in its own consumer group whose archive commits go to `archive_lake`,
    in polls of a few records, so the stream takes many of them."""
    config = ProcessorConfig(kafka=kafka, lake=lake_root, max_poll_records=10,
                             consumer_group=f"{kafka.topic_prefix}archiving")
    stage = GroupStage(config, Lake(lake_root))
    archive_lake.after_commit = stage.archive_lake.after_commit
    stage.archive_lake = archive_lake
    return stage


def test_a_decision_goes_out_only_once_its_events_are_archived_while_the_stage_reads_on(
        broker, tmp_path):
    """The archive commit of a poll runs beside the next poll: the stage assembles more
    records meanwhile, but no decision of the poll is published before its events are in
    the lake, and none of the next poll's overtakes it."""
    groups = list(open_loop_groups(SIM))
    kafka = ordered_kafka(broker.bootstrap_servers, f"arch{uuid.uuid4().hex[:8]}.")
    lake_root = str(tmp_path / "lake")
    _publish_groups(kafka, groups, with_run=True)
    archive = _FirstCommitHangs(lake_root, "events", fails=False)
    stage = _archiving_stage(kafka, lake_root, archive)
    def read() -> int:
        return max((record.offset for record in stage.last_records.values()), default=-1)

    polling, failures = poll_in_thread(stage, lambda: archive.release.is_set() and stage.idle)
    assert archive.hanging.wait(timeout=60), "nothing was archived"
    deadline = time.monotonic() + 30
    while read() <= archive.hung_up_to:  # the next poll is read and assembled meanwhile
        assert time.monotonic() < deadline and polling.is_alive(), "the stage stopped reading"
        time.sleep(0.01)
    time.sleep(0.5)  # were anything published now, it would be on the topic by then
    assert _decided_groups(kafka) == []
    assert _archived_events(Lake(lake_root)) == []
    archive.release.set()
    polling.join(timeout=120)
    assert not failures and not polling.is_alive()
    stage.close()

    decided = _decided_groups(kafka)
    assert decided
    assert set(decided) <= {group for group, _, _ in _archived_events(Lake(lake_root))}


@pytest.mark.parametrize("run_on", [True, False], ids=["restart", "restart, no new events"])
def test_a_failed_archive_commit_stops_the_stage_and_a_restart_archives_what_it_lost(
        broker, tmp_path, run_on):
    """No later poll may write past a failed archive commit: its dead letters' offsets or
    the next archive commit would mark the lost events as stored, and the restart would
    skip them (their groups never decided)."""
    groups = list(open_loop_groups(SIM))
    half = len(groups) // 2
    kafka = ordered_kafka(broker.bootstrap_servers, f"archfail{uuid.uuid4().hex[:8]}.")
    lake_root, reference = str(tmp_path / "lake"), str(tmp_path / "reference")
    _publish_groups(kafka, groups[:half], with_run=True)
    archive = _FirstCommitHangs(lake_root, "events", fails=True)
    stage = _archiving_stage(kafka, lake_root, archive)
    polling, failures = poll_in_thread(stage, lambda: False)
    assert archive.hanging.wait(timeout=60), "nothing was archived"
    archive.release.set()
    polling.join(timeout=60)
    assert [type(e) for e in failures] == [OSError]
    stage.close()
    assert _archived_events(Lake(lake_root)) == []
    assert _decided_groups(kafka) == []

    if run_on:
        _publish_groups(kafka, groups[half:], with_run=False)
    group_id = f"{kafka.topic_prefix}archiving"
    restarted = run_processor(kafka, lake_root, idle_s=1.5, consumer_group=group_id)
    assert not restarted.errors
    run_processor(kafka, reference, idle_s=1.5, consumer_group=f"{kafka.topic_prefix}ref")
    ref, lake = Lake(reference), Lake(lake_root)
    assert _archived_events(lake) == _archived_events(ref)
    assert _table(ref, "groups", ["group_index"])
    decisions = ["group_index", "decision", "reason", "batch_step"]
    assert _table(lake, "groups", decisions) == _table(ref, "groups", decisions)
    steps = ["step", "n_groups", "n_samples", "content_sha256"]
    assert _table(lake, "steps", steps) == _table(ref, "steps", steps)


def _assert_batch_versions_hold_their_steps(lake: Lake) -> None:
    """Each step's `batch_version` is the `training_batches` commit that added its rows."""
    steps = rows(lake, "steps", SIM.run_id)
    assert len(steps) == SIM.steps
    for step in steps:
        of_step = (pc.field("run_id") == SIM.run_id) & (pc.field("step") == step["step"])
        version = step["batch_version"]
        assert lake.read("training_batches", version=version, filter=of_step).num_rows > 0
        assert lake.read("training_batches", version=version - 1, filter=of_step).num_rows == 0


def test_a_seal_records_its_own_batch_commit_and_a_restart_finds_an_earlier_one(
        broker, tmp_path, monkeypatch):
    """A step's `batch_version` is the commit its seal just made, taken as it is: the
    search of the table's versions (a bisection, reading the log at each) is only for a
    step whose batch a run before a restart wrote."""
    kafka = ordered_kafka(broker.bootstrap_servers, f"bv{uuid.uuid4().hex[:8]}.")
    _publish_groups(kafka, list(open_loop_groups(SIM)), with_run=True)
    searched: list[str] = []
    search = Lake.first_version_with

    def counted(self: Lake, table: str, prune: str) -> int | None:
        searched.append(prune)
        return search(self, table, prune)

    monkeypatch.setattr(Lake, "first_version_with", counted)
    fresh = str(tmp_path / "fresh")
    assert not run_processor(kafka, fresh, idle_s=1.5).errors
    assert searched == []
    _assert_batch_versions_hold_their_steps(Lake(fresh))

    lake_root = str(tmp_path / "lake")
    run_processor(kafka, lake_root, idle_s=1.5, stages="groups")
    config = ProcessorConfig(kafka=kafka, lake=lake_root,
                             consumer_group=f"{kafka.topic_prefix}steps-fail")
    # The seal's batch gets into `training_batches`, its `steps` row does not (a crash
    # between the two).
    steps_fail = _FirstCommitHangs(lake_root, "steps", fails=True)
    steps_fail.release.set()
    stage = BatchStage(config, steps_fail)
    with pytest.raises(OSError):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stage.poll_once()
    stage.close()
    assert rows(lake_root, "training_batches", SIM.run_id)
    assert rows(lake_root, "steps", SIM.run_id) == []
    restarted = run_processor(kafka, lake_root, idle_s=1.5, stages="batches",
                              consumer_group=f"{kafka.topic_prefix}steps-fail")
    assert not restarted.errors
    assert searched  # the steps whose batches the failed run wrote
    _assert_batch_versions_hold_their_steps(Lake(lake_root))


def test_a_take_over_of_a_partition_archived_elsewhere_meanwhile_commits_without_a_conflict(
        broker, tmp_path, caplog):
    """The archiver writes through a table handle of its own. A partition that went to
    another instance and came back was archived there meanwhile: the first archive commit
    after the take-over must start from the table as it is now, not go through a conflict
    with the other instance's commit and a retry (logged) at every such take-over."""
    kafka = ordered_kafka(broker.bootstrap_servers, f"back{uuid.uuid4().hex[:8]}.")
    lake_root = str(tmp_path / "lake")
    run = "came-back"
    opened = [event("group_started", run, group_index=g, step=0, n_samples=1) for g in range(3)]
    publish(kafka, run, {"n_samples_per_prompt": 1, "rollout_batch_size": 1}, opened[:1])
    stage = GroupStage(ProcessorConfig(kafka=kafka, lake=lake_root), Lake(lake_root))
    try:
        poll_until_idle(stage)  # group 0 archived through the archiver's handle
        owned = set(stage.consumer.assignment())
        stage.on_partitions_revoked(owned)
        publish(kafka, run, None, opened[1:2])
        # Another instance owns the partition now and archives group 1's event.
        other = Lake(lake_root)
        ends = stage.consumer.end_offsets(list(owned))
        other.append("events", other.spec("events").schema.empty_table(),
                     [TxnMark(app_id("events", tp.topic, tp.partition), ends[tp] - 1)
                      for tp in owned])
        publish(kafka, run, None, opened[2:])
        caplog.set_level(logging.INFO, logger="ingest.io.lake")
        stage.on_partitions_assigned(owned)  # and it comes back
        poll_until_idle(stage)
    finally:
        stage.close()
    assert "concurrent commit" not in caplog.text
    archived = rows(lake_root, "events", run)
    assert sorted(r["group_index"] for r in archived if r["type"] == "group_started") == [0, 2]
