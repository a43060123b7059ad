"""Processor stages as consumer-group members, on each broker engine."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
from kafka import ConsumerRebalanceListener

from ingest.io.broker import free_port
from ingest.io.kafka import poll_in_group, subscribe_once_listed
from ingest.io.lake import Lake
from ingest.processor import membership
from ingest.processor.batch_stage import BatchStage
from ingest.processor.config import ProcessorConfig
from ingest.processor.group_stage import GroupStage
from schemas.errors import RolloutlakeError
from tests.integration.pipeline import (
    event,
    ordered_kafka,
    publish,
    rows,
    run_processor,
    sample,
    stuck_member,
)
from tests.support.suite_kafka import suite_kafka


def _lake_with_every_table(lake_root: str) -> Lake:
    lake = Lake(lake_root)
    for table in ("events", "groups", "samples", "training_batches", "steps", "step_metrics",
                  "dead_letters"):
        lake.ensure(table)
    return lake


@pytest.mark.parametrize("stage_class", [GroupStage, BatchStage], ids=["groups", "batches"])
def test_a_new_member_is_assigned_every_partition_once_and_keeps_them(kafka, lake_root,
                                                                      stage_class):
    """A first join that assigns nothing, or one made before the member's coordinator saw
    the topic's metadata (it then rebalances again as soon as that metadata arrives), is
    followed by a rebalance kafka-python can lose (it completes after `poll` returned),
    leaving the stage without its partitions until it rejoins."""
    lake = _lake_with_every_table(lake_root)
    stage = stage_class(ProcessorConfig(kafka=kafka, lake=lake_root), lake)
    assignments: list[set[int]] = []
    revocations: list[set[int]] = []
    assign, revoke = stage.on_partitions_assigned, stage.on_partitions_revoked
    stage.on_partitions_assigned = lambda assigned: (
        assignments.append({tp.partition for tp in assigned}), assign(assigned))
    stage.on_partitions_revoked = lambda revoked: (
        revocations.append({tp.partition for tp in revoked}), revoke(revoked))
    try:
        deadline = time.monotonic() + 60
        while not stage.joined and time.monotonic() < deadline:
            stage.poll_once()
        # the metadata refresh that follows a subscription comes within a few polls
        settled = time.monotonic() + 3
        while stage.joined and time.monotonic() < settled:
            stage.poll_once()
        revoked_while_running = [r for r in revocations if r]
    finally:
        stage.close()
    topic = stage.topics.events if stage_class is GroupStage else stage.topics.decisions
    partitions = kafka.event_partitions if stage_class is GroupStage else kafka.decision_partitions
    assert stage.joined, f"no partitions of {topic} assigned within 60 s: {assignments}"
    assert assignments == [set(range(partitions))]
    assert revoked_while_running == []


class _Joins(logging.Handler):
    """Counts kafka-python's "Successfully joined group" lines: one per completed join."""

    def __init__(self) -> None:
        super().__init__()
        self.completed = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.completed += record.getMessage().startswith("Successfully joined group")


@pytest.mark.parametrize("stage_class", [GroupStage, BatchStage], ids=["groups", "batches"])
def test_a_stage_joins_its_group_while_it_is_still_being_built(kafka, lake_root, stage_class):
    """The join is most of a start-up (Tansu holds a JoinGroup for half the session
    timeout): a stage starts it as soon as it has subscribed, on a thread of its own, and
    builds the rest of itself meanwhile; its first poll takes the partitions over. (At a
    session timeout both brokers accept: Apache Kafka refuses the 2 s a stage tries first.)"""
    lake = _lake_with_every_table(lake_root)
    stage = stage_class(ProcessorConfig(kafka=kafka, lake=lake_root, session_timeout_ms=6000),
                        lake)
    try:
        deadline = time.monotonic() + 30
        while (not (topic_partitions := {tp.partition for tp in stage.consumer.assignment()})
               and time.monotonic() < deadline):  # no poll_once yet
            time.sleep(0.05)
        expected = set(range(kafka.event_partitions if stage_class is GroupStage
                             else kafka.decision_partitions))
        assert topic_partitions == expected
        assert not stage.joined and not stage.owned  # held until the stage polls
        stage.poll_once()
        assert stage.joined
        assert stage.owned == expected
    finally:
        stage.close()


