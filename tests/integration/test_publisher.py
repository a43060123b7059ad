"""The producer SDK against the real broker: validation first, size limit, keying."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
from kafka.errors import KafkaTimeoutError
from kafka.producer.future import FutureProduceResult, FutureRecordMetadata
from kafka.structs import TopicPartition

from ingest.io.broker import ENGINES, EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings, read_topics
from ingest.sdk.publisher import RolloutPublisher
from schemas.errors import BrokerUnavailableError, EventTooLargeError, EventValidationError
from schemas.events import AnyEvent, decode_event
from tests.support.gateway_support import consume_all
from tests.support.suite_kafka import SUITE_BROKER_START_S


def test_events_are_keyed_by_group_and_roundtrip(kafka):
    with RolloutPublisher(kafka) as pub:
        pub.run_started("run-a", {"n_samples_per_prompt": 2, "rollout_batch_size": 1})
        pub.group_started("run-a", group_index=7, step=0, n_samples=2, prompt="hi")
        pub.sample_finished("run-a", group_index=7, rollout_id=0, status="completed",
                            prompt_tokens=[1, 2], response_tokens=[3], reward=0)
        pub.reward("run-a", group_index=7, rollout_id=1, reward=None)
    events = consume_all(kafka, kafka.topics.events)
    assert {r.key for r in events} == {b"run-a:7"}
    assert len({r.partition for r in events}) == 1
    decoded = [decode_event(r.value) for r in events]
    assert [e.type for e in decoded] == ["group_started", "sample_finished", "reward"]
    assert decoded[1].reward == 0 and isinstance(decoded[1].reward, int)
    assert decoded[2].reward is None
    runs = consume_all(kafka, kafka.topics.runs)
    assert runs[0].key == b"run-a"
    assert orjson.loads(runs[0].value)["config"]["rollout_batch_size"] == 1


def test_invalid_event_is_refused_before_sending(kafka):
    with RolloutPublisher(kafka) as pub:
        with pytest.raises(EventValidationError, match="loss_mask"):
            pub.sample_finished("run-b", group_index=0, rollout_id=0, status="completed",
                                prompt_tokens=[1], response_tokens=[1, 2], loss_mask=[1])
        with pytest.raises(EventValidationError, match="status"):
            pub.sample_finished("run-b", group_index=0, rollout_id=0, status="done",
                                prompt_tokens=[1], response_tokens=[1])
    assert consume_all(kafka, kafka.topics.events) == []


def test_eight_mib_event_passes_and_larger_is_refused(kafka):
    # the SDK sends int32 tokens in base64, 16/3 bytes each: about 7.93 MiB of JSON
    tokens = 1_560_000
    with RolloutPublisher(kafka) as pub:
        event = pub.sample_finished("run-c", group_index=0, rollout_id=0, status="truncated",
                                    prompt_tokens=[1], response_tokens=[100000] * tokens, reward=1.0)
        with pytest.raises(EventTooLargeError, match="limit is 8388608 bytes"):
            pub.sample_finished("run-c", group_index=1, rollout_id=0, status="truncated",
                                prompt_tokens=[1], response_tokens=[100000] * (tokens + 20_000))
    records = consume_all(kafka, kafka.topics.events)
    assert len(records) == 1
    assert 8_000_000 < len(records[0].value) <= 8 * 1024 * 1024
    assert decode_event(records[0].value).event_id == event.event_id


def test_closing_on_a_dead_broker_reports_the_unsent_events_and_returns():
    """The close flushes for 30 s and says what was not acknowledged; kafka-python's own
    close then waited for its 120 s delivery timeout on the events it kept retrying."""
    broker = EmbeddedBroker(free_port()).start(SUITE_BROKER_START_S)
    try:
        pub = RolloutPublisher(KafkaSettings(bootstrap_servers=broker.bootstrap_servers,
                                             topic_prefix="dead."))
        pub.run_started("run-d", {"n_samples_per_prompt": 1, "rollout_batch_size": 1})
        pub.flush()
        os.kill(broker.process.pid, signal.SIGKILL)
        pub.group_started("run-d", group_index=0, step=0, n_samples=1, prompt="hi")
        closing = time.monotonic()
        with pytest.raises(BrokerUnavailableError, match="events not acknowledged by the broker within 30 s"):
            pub.close()
        assert time.monotonic() - closing < 60
    finally:
        broker.stop()


def test_leaving_the_block_on_an_unacknowledged_event_does_not_wait_again():
    """The flush that raised waited its 30 s; the close on the way out of the `with` block
    waited another 30 s for the same sends and raised the same error over the first."""
    broker = EmbeddedBroker(free_port()).start(SUITE_BROKER_START_S)
    try:
        settings = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="gone.")
        with pytest.raises(BrokerUnavailableError) as raised:  # noqa: PT012 - the block's exit
            with RolloutPublisher(settings) as pub:
                pub.run_started("run-g", {"n_samples_per_prompt": 1, "rollout_batch_size": 1})
                pub.flush()
                os.kill(broker.process.pid, signal.SIGKILL)
                pub.group_started("run-g", group_index=0, step=0, n_samples=1, prompt="hi")
                try:
                    pub.flush(timeout_s=2)
                finally:
                    leaving = time.monotonic()
        assert time.monotonic() - leaving < 10
        assert str(raised.value) == "events not acknowledged by the broker within 2 s"
    finally:
        broker.stop()


def test_a_failed_send_is_reported_by_the_next_flush_however_many_sends_follow(kafka):
    """Past 10,000 tracked sends the publisher forgets those that completed. It forgot the
    failed ones too, and the flush after them passed though an event was never published.
    The failure stands for a record kafka-python gave up (its delivery timeout); the
    10,001 sends after it are real."""
    pub = RolloutPublisher(kafka)
    try:
        given_up = FutureProduceResult(TopicPartition(kafka.topics.events, 0))
        pub._pending.append((FutureRecordMetadata(given_up, 0, -1, None, 1, 1, -1), None))
        given_up.failure(KafkaTimeoutError("Expiring 1 record(s): delivery timeout"))
        for index in range(10_001):
            pub.send_raw(kafka.topics.events, b"k", str(index).encode())
        with pytest.raises(BrokerUnavailableError,
                           match="events not acknowledged by the broker: KafkaTimeoutError"):
            pub.flush()
        pub.flush()  # reported once: the sends after it were all acknowledged
    finally:
        pub.close()
    # Tansu under-reports the end offset of a multi-record batch: read until quiet too.
    events = read_topics(kafka, [kafka.topics.events], what="test", timeout_s=60, quiet_ms=1000)
    assert len(events) == 10_001


@pytest.mark.parametrize("engine", ENGINES)
def test_a_publisher_with_a_grace_rides_out_a_broker_restart(engine):
    """Events the broker had not acknowledged when it went, and those sent while it was
    away, are published once it is back: a new producer sends them again. Without the grace
    the flush raised on Tansu, which stopped a worker at the first restart of its broker
    (the producer that lived through Apache Kafka's restart here sent again by itself)."""
    port = free_port()
    broker = EmbeddedBroker(port, engine=engine).start(SUITE_BROKER_START_S)
    settings = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="back.",
                             request_timeout_ms=2000)
    try:
        with RolloutPublisher(settings, outage_grace_s=120) as pub:
            pub.run_started("run-r", {"n_samples_per_prompt": 1, "rollout_batch_size": 1})
            pub.flush()
            broker.stop()

            def publish_while_away() -> list[AnyEvent]:
                sent = [pub.group_started("run-r", group_index=index, step=0, n_samples=1,
                                          prompt="hi") for index in range(20)]
                pub.flush(timeout_s=2)
                return sent

            # The broker is started by this thread, which it dies with.
            with ThreadPoolExecutor(1) as away:
                publishing = away.submit(publish_while_away)
                time.sleep(3)
                broker = EmbeddedBroker(port, engine=engine).start(SUITE_BROKER_START_S)
                settings.ensure_topics()  # as a broker with storage would still hold them
                sent = publishing.result()
        published = {decode_event(r.value).event_id
                     for r in consume_all(settings, settings.topics.events)}
        assert {event.event_id for event in sent} <= published
    finally:
        broker.stop()


