"""The embedded broker's readiness probe while nothing listens yet."""

from __future__ import annotations

import logging

from ingest.io.broker import _answers, free_port


def test_probe_of_a_port_nobody_listens_on_is_silent(caplog):
    caplog.set_level(logging.DEBUG, logger="kafka")
    assert _answers(f"127.0.0.1:{free_port()}") is False
    # kafka-python would log each refused connection as an ERROR on the user's terminal.
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
