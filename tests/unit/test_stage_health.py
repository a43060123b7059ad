"""The stage's own view of the broker and its consumer group (pure state, a fake clock)."""

from __future__ import annotations

import logging

import pytest

from ingest.io.kafka import KafkaSettings
from ingest.processor.health import StageHealth
from schemas.errors import BrokerUnavailableError, RolloutlakeError


def health(**overrides) -> StageHealth:
    fields = dict(role="groups", group_id="g-groups", bootstrap_servers="b:9092",
                  broker_timeout_s=10.0, join_timeout_s=20.0, started_at=0.0)
    return StageHealth(**{**fields, **overrides})


def test_a_lost_broker_is_reported_once_then_ends_the_stage(caplog):
    h = health()
    h.joined([0])
    caplog.set_level(logging.INFO, logger="ingest.processor.health")
    caplog.clear()
    h.observe_broker(False, 100.0)
    assert h.state == "running"  # one poll without a connection is a reconnect
    for now in (101.0, 102.0, 105.0, 109.9):
        h.observe_broker(False, now)
    assert h.state == "broker-unreachable"
    assert [r.getMessage() for r in caplog.records] == [
        "groups stage: broker at b:9092 is unreachable; retrying for 10 s"]
    with pytest.raises(BrokerUnavailableError, match="no Kafka broker answered at b:9092 for 10 s"):
        h.observe_broker(False, 110.0)


def test_a_broker_back_in_time_resets_the_clock():
    h = health()
    h.joined([0])
    h.observe_broker(False, 0.0)
    h.observe_broker(False, 9.0)
    h.observe_broker(True, 9.5)
    assert h.state == "running" and h.unreachable_since is None
    h.observe_broker(False, 12.0)
    h.observe_broker(False, 21.0)  # 9 s of this outage: not yet given up
    assert h.state == "broker-unreachable"


def test_a_slow_join_is_reported_then_given_up(caplog):
    h = health()
    caplog.set_level(logging.INFO, logger="ingest.processor.health")
    h.observe_join(False, 2.0)
    assert caplog.records == []
    h.observe_join(False, 6.0)
    h.observe_join(False, 7.0)  # reported once per REPORT_EVERY_S
    assert [r.getMessage() for r in caplog.records] == [
        "groups stage: waiting to join consumer group g-groups (6 s so far)"]
    with pytest.raises(RolloutlakeError, match="could not join consumer group g-groups within 20 s"):
        h.observe_join(False, 20.0)
    h.observe_join(True, 30.0)  # joined: nothing to say


def test_the_runs_topic_is_created_compacted():
    plan = {t.name: t for t in KafkaSettings(topic_prefix="p.").topic_plan()}
    assert plan["p.rollout.runs"].topic_configs == {"cleanup.policy": "compact"}
    assert plan["p.rollout.events"].topic_configs == {}
