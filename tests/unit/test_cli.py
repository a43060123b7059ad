"""The CLI's last line of defence: a broker's ACL refusal that a command let through is one
line naming what was refused; any other error still raises."""

import pytest
from kafka.errors import (
    GroupAuthorizationFailedError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
)

from ingest import cli


def _raising(error: Exception):
    class Command:
        @staticmethod
        def add_arguments(parser):
            pass

        @staticmethod
        def run(args):
            raise error

    return Command


def _main_raising(monkeypatch, error: Exception) -> int:
    monkeypatch.setitem(cli.COMMANDS, "raises", ("raises", "a command that raises"))
    monkeypatch.setattr(cli, "_load", lambda name: _raising(error))
    return cli.main(["raises"])


def test_a_refused_topic_is_one_line_naming_it(monkeypatch, capsys):
    refused = TopicAuthorizationFailedError({"p.rollout.decisions", "p.rollout.control"})
    assert _main_raising(monkeypatch, refused) == 2
    assert capsys.readouterr().err == (
        "rolloutlake raises: the Kafka broker refuses access to topic p.rollout.control, "
        'p.rollout.decisions (the ACLs each service needs: docs/kafka-security.md, "ACLs")\n')


def test_a_refused_consumer_group_is_one_line_naming_it(monkeypatch, capsys):
    assert _main_raising(monkeypatch, GroupAuthorizationFailedError("p.rolloutlake-groups")) == 2
    assert "refuses access to consumer group p.rolloutlake-groups (" in capsys.readouterr().err


def test_another_kafka_error_is_not_taken_for_a_refusal(monkeypatch):
    with pytest.raises(KafkaTimeoutError):
        _main_raising(monkeypatch, KafkaTimeoutError("no answer"))
