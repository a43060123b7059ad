"""Shared fixtures: one embedded broker per engine and test session, fresh topics per test.

Every test that uses `broker` or `kafka` runs once on Tansu and once on Apache Kafka
(`-k tansu` or `-k kafka` selects one engine).
"""

from __future__ import annotations

import uuid

import pytest

from ingest.broker import ENGINES, EmbeddedBroker, free_port
from ingest.kafka_io import KafkaSettings


@pytest.fixture(scope="session", params=ENGINES)
def broker(request):
    """A real broker of each engine on a free loopback port; failing to start fails the test."""
    with EmbeddedBroker(free_port(), engine=request.param) as running:
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
