"""Shared fixtures: one embedded broker per engine and test session, fresh topics per test.

Every test that uses `broker` or `kafka` runs once on Tansu and once on Apache Kafka (its
id carries `tansu` or `kafka`); a broker that does not start fails those tests. A module
marked `one_broker` tests something else through the broker (the inference engine, Spark,
an object store) and runs on the default engine only, to keep the suite's time; one marked
`one_broker(..., engine="kafka")` tests a behaviour only that engine has.
`ROLLOUTLAKE_TEST_BROKERS=tansu` (a comma list) narrows a local run to some engines.
"""

from __future__ import annotations

import logging
import os
import uuid

import pytest

from ingest.io.broker import ENGINES, EmbeddedBroker, free_port
from ingest.io.kafka import KafkaSettings
from tests.support.suite_kafka import SUITE_BROKER_START_S, suite_kafka


def pytest_configure(config):
    # The suite logs at INFO so that a failure shows the stages' own lines; kafka-python's
    # INFO lines (every connection opened and closed) would push those out of view.
    logging.getLogger("kafka").setLevel(logging.WARNING)
    config.addinivalue_line(
        "markers", "one_broker(reason, engine=default): runs on one broker engine only")


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("one_broker")
        engine = ENGINES[0] if marker is None else marker.kwargs.get("engine", ENGINES[0])
        on_other_engine = getattr(item, "callspec", None) is not None and \
            item.callspec.params.get("broker", engine) != engine
        (dropped if on_other_engine and marker is not None else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _engines_under_test() -> list[str]:
    wanted = os.environ.get("ROLLOUTLAKE_TEST_BROKERS")
    if not wanted:
        return list(ENGINES)
    engines = [name.strip() for name in wanted.split(",") if name.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise pytest.UsageError(f"ROLLOUTLAKE_TEST_BROKERS={wanted!r}: engines are {ENGINES}")
    return engines


@pytest.fixture(scope="session", params=_engines_under_test())
def broker(request):
    """A real broker of each engine on a free loopback port; failing to start fails the test."""
    with EmbeddedBroker(free_port(), engine=request.param).start(SUITE_BROKER_START_S) as running:
        yield running


@pytest.fixture
def kafka(broker) -> KafkaSettings:
    """Kafka settings with a topic prefix of this test's own, topics created."""
    settings = suite_kafka(
        broker.bootstrap_servers,
        topic_prefix=f"t{uuid.uuid4().hex[:10]}.",
        event_partitions=2,
        decision_partitions=1,
    )
    settings.ensure_topics()
    return settings


@pytest.fixture
def lake_root(tmp_path) -> str:
    return str(tmp_path / "lake")
