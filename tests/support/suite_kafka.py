"""Kafka settings for the suite's own clients against its healthy embedded brokers."""

from __future__ import annotations

from typing import Any

from ingest.io.kafka import KafkaSettings

# The suite runs three workers beside two brokers on two cores: a broker can stay silent
# for seconds (CI: a test's first consumer gave up after the product's 5 s default). A test
# of an unreachable broker builds its settings with its own, short, timeout. A request
# can wait as long: CI saw a topic creation time out after 30 s, 29 of them with the
# machine standing still.
SUITE_BOOTSTRAP_TIMEOUT_MS = 30_000
SUITE_REQUEST_TIMEOUT_MS = 60_000
# A JVM broker starting beside the suite's other work can take over the 60 s a user's
# start waits (the machine's freezes last up to 17 s at a time).
SUITE_BROKER_START_S = 180.0


def suite_kafka(bootstrap_servers: str, **fields: Any) -> KafkaSettings:
    fields.setdefault("bootstrap_timeout_ms", SUITE_BOOTSTRAP_TIMEOUT_MS)
    fields.setdefault("request_timeout_ms", SUITE_REQUEST_TIMEOUT_MS)
    return KafkaSettings(bootstrap_servers=bootstrap_servers, **fields)
