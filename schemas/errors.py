"""The platform's one exception hierarchy.

Bad input is data (it becomes a dead letter or an HTTP 4xx); infrastructure failure
propagates and a restart resumes from the Delta transaction versions. Every error a user
can see derives from `RolloutlakeError`, whose message is one readable line.
"""

from __future__ import annotations


class RolloutlakeError(Exception):
    """Base of every error rolloutlake raises on purpose."""


class ConfigError(RolloutlakeError):
    """A service or run configuration is invalid; the message names the field."""


class EventValidationError(RolloutlakeError):
    """An event does not satisfy CONTRACT section 2; the message names event and field."""

    def __init__(self, message: str, *, field: str | None = None, event_type: str | None = None):
        super().__init__(message)
        self.field = field
        self.event_type = event_type


class EventTooLargeError(RolloutlakeError):
    """An encoded event exceeds the configured maximum message size."""


class BrokerUnavailableError(RolloutlakeError):
    """The Kafka bootstrap servers could not be reached."""


class BrokerStartError(RolloutlakeError):
    """The embedded broker could not be started (binary missing, port taken, ...)."""


class FilterLoadError(RolloutlakeError):
    """A dotted path to user code (filter, reducer, reward function) names no callable."""


class BatchVerificationError(RolloutlakeError):
    """A sealed batch read from Delta does not match its recorded hash or version."""
