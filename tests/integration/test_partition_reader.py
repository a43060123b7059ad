"""`PartitionReader`: a consumer in no group that replaces itself when its fetches stall.

kafka-python 3.0 can leave a fetch that never completes on Apache Kafka, after which the
consumer reads nothing more. The runs-topic reader of a stage, the worker's control
follower and the simulation's follower all read this way: a stall left a group waiting for
its run's config, and would leave a worker deaf to seals. The test stands in for the
stalled fetch (a poll that returns nothing), since the library bug cannot be called up.
"""

from __future__ import annotations

import time

import pytest

from gateway import runs as runs_module
from gateway.prompts import wal
from gateway.runs import RunRegistry
from ingest.io import kafka as kafka_module
from ingest.io.kafka import KafkaSettings, PartitionReader
from ingest.processor import run_configs as run_configs_module
from ingest.processor.run_configs import RunConfigs
from ingest.sdk.publisher import RolloutPublisher
from schemas.errors import BrokerUnavailableError, UnavailableError


def _stall(reader: PartitionReader):
    stalled = reader.consumer
    stalled.poll = lambda timeout_ms, **_: time.sleep(timeout_ms / 1000) or {}
    return stalled


def _values(reader: PartitionReader, want: int, timeout_s: float = 30.0) -> list[bytes]:
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(values) < want and time.monotonic() < deadline:
        for records in reader.poll(timeout_ms=50).values():
            values.extend(r.value for r in records)
    return values


def _send(kafka: KafkaSettings, topic: str, values: list[bytes], partition: int | None = None
          ) -> None:
    producer = kafka.producer()
    for value in values:
        producer.send(topic, value=value, partition=partition)
    producer.flush()
    producer.close()


@pytest.fixture
def quick_checks(monkeypatch):
    monkeypatch.setattr(kafka_module, "STALL_CHECK_S", 0.05)
    monkeypatch.setattr(kafka_module, "STALLED_CHECKS", 4)


def test_a_stalled_reader_goes_on_from_its_positions_with_a_new_consumer(kafka, quick_checks,
                                                                          caplog):
    topic = kafka.topics.control
    _send(kafka, topic, [b"a", b"b"])
    reader = PartitionReader(kafka, [topic], what="test reader")
    try:
        assert _values(reader, 2) == [b"a", b"b"]
        stalled = _stall(reader)
        _send(kafka, topic, [b"c", b"d"])
        # Each record once, from where the stalled consumer was: none lost, none twice.
        assert _values(reader, 2) == [b"c", b"d"]
        assert reader.consumer is not stalled
        assert "test reader: " in caplog.text and "with a new consumer" in caplog.text
    finally:
        reader.close()


def test_a_reader_from_the_end_stays_there_across_a_replacement(kafka, quick_checks):
    topic = kafka.topics.control
    _send(kafka, topic, [b"old"])
    reader = PartitionReader(kafka, [topic], what="test reader", from_end=True)
    try:
        stalled = _stall(reader)
        _send(kafka, topic, [b"new"])
        assert _values(reader, 1) == [b"new"]
        assert reader.consumer is not stalled
    finally:
        reader.close()


def test_a_reader_read_to_the_end_is_not_replaced(kafka, quick_checks):
    """Nothing to read is not a stall: the consumer stays."""
    topic = kafka.topics.control
    _send(kafka, topic, [b"a"])
    reader = PartitionReader(kafka, [topic], what="test reader")
    try:
        assert _values(reader, 1) == [b"a"]
        consumer = reader.consumer
        until = time.monotonic() + 1.0  # 20 checks
        while time.monotonic() < until:
            reader.poll(timeout_ms=50)
        assert reader.behind(timeout_ms=5000) == []
        assert reader.consumer is consumer
    finally:
        reader.close()


def test_the_gateway_finds_a_new_run_past_a_stalled_fetch(kafka, quick_checks):
    """The gateway's run registry reads the runs topic to its end on every lookup: a
    stalled fetch held every request that looks a run up, for ever."""
    registry = RunRegistry(kafka)
    try:
        assert registry.get("late") is None
        stalled = _stall(registry._connect())
        with RolloutPublisher(kafka) as publisher:
            publisher.run_started("late", {"n_samples_per_prompt": 2, "rollout_batch_size": 1})
        assert registry.get("late") is not None
        assert registry._connect().consumer is not stalled
    finally:
        registry.close()