def test_a_publisher_whose_broker_stays_away_gives_up_after_its_grace_and_recovers():
    """The flush raises once the grace has passed, naming it; the publisher, whose producer
    the ride-out closed, sends again with a new one once a broker answers."""
    port = free_port()
    broker = EmbeddedBroker(port).start(SUITE_BROKER_START_S)
    settings = KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix="away.",
                             bootstrap_timeout_ms=500)
    try:
        with RolloutPublisher(settings, outage_grace_s=3) as pub:
            pub.run_started("run-w", {"n_samples_per_prompt": 1, "rollout_batch_size": 1})
            pub.flush()
            os.kill(broker.process.pid, signal.SIGKILL)
            pub.group_started("run-w", group_index=0, step=0, n_samples=1, prompt="hi")
            flushing = time.monotonic()
            with pytest.raises(BrokerUnavailableError) as raised:
                pub.flush(timeout_s=1)
            assert time.monotonic() - flushing < 15
            assert str(raised.value) == ("events not acknowledged by the broker within 1 s, "
                                         "nor by a new producer within 3 s")
            broker.stop()
            broker = EmbeddedBroker(port).start(SUITE_BROKER_START_S)
            again = pub.group_started("run-w", group_index=1, step=0, n_samples=1, prompt="hi")
            pub.flush()
        published = [decode_event(r.value).event_id
                     for r in consume_all(settings, settings.topics.events)]
        assert published == [again.event_id]  # the restarted broker holds no earlier event
    finally:
        broker.stop()
