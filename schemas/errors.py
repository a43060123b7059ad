"""The platform's one exception hierarchy.

Bad input is data (it becomes a dead letter or an HTTP 4xx); infrastructure failure
propagates and a restart resumes from the Delta transaction versions. Every error a user
can see derives from `RolloutlakeError`, whose message is one readable line.
"""

from __future__ import annotations

from typing import Any


class RolloutlakeError(Exception):
    """Base of every error rolloutlake raises on purpose."""


class RequestError(RolloutlakeError):
    """What a service answers a request with when it cannot do it: one readable line and
    `details`, structured fields for the caller (`field`, `bad_lines`, ...). Services
    raise the subclasses below; the gateway turns each into its HTTP status in one place
    (`gateway.app`), so no service speaks HTTP."""

    def __init__(self, message: str, **details: Any):
        super().__init__(message)
        self.details = details


class NotFoundError(RequestError):
    """Something the request names (a run, dataset, step, group) does not exist."""


class ConflictError(RequestError):
    """The request does not fit the current state (a run without a dataset, a cursor that
    another writer moved); retrying, or fixing the state first, helps."""


class InvalidInputError(RequestError):
    """The request's input breaks a rule its schema cannot state; the message names it."""


class UnsupportedFormatError(InvalidInputError):
    """The input is in a format rolloutlake does not read (a file type, a media type)."""


class UnavailableError(RequestError):
    """Something the request needs cannot be read now (an outage, a read that took too
    long, data gone past Kafka retention)."""


class InconsistentStateError(RequestError):
    """Stored state contradicts itself (a checkpoint and its log disagree); retrying does
    not help, an operator has to look."""


class ConfigError(RolloutlakeError):
    """A service or run configuration is invalid; the message names the field."""


class EventValidationError(RolloutlakeError):
    """An event does not satisfy CONTRACT section 2; the message names event and field."""

    def __init__(self, message: str, *, field: str | None = None, event_type: str | None = None):
        super().__init__(message)
        self.field = field
        self.event_type = event_type


class EventTooLargeError(InvalidInputError):
    """An encoded event exceeds the configured maximum message size."""


class BrokerUnavailableError(UnavailableError):
    """The Kafka bootstrap servers could not be reached."""


class AccessRefusedError(BrokerUnavailableError):
    """The broker answers but its ACLs refuse this client's principal a topic or consumer
    group: an operator's to fix. A command stops on it; a server answers 503 until the
    ACLs are granted."""


class BrokerStartError(RolloutlakeError):
    """The embedded broker could not be started (binary missing, port taken, ...)."""


class FilterLoadError(RolloutlakeError):
    """A dotted path to user code (filter, reducer, reward function) names no callable."""


class BatchVerificationError(RolloutlakeError):
    """A sealed batch read from Delta does not match its recorded hash or version."""


# kafka-python's refusals by the broker's ACLs, by class name (this module imports no
# client), and what each one refuses.
_REFUSED_RESOURCE = {"TopicAuthorizationFailedError": "topic",
                     "GroupAuthorizationFailedError": "consumer group",
                     "ClusterAuthorizationFailedError": "the cluster"}


def refused_resource(err: Exception) -> str:
    """What a broker's ACLs refused, in words ("topic a.rollout.runs"), from kafka-python's
    authorization error, whose arguments name the topics or the group."""
    names = sorted(str(name) for arg in err.args
                   for name in (arg if isinstance(arg, set | list | tuple) else [arg]))
    kind = _REFUSED_RESOURCE.get(type(err).__name__, "a resource")
    return " ".join([kind, ", ".join(names)]).strip()
