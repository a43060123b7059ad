"""`--until-idle` ends the processor only when nothing is left to do."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.protocol.consumer.metadata import (
    ConsumerProtocolAssignment,
    ConsumerProtocolSubscription,
)

from ingest.commands.simulate import SimulationConfig, run_simulation
from ingest.io import kafka as kafka_module
from ingest.io.kafka import KafkaSettings, poll_in_group, subscribe_once_listed
from ingest.io.lake import Lake
from ingest.processor import stage as stage_module
from ingest.processor.batch_stage import BatchStage
from ingest.processor.config import ProcessorConfig
from ingest.processor.group_stage import GroupStage
from ingest.processor.launch import BatchChild
from ingest.processor.main import Processor, idle_for
from tests.integration.pipeline import (
    event,
    ordered_kafka,
    poll_until_idle,
    publish,
    run_processor,
    sample,
)
from tests.support.suite_kafka import suite_kafka

# The session timeout of the tests' own members (Tansu answers a join after half of it)
# and so what their polls wait a join out for.
SESSION_TIMEOUT_MS = 6000


def test_a_backlog_longer_to_commit_than_the_idle_time_is_finished(broker, tmp_path):
    """Each poll's commits (several Delta tables) take longer than the idle time: the
    processor must not take that for idleness and stop in the middle of the backlog."""
    sim = SimulationConfig(run_id="backlog", steps=30, rollout_batch_size=2, n_samples=2,
                           response_len_mean=8, prompt_len=4, seed=4, mode="open",
                           surplus_per_step=1)
    kafka = ordered_kafka(broker.bootstrap_servers, f"idle{id(sim)}.")
    run_simulation(kafka, sim)
    lake_root = str(tmp_path / "lake")
    run_processor(kafka, lake_root, idle_s=0.05, max_poll_records=200)
    assert Lake(lake_root).read("steps", columns=["step"]).num_rows == sim.steps


def test_a_batch_stage_read_to_the_end_before_the_last_decisions_were_sent_is_not_idle(
        kafka, tmp_path):
    """A stage is read to its end offsets as of its last check, and the batch stage's last
    check can come before the group stage sent its last decisions: both stages then looked
    idle, and a CI run's `--until-idle` processor stopped with two steps of its backlog
    unsealed. Idleness counts only once each stage read to end offsets measured after the
    last activity of either."""
    publish(kafka, "late", {"n_samples_per_prompt": 1, "rollout_batch_size": 1},
            complete_group("late"))
    lake = Lake(str(tmp_path / "lake"))
    config = ProcessorConfig(kafka=kafka, lake=lake.root)
    batches = BatchStage(config, Lake(lake.root))
    groups = None
    try:
        poll_until_idle(batches)  # read to the end: no decision yet
        groups = GroupStage(config, Lake(lake.root))
        poll_until_idle(groups)  # the group decided, its decision acknowledged
        assert batches.idle  # as the processor's main thread sees it before the next check
        assert idle_for([groups, batches]) == 0.0

        deadline = time.monotonic() + 60
        while idle_for([groups, batches]) == 0.0:
            assert time.monotonic() < deadline, "the stages never became idle"
            groups.poll_once()
            batches.poll_once()
        assert lake.read("steps", columns=["run_id", "step"]).to_pylist() == [
            {"run_id": "late", "step": 0}]
    finally:
        batches.close()
        if groups is not None:
            groups.close()


@pytest.mark.one_broker("the test drives the consumer's rebalance callbacks itself")
def test_a_stage_between_a_revocation_and_its_next_take_over_is_not_idle(kafka, tmp_path):
    """A rejoin revokes every partition; the group assigns them again only once each
    member rejoined. The stage owns nothing meanwhile, and its partitions' work is still
    ahead (a group stage re-derives the decisions a killed owner archived but never
    published): `--until-idle` must not count it. A chaos run's last instance once exited
    there, joined to all four events partitions but before taking any over, and the held
    decisions of the run's last step never reached the tables."""
    stage = idle_group_stage(kafka, tmp_path, "rejoin")
    try:
        owned = set(stage.consumer.assignment())
        assert owned and stage.clocks  # took its partitions over

        stage.on_partitions_revoked(owned)  # as the consumer does when a rejoin starts
        for _ in range(5):
            stage.poll_once()
            assert not stage.idle and not stage.clocks

        stage.on_partitions_assigned(owned)  # the rejoin completed: the same partitions
        poll_until_idle(stage)
        assert set(stage.clocks) == {tp.partition for tp in owned}
    finally:
        stage.close()


