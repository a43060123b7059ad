"""kafka-python's own log lines stay at the level the command chose after a client is built."""

from __future__ import annotations

import logging

from ingest.io.kafka import _connection_errors


def test_the_connection_window_leaves_kafka_loggers_as_quiet_as_before():
    kafka_log = logging.getLogger("kafka")
    selector = logging.getLogger("kafka.net.selector")
    saved = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    try:
        with _connection_errors() as seen:
            # a line logged while a client bootstraps is collected for the error message
            selector.warning("Task ran for 5.2s")
        assert seen == ["Task ran for 5.2s"]
        # and afterwards nothing below CRITICAL gets through again (a cached answer of the
        # window's WARNING level let a loaded host's slow-task warnings reach users)
        assert not selector.isEnabledFor(logging.WARNING)
        assert kafka_log.propagate
    finally:
        kafka_log.setLevel(saved)