def test_a_join_that_completes_between_two_short_polls_is_kept(kafka):
    """A member whose polls are short beside the work between them, as a busy stage's
    are: kafka-python drops a join that completed outside a poll and joins again (half
    the session timeout each time on Tansu), so such a member can stay unassigned."""
    assigned: list[set[int]] = []

    class Recorder(ConsumerRebalanceListener):
        def on_partitions_assigned(self, partitions):
            assigned.append({tp.partition for tp in partitions})

        def on_partitions_revoked(self, partitions):
            pass

    joins, coordinator_log = _Joins(), logging.getLogger("kafka.coordinator")
    level = coordinator_log.level
    coordinator_log.addHandler(joins)
    coordinator_log.setLevel(logging.INFO)
    consumer = kafka.consumer(group_id=f"joins-{uuid.uuid4().hex[:8]}", session_timeout_ms=6000)
    try:
        subscribe_once_listed(consumer, kafka.topics.events, Recorder(), timeout_s=10)
        deadline = time.monotonic() + 30
        while not assigned and time.monotonic() < deadline:
            poll_in_group(consumer, 1, join_wait_ms=6000)
            time.sleep(0.05)  # the work of a stage between two polls
    finally:
        consumer.close()
        coordinator_log.removeHandler(joins)
        coordinator_log.setLevel(level)
    assert assigned == [set(range(kafka.event_partitions))], \
        f"assignments {assigned} after {joins.completed} completed joins"
    assert joins.completed == 1


def test_a_missing_topic_is_one_clear_error(broker, lake_root, monkeypatch):
    monkeypatch.setattr(membership, "TOPIC_WAIT_S", 1.0)
    kafka = suite_kafka(broker.bootstrap_servers, topic_prefix="never.made.")
    with pytest.raises(RolloutlakeError) as raised:
        BatchStage(ProcessorConfig(kafka=kafka, lake=lake_root), Lake(lake_root))
    assert str(raised.value) == (f"topic never.made.rollout.decisions does not exist on "
                                 f"{broker.bootstrap_servers} (no partitions listed within 1 s)")


def test_a_stuck_deployment_under_another_topic_prefix_does_not_hold_up_this_one(broker,
                                                                               tmp_path):
    """Two deployments on one broker, each with its own topic prefix and the default
    consumer group. A member of the other one that joined and stopped polling holds its
    group's rebalances for minutes: this deployment's stages must not be in that group."""
    other = ordered_kafka(broker.bootstrap_servers, f"stuck{uuid.uuid4().hex[:8]}.")
    other_groups = ProcessorConfig(kafka=other, lake=str(tmp_path / "other")).group_prefix
    stuck = stuck_member(other, f"{other_groups}-groups")
    try:
        kafka = ordered_kafka(broker.bootstrap_servers, f"own{uuid.uuid4().hex[:8]}.")
        run = "own-run"
        publish(kafka, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1},
                [event("group_started", run, group_index=0, step=0, n_samples=2),
                 sample(run, 0, 0, 1.0), sample(run, 0, 1, 0.0)])
        lake = str(tmp_path / "lake")
        run_processor(kafka, lake, idle_s=1.0, join_timeout_s=20)
    finally:
        stuck.close()
    assert [r["decision"] for r in rows(lake, "groups", run)] == ["kept"]