@pytest.mark.one_broker("the test drives the consumer's rebalance callbacks itself")
def test_a_stage_that_lost_its_membership_is_not_idle_while_it_rejoins(kafka, tmp_path):
    """A member whose session expired (a process frozen longer than its session timeout)
    loses its partitions: kafka-python calls `on_partitions_lost` and clears the
    assignment, then rejoins inside the stage's poll. Seen from the processor's main
    thread meanwhile, the stage owned nothing of an assignment that lists nothing, and
    was read to the end before the freeze: `--until-idle` could end there with the events
    published during the freeze unread (after a 9 s freeze on Apache Kafka the rejoin took
    2.0-2.1 s, against an idle time of 2 s)."""
    stage = idle_group_stage(kafka, tmp_path, "lost")
    try:
        owned = set(stage.consumer.assignment())
        assert owned and stage.idle

        stage.on_partitions_lost(owned)  # as kafka-python does when the generation is lost
        stage.consumer._subscription.assign_from_subscribed([])
        assert not stage.idle  # what the main thread sees while the poll rejoins

        stage.consumer._subscription.assign_from_subscribed(owned)  # the rejoin completed
        stage.on_partitions_assigned(owned)
        poll_until_idle(stage)
        assert stage.owned == {tp.partition for tp in owned}
        assert {g for run, g in stage.pending if run == "lost"} == {0}  # taken over again
    finally:
        stage.close()


def test_a_stage_whose_polls_come_back_empty_while_messages_wait_is_not_idle(kafka, tmp_path):
    """A poll can return nothing while its partition still holds unread messages (a slow
    broker, the first fetch after a take-over): a CLI run on a loaded machine once ended
    idle before it had read its run. The stage is idle only once its positions reached
    the end offsets."""
    stage = idle_group_stage(kafka, tmp_path, None)
    try:
        partitions = set(stage.consumer.assignment())
        stage.consumer.pause(*partitions)  # fetches return nothing, as a stalled one does
        publish(kafka, "waiting", {"n_samples_per_prompt": 1, "rollout_batch_size": 1},
                [event("group_started", "waiting", group_index=g, step=g, n_samples=1)
                 for g in range(4)])
        until = time.monotonic() + 1.0  # the stage compares with the end offsets twice a second
        while time.monotonic() < until:
            assert stage.poll_once() == 0
        for _ in range(10):
            assert stage.poll_once() == 0
            assert not stage.idle
        stage.consumer.resume(*partitions)
        poll_until_idle(stage)
        assert {g for run, g in stage.pending if run == "waiting"} == {0, 1, 2, 3}
    finally:
        stage.close()


@pytest.mark.one_broker("the test drives the consumer's rebalance callbacks itself")
def test_a_revocation_never_followed_by_an_assignment_ends_in_a_new_join(kafka, tmp_path,
                                                                         monkeypatch, caplog):
    """kafka-python can revoke a stage's partitions for a rejoin it never completes: the
    consumer keeps listing them, pending revocation and never fetched, and the stage
    waited forever (Apache Kafka CI runs hung in --until-idle). After REJOIN_AFTER_S of
    polls the stage joins with a new consumer and takes its partitions over again."""
    monkeypatch.setattr(stage_module, "REJOIN_AFTER_S", 1.0)
    stage = idle_group_stage(kafka, tmp_path, "stuck")
    try:
        owned = set(stage.consumer.assignment())
        stage.on_partitions_revoked(owned)  # and no assignment follows
        first = stage.consumer
        poll_until_idle(stage)
        assert stage.consumer is not first
        assert stage.owned == {tp.partition for tp in stage.consumer.assignment()} \
            == {tp.partition for tp in owned}
        assert {g for run, g in stage.pending if run == "stuck"} == {0}  # taken over again
        assert "joining the group again" in caplog.text
    finally:
        stage.close()