def test_reading_to_the_end_past_a_stalled_fetch_gets_every_partition_once(kafka, quick_checks):
    topic = kafka.topics.events  # several partitions
    assert kafka.event_partitions > 1
    sent = {p: [f"{p}-{i}".encode() for i in range(3)] for p in range(kafka.event_partitions)}
    for partition, values in sent.items():
        _send(kafka, topic, values[:1], partition)
    reader = PartitionReader(kafka, [topic], what="test reader")
    try:
        first = list(reader.read_to_end(timeout_s=60))
        stalled = _stall(reader)
        for partition, values in sent.items():
            _send(kafka, topic, values[1:], partition)
        rest = list(reader.read_to_end(timeout_s=60))
        assert reader.consumer is not stalled
    finally:
        reader.close()
    got = {p: [r.value for r in first + rest if r.partition == p] for p in sent}
    assert got == sent


def test_a_reader_at_the_end_returns_without_waiting_out_a_poll(kafka):
    """The gateway reads the runs topic to its end on every lookup: with nothing new, the
    lookup must not wait for a poll's timeout."""
    topic = kafka.topics.control
    _send(kafka, topic, [b"a"])
    reader = PartitionReader(kafka, [topic], what="test reader")
    try:
        assert [r.value for r in reader.read_to_end(timeout_s=60)] == [b"a"]
        polls = []
        poll = reader.consumer.poll
        reader.consumer.poll = lambda *args, **kwargs: polls.append(1) or poll(*args, **kwargs)
        assert list(reader.read_to_end(timeout_s=60)) == []
        assert polls == []
    finally:
        reader.close()


def test_reading_to_the_end_gives_up_with_an_error_naming_the_reader(kafka, quick_checks,
                                                                     monkeypatch):
    """A fetch that stays stalled (no replacement here) ends in a clear error, not a wait
    for ever."""
    monkeypatch.setattr(kafka_module, "STALLED_CHECKS", 10**9)
    topic = kafka.topics.control
    _send(kafka, topic, [b"a"])
    reader = PartitionReader(kafka, [topic], what="test reader")
    try:
        _stall(reader)
        with pytest.raises(TimeoutError, match=f"test reader: could not read {topic} to the end "
                                               "within 2 s"):
            list(reader.read_to_end(timeout_s=2))
    finally:
        reader.close()


def test_a_prompt_cursor_log_that_cannot_be_read_in_time_is_unavailable(kafka, monkeypatch):
    monkeypatch.setattr(wal, "WAL_READ_LIMIT_S", 0.0)
    with RolloutPublisher(kafka) as publisher:
        publisher.group_started("slow", group_index=0, step=0, n_samples=1, prompt="p")
    with pytest.raises(UnavailableError, match=f"reading {kafka.topics.events} to restore run "
                                               "'slow' took over 0 s"):
        wal.read_group_log(kafka, kafka.topics.events, "slow", {})


def test_a_run_lookup_that_cannot_read_the_runs_topic_in_time_is_a_clear_503(kafka, monkeypatch):
    monkeypatch.setattr(runs_module, "READ_LIMIT_S", 0.0)
    registry = RunRegistry(kafka)
    try:
        with pytest.raises(BrokerUnavailableError, match=f"could not read {kafka.topics.runs}: "
                                                         "not read to the end within 0 s"):
            registry.get("any")
    finally:
        registry.close()


def test_a_catch_up_past_its_time_goes_on_and_reads_the_rest_later(kafka, monkeypatch, caplog):
    """At start a stage reads the runs topic for at most CATCH_UP_S, then goes on: a run
    it has not read yet is read by its next refresh."""
    with RolloutPublisher(kafka) as publisher:
        publisher.run_started("early", {"n_samples_per_prompt": 2, "rollout_batch_size": 1})
    monkeypatch.setattr(run_configs_module, "CATCH_UP_S", 0.0)
    configs = RunConfigs(kafka)
    try:
        configs.catch_up()
        assert f"runs topic: could not read {kafka.topics.runs} to the end within 0 s" \
            in caplog.text
        deadline = time.monotonic() + 30
        while "early" not in configs.configs and time.monotonic() < deadline:
            configs.refresh(timeout_ms=200)
        assert configs.configs["early"].n_samples_per_prompt == 2
    finally:
        configs.close()