def test_a_check_whose_probe_cannot_reach_the_broker_holds_the_records_back(kafka, lake_root):
    """After a freeze a stage checks its partitions with a probe consumer of its own. On a
    starved machine that probe's bootstrap can time out while the stage's consumer reads
    on (CI: the processor exited 2, "no Kafka broker answers"): the records wait for the
    next check instead."""
    run = "probe"
    lake = _lake_with_every_table(lake_root)
    config = ProcessorConfig(kafka=kafka, lake=lake_root)
    stage = GroupStage(config, lake)
    archived = lambda: sum(r["type"] != "run_started"  # noqa: E731
                           for r in rows(lake_root, "events", run))
    try:
        publish(kafka, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1},
                [event("group_started", run, group_index=0, step=0, n_samples=2)])
        deadline = time.monotonic() + 60
        while archived() < 1:
            assert time.monotonic() < deadline, "the first event was not archived"
            stage.poll_once()
        publish(kafka, run, None, [sample(run, 0, 0, 1.0), sample(run, 0, 1, 0.0)])
        unreachable = kafka.model_copy(update={"bootstrap_servers": f"127.0.0.1:{free_port()}",
                                               "bootstrap_timeout_ms": 300})
        stage.config = config.model_copy(update={"kafka": unreachable})
        stage.unverified = "a freeze of the process"
        held_until = time.monotonic() + 3
        while time.monotonic() < held_until:
            stage.poll_once()
        assert archived() == 1, "records were let through unchecked"
        stage.config = config
        deadline = time.monotonic() + 60
        while archived() < 3:
            assert time.monotonic() < deadline, "the held records were not read again"
            stage.poll_once()
        assert stage.unverified is None
    finally:
        stage.close()


@pytest.mark.one_broker("the subject is the batch stage's filter; every processor test carries "
                        "the decisions' headers through both brokers")
def test_a_second_deployment_on_the_same_topics_applies_only_its_own_decisions(broker,
                                                                               tmp_path):
    """A second lake derived from the same events (another --consumer-group and --lake on
    the same topics) shares `rollout.decisions` with the first. Its batch stage applied
    the first deployment's decisions too: steps and samples whose events its lake never
    archived (replay of it then found nothing)."""
    kafka = ordered_kafka(broker.bootstrap_servers, f"two{uuid.uuid4().hex[:8]}.")
    run = "shared-topics"
    publish(kafka, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1},
            [event("group_started", run, group_index=0, step=0, n_samples=2),
             sample(run, 0, 0, 1.0), sample(run, 0, 1, 0.0)])
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    run_processor(kafka, first, idle_s=1.0, consumer_group="first")
    assert [r["decision"] for r in rows(first, "groups", run)] == ["kept"]

    run_processor(kafka, second, idle_s=1.0, consumer_group="second", stages="batches")
    assert [rows(second, table, run) for table in ("groups", "samples", "steps")] == [[], [], []]

    run_processor(kafka, second, idle_s=1.0, consumer_group="second")
    for table in ("events", "groups", "steps"):
        assert len(rows(second, table, run)) == len(rows(first, table, run)) > 0, table


@pytest.mark.one_broker("the probe that fails is pointed at no broker at all")
def test_a_take_over_whose_check_cannot_reach_the_broker_is_tried_again(kafka, lake_root):
    """A take-over checks each partition the lake already read with a probe consumer of
    its own. On a starved machine that probe can fail to read in time (CI: "could not be
    read within 10 s"), and the stage, so the processor, stopped: it now tries again."""
    run = "retaken"
    lake = _lake_with_every_table(lake_root)
    # one the broker takes: no rejoin, whose new consumer would use the unreachable settings
    config = ProcessorConfig(kafka=kafka, lake=lake_root, session_timeout_ms=6000)
    publish(kafka, run, {"n_samples_per_prompt": 2, "rollout_batch_size": 1},
            [event("group_started", run, group_index=0, step=0, n_samples=2)])
    run_processor(kafka, lake_root, idle_s=0.5)
    publish(kafka, run, None, [sample(run, 0, 0, 1.0), sample(run, 0, 1, 0.0)])
    stage = GroupStage(config, lake)
    try:
        unreachable = kafka.model_copy(update={"bootstrap_servers": f"127.0.0.1:{free_port()}",
                                               "bootstrap_timeout_ms": 300})
        stage.config = config.model_copy(update={"kafka": unreachable})
        deadline = time.monotonic() + 60
        while not stage.joined:
            assert time.monotonic() < deadline, "the stage did not join"
            stage.poll_once()
        for _ in range(10):
            stage.poll_once()
        assert not stage.owned and not stage.idle
        stage.config = config
        deadline = time.monotonic() + 60
        while (run, 0) not in stage.decided:
            assert time.monotonic() < deadline, "the partitions were not taken over again"
            stage.poll_once()
        assert stage.owned == set(range(kafka.event_partitions))
    finally:
        stage.close()
    assert len([r for r in rows(lake_root, "events", run) if r["type"] != "run_started"]) == 3