@pytest.mark.one_broker("the test stands in for the consumer's fetches itself")
def test_a_consumer_that_stops_fetching_is_replaced(kafka, tmp_path, monkeypatch, caplog):
    """kafka-python 3.0 on Apache Kafka once left a fetch that never completed: the
    partition stayed fetchable and behind its end offset, and poll after poll returned
    nothing, so a group timed out that the stage never read. After STALL_REPORT_S of such
    polls the stage joins with a new consumer."""
    monkeypatch.setattr(stage_module, "STALL_REPORT_S", 1.0)
    stage = idle_group_stage(kafka, tmp_path, None)
    try:
        stalled = stage.consumer
        stalled.poll = lambda timeout_ms, **_: time.sleep(timeout_ms / 1000) or {}
        publish(kafka, "refetched", {"n_samples_per_prompt": 1, "rollout_batch_size": 1},
                complete_group("refetched"))
        poll_for(stage, 1.0)  # the stage compares with the end offsets twice a second
        poll_until_idle(stage)
        assert stage.consumer is not stalled
        assert ("refetched", 0) in stage.decided
        assert caplog.text.count("stopped fetching while behind its end offsets") == 1
    finally:
        stage.close()


@pytest.mark.one_broker("the test stands in for the consumer's fetches itself")
def test_a_partition_without_a_fetch_response_still_follows_the_wall_clock(kafka, tmp_path):
    """A partition with nothing more to read follows the wall clock (less the watermark
    lag), so it holds no step back. Its highwater comes with fetch responses; a fetch that
    never completes (kafka-python 3.0 on Apache Kafka) leaves none, and the partition is
    not behind, so the stall check does not replace the consumer: the clock stood still
    and the batch stage waited on it with no word (a possible cause of a chaos run on
    Apache Kafka whose step did not seal for 2 min). The end offset tells instead."""
    stage = idle_group_stage(kafka, tmp_path, None)
    try:
        stage.consumer.highwater = lambda tp: None
        poll_for(stage, 0.5)
        before = {p: clock.watermark_us for p, clock in stage.clocks.items()}
        poll_for(stage, 1.0)
        assert len(before) == 2
        assert all(stage.clocks[p].watermark_us > (before[p] or 0) for p in before)
    finally:
        stage.close()


@pytest.mark.one_broker("the test stands in for the consumer's fetches itself")
def test_a_group_waiting_for_a_run_config_not_read_yet_is_not_idle(kafka, tmp_path,
                                                                   monkeypatch, caplog):
    """A complete group waits for its run's `run_started`, which comes on another topic
    through another consumer; a stage read to the end of its events while that consumer
    lagged counted as idle, and `--until-idle` ended with the group undecided (a CI run on
    Apache Kafka ended with an empty `groups` table). That consumer, found stalled, is
    replaced."""
    monkeypatch.setattr(kafka_module, "STALLED_CHECKS", 10**6)
    stage = idle_group_stage(kafka, tmp_path, None)
    try:
        stalled = stage.runs._reader.consumer
        stalled.poll = lambda timeout_ms, **_: {}
        publish(kafka, "unread", {"n_samples_per_prompt": 1, "rollout_batch_size": 1},
                complete_group("unread"))
        poll_for(stage, 1.0)  # the stage compares with the end offsets twice a second
        until = time.monotonic() + 2.0
        while time.monotonic() < until:
            stage.poll_once()
            assert not stage.idle
        assert ("unread", 0) in stage.pending  # read, and waiting for its config

        monkeypatch.setattr(kafka_module, "STALLED_CHECKS", 2)
        poll_until_idle(stage)
        assert stage.runs._reader.consumer is not stalled
        assert ("unread", 0) in stage.decided
        assert "runs topic: " in caplog.text and "reading on with a new consumer" in caplog.text
    finally:
        stage.close()


def complete_group(run: str) -> list[dict[str, Any]]:
    """Group 0 of `run`, one sample with its reward: complete once read."""
    return [event("group_started", run, group_index=0, step=0, n_samples=1),
            sample(run, 0, 0, 1.0)]


