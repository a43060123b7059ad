"""Shared fixtures: one embedded Tansu broker per test session, fresh topics per test."""

from __future__ import annotations

import uuid

import pytest

from ingest.broker import EmbeddedBroker, free_port
from ingest.kafka_io import KafkaSettings


@pytest.fixture(scope="session")
def broker():
    """A real Kafka-compatible broker (Tansu) on a free loopback port."""
    with EmbeddedBroker(free_port()) as running:
        yield running


@pytest.fixture
def kafka(broker) -> KafkaSettings:
    """Kafka settings with a topic prefix of this test's own, topics created."""
    settings = KafkaSettings(
        bootstrap_servers=broker.bootstrap_servers,
        topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
        event_partitions=2,
        decision_partitions=1,
    )
    settings.ensure_topics()
    return settings


@pytest.fixture
def lake_root(tmp_path) -> str:
    return str(tmp_path / "lake")
