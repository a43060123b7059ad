"""kafka-python's own log lines stay at the level the command chose after a client is built."""

from __future__ import annotations

import logging
import threading

from ingest.io.kafka import _connection_errors, _last_connection_error


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


def test_two_stages_building_clients_at_once_leave_the_kafka_logger_as_it_was():
    """Both stages build their consumers at the same time: overlapping windows restored
    the logger to the other window's setting, and kafka-python's lines went missing."""
    kafka_log = logging.getLogger("kafka")
    saved = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)
    first_inside, second_inside, first_done = (threading.Event() for _ in range(3))

    def second() -> None:
        first_inside.wait()
        with _connection_errors():
            second_inside.set()
            first_done.wait(5)  # this client's bootstrap outlasts the first one's

    thread = threading.Thread(target=second)
    thread.start()
    try:
        with _connection_errors():
            first_inside.set()
            second_inside.wait(0.3)  # the second client's bootstrap begins meanwhile
        first_done.set()
        thread.join(5)
        assert kafka_log.level == logging.CRITICAL and kafka_log.propagate
    finally:
        kafka_log.setLevel(saved)
        kafka_log.propagate = True


def test_a_failed_bootstrap_names_the_last_connection_error_kafka_python_logged():
    """A broker too slow to finish a TLS handshake or SASL login is not a closed port: the
    one-line error says which, from the lines kafka-python logged while it retried."""
    refused = ["Bootstrap bootstrap-0 not ready; waiting 0.12 secs",
               "Bootstrap connection to bootstrap-0 failed: KafkaConnectionError: "
               "111 ECONNREFUSED (backoff 0.12 secs)",
               "Bootstrap bootstrap-0 not ready; waiting 0.45 secs"]
    assert _last_connection_error(refused) == "KafkaConnectionError: 111 ECONNREFUSED"
    slow = [*refused, "Connection failed: KafkaTimeoutError: SASL Authentication timed out"]
    assert _last_connection_error(slow) == "KafkaTimeoutError: SASL Authentication timed out"
    gave_up = [*refused, "Bootstrap failed: KafkaTimeoutError: Unable to bootstrap from "
                         "['127.0.0.1:1']"]
    assert _last_connection_error(gave_up) == "KafkaConnectionError: 111 ECONNREFUSED"
    assert _last_connection_error(["Bootstrap bootstrap-0 not ready; waiting 1.49 secs"]) is None