def idle_group_stage(kafka: KafkaSettings, tmp_path: Path, run: str | None) -> GroupStage:
    """A group stage that took its partitions over and is idle, holding one open group of
    `run` when given."""
    if run is not None:
        publish(kafka, run, {"n_samples_per_prompt": 1, "rollout_batch_size": 1},
                [event("group_started", run, group_index=0, step=0, n_samples=1)])
    lake = Lake(str(tmp_path / "lake"))
    stage = GroupStage(ProcessorConfig(kafka=kafka, lake=lake.root), lake)
    try:
        poll_until_idle(stage)
    except BaseException:
        stage.close()
        raise
    return stage


def poll_for(stage: GroupStage, seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        stage.poll_once()


@pytest.mark.one_broker("Tansu ends the rebalance after about 3 s, not the slow member's "
                        "max.poll.interval: too close to the idle time for a sure test",
                        engine="kafka")
def test_until_idle_waits_out_a_rebalance_that_waits_for_a_slow_member(broker, tmp_path):
    """Apache Kafka: a member that stopped polling holds a rebalance up for its
    max.poll.interval. A stage whose partition that rebalance revoked must not count the
    wait as idleness, as `--until-idle` does: it ends only once the stage took its
    partition over again."""
    kafka = suite_kafka(broker.bootstrap_servers,
                        topic_prefix=f"slow{time.monotonic_ns()}.", event_partitions=2)
    kafka.ensure_topics()
    stage = idle_group_stage(kafka, tmp_path, "slow")
    members = []
    try:
        group = stage.health.group_id
        # Joins, then stops polling: it holds a rebalance for its max.poll.interval, after
        # which it leaves the group. Long enough that a loaded machine still gets the
        # joiner's rebalance started before then (at 8 s it once did not).
        slow = member(kafka, group, max_poll_interval_ms=15000)
        members.append(slow)
        deadline = time.monotonic() + 60
        while not slow.assignment():
            assert time.monotonic() < deadline, "the slow member did not join"
            stage.poll_once()  # the stage has to rejoin for the slow member to join
            poll_in_group(slow, 50, join_wait_ms=SESSION_TIMEOUT_MS)
        # The joiner's rebalance revokes the stage's partition. Noted as it happens: a
        # rebalance that ends within one poll gives the partition back before `owned` is seen.
        revoked = threading.Event()
        revoke = stage.on_partitions_revoked

        def noted(partitions):
            if partitions:
                revoked.set()
            revoke(partitions)

        stage.on_partitions_revoked = noted  # type: ignore[method-assign]
        joiner = member(kafka, group)
        members.append(joiner)
        stop = threading.Event()
        joining = threading.Thread(target=lambda: [poll_in_group(joiner, 100,
                                                                 join_wait_ms=SESSION_TIMEOUT_MS)
                                                   for _ in iter(stop.is_set, True)])
        joining.start()
        try:
            while not revoked.is_set():
                assert time.monotonic() < deadline + 60, "no rebalance revoked the partition"
                stage.poll_once()
            while idle_for([stage]) < 2.0:  # --until-idle 2
                assert time.monotonic() < deadline + 120, "the stage never became idle"
                stage.poll_once()
        finally:
            stop.set()
            joining.join()
        assert stage.owned and stage.owned == {tp.partition for tp in stage.consumer.assignment()}
    finally:
        stage.close()
        for consumer in members:
            consumer.close()


def member(kafka: KafkaSettings, group: str, **overrides) -> KafkaConsumer:
    """Another member of the consumer group `group`."""
    consumer = kafka.consumer(group_id=group, session_timeout_ms=SESSION_TIMEOUT_MS, **overrides)
    subscribe_once_listed(consumer, kafka.topics.events, timeout_s=30)
    return consumer


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:"))
                 .split()[1], 16)
    return bool(caught >> (signum - 1) & 1)


def test_a_batch_stage_told_to_drain_before_it_runs_still_seals(broker, tmp_path):
    """A stopping processor tells its batch-stage child to drain (SIGTERM). An --until-idle
    parent can stop while the child still imports or waits for its configuration: the
    child must drain once its stage runs, not die with the decisions unsealed."""
    sim = SimulationConfig(run_id="early", steps=1, rollout_batch_size=1, n_samples=2,
                           response_len_mean=8, prompt_len=4, seed=5, mode="open")
    kafka = ordered_kafka(broker.bootstrap_servers, f"early{os.getpid()}.")
    run_simulation(kafka, sim)
    config = ProcessorConfig(kafka=kafka, lake=str(tmp_path / "lake"), until_idle_s=1.0)
    child = BatchChild()
    deadline = time.monotonic() + 60
    while not _catches(child.process.pid, signal.SIGTERM):
        assert time.monotonic() < deadline and child.process.is_alive()
        time.sleep(0.01)
    os.kill(child.process.pid, signal.SIGTERM)
    groups = Processor(config.model_copy(update={"stages": "groups"}))  # the tables first
    child.configure(config, logging.WARNING)
    child.tables_ready(None)
    groups.run()
    child.process.join(120)
    assert child.process.exitcode == 0
    assert Lake(config.lake).read("steps", columns=["step"]).num_rows == sim.steps


class _TakeEverything(RangePartitionAssignor):
    """The range protocol as the stages speak it, run by a leader that assigns every
    partition to its own member (the one whose subscription says TAKER): the others get
    the empty assignment a leader whose metadata does not list the topic yet gives."""

    TAKER = b"takes everything"

    @classmethod
    def metadata(cls, topics):
        return ConsumerProtocolSubscription(cls.version, list(topics), cls.TAKER)

    @classmethod
    def assign(cls, cluster, members):
        return {m.member_id: ConsumerProtocolAssignment(
                    cls.version,
                    sorted((topic, sorted(cluster.partitions_for_topic(topic) or ()))
                           for topic in m.metadata.topics)
                    if m.metadata.user_data == cls.TAKER else [], b"")
                for m in members}


def test_a_stage_assigned_nothing_is_not_idle_while_the_lake_lacks_its_topic(broker, tmp_path):
    """A group stage whose consumer group assigned it nothing counted as idle at once: its
    (empty) assignment was read to the end. A CI run's `--until-idle` processor then ended
    without archiving one event, its leader's first assignment having been empty. Idle
    needs the partitions assigned to no one here to be in the lake too."""
    kafka = ordered_kafka(broker.bootstrap_servers, f"none{uuid.uuid4().hex[:8]}.")
    publish(kafka, "unassigned", {"n_samples_per_prompt": 1, "rollout_batch_size": 1},
            complete_group("unassigned"))
    lake = Lake(str(tmp_path / "lake"))
    config = ProcessorConfig(kafka=kafka, lake=lake.root)
    leader = kafka.consumer(group_id=f"{config.group_prefix}-groups",
                            session_timeout_ms=SESSION_TIMEOUT_MS,
                            partition_assignment_strategy=[_TakeEverything])
    subscribe_once_listed(leader, kafka.topics.events, timeout_s=30)
    deadline = time.monotonic() + 60
    while not leader.assignment():  # joins alone first: the group's leader
        assert time.monotonic() < deadline, "the first member did not join"
        poll_in_group(leader, 100, join_wait_ms=SESSION_TIMEOUT_MS)
    stop = threading.Event()
    polling = threading.Thread(target=lambda: [poll_in_group(leader, 100,
                                                             join_wait_ms=SESSION_TIMEOUT_MS)
                                               for _ in iter(stop.is_set, True)])
    polling.start()
    stage = GroupStage(config, lake)
    try:
        while not stage.joined:
            assert time.monotonic() < deadline, "the stage did not join"
            stage.poll_once()
        assert not stage.consumer.assignment() and leader.assignment()
        poll_for(stage, 2.0)  # four end-offset checks
        assert not stage.idle

        stop.set()
        polling.join()
        leader.close()  # leaves: the partition comes to the stage, which reads it
        poll_until_idle(stage)
        assert ("unassigned", 0) in stage.decided
    finally:
        stop.set()
        polling.join()
        stage.close()
