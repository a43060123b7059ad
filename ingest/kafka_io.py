"""Kafka plumbing shared by every service: topic names, client settings, topic creation.

All clients are kafka-python. Sizes are raised so 8 MiB events pass end to end; topics are
created explicitly because brokers such as Tansu auto-create unknown topics with one
partition.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError
from pydantic import BaseModel, ConfigDict, Field

from schemas.errors import BrokerUnavailableError

log = logging.getLogger(__name__)

MAX_EVENT_BYTES = 8 * 1024 * 1024
# Record batches carry headers and framing on top of the value.
MAX_REQUEST_BYTES = MAX_EVENT_BYTES + 1024 * 1024


@dataclass(frozen=True)
class Topics:
    """Topic names of CONTRACT section 1, optionally behind a prefix (one per test or tenant)."""

    runs: str = "rollout.runs"
    events: str = "rollout.events"
    decisions: str = "rollout.decisions"
    control: str = "rollout.control"
    deadletter: str = "rollout.deadletter"

    @classmethod
    def with_prefix(cls, prefix: str) -> Topics:
        base = cls()
        return cls(**{name: f"{prefix}{value}" for name, value in base.__dict__.items()})


class KafkaSettings(BaseModel):
    """How a service reaches Kafka."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap_servers: Annotated[str, Field(min_length=1)] = "127.0.0.1:9092"
    """Comma-separated `host:port` list of the Kafka (or Tansu) brokers."""
    topic_prefix: str = ""
    """Prefix for every topic name, so several deployments or tests share one broker."""
    event_partitions: Annotated[int, Field(ge=1, le=1024)] = 4
    """Partitions of `rollout.events` when rolloutlake creates it."""
    decision_partitions: Annotated[int, Field(ge=1, le=1024)] = 2
    """Partitions of `rollout.decisions` (keyed by run) when rolloutlake creates it."""
    compression: str | None = "lz4"
    """Producer compression codec (`lz4`, `gzip`, or None)."""
    request_timeout_ms: Annotated[int, Field(ge=1000)] = 30000
    bootstrap_timeout_ms: Annotated[int, Field(ge=100)] = 5000
    """How long a client waits for the first broker answer before giving up."""

    @property
    def topics(self) -> Topics:
        return Topics.with_prefix(self.topic_prefix)

    def servers(self) -> list[str]:
        return [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()]

    def producer(self, **overrides: Any) -> KafkaProducer:
        options: dict[str, Any] = dict(
            bootstrap_servers=self.servers(),
            acks="all",
            enable_idempotence=True,
            compression_type=self.compression,
            max_request_size=MAX_REQUEST_BYTES,
            linger_ms=5,
            batch_size=1024 * 1024,
            request_timeout_ms=self.request_timeout_ms,
        )
        options.update(overrides)
        return self._connect(KafkaProducer, options)

    def consumer(self, **overrides: Any) -> KafkaConsumer:
        options: dict[str, Any] = dict(
            bootstrap_servers=self.servers(),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_bytes=64 * 1024 * 1024,
            max_partition_fetch_bytes=MAX_REQUEST_BYTES,
            fetch_max_wait_ms=50,  # latency: a seal waits on every hop's fetch
            request_timeout_ms=self.request_timeout_ms,
        )
        options.update(overrides)
        return self._connect(KafkaConsumer, options)

    def admin(self) -> KafkaAdminClient:
        options = dict(bootstrap_servers=self.servers(), request_timeout_ms=self.request_timeout_ms)
        return self._connect(KafkaAdminClient, options)

    def _connect(self, client: type, options: dict[str, Any]) -> Any:
        options.setdefault("bootstrap_timeout_ms", self.bootstrap_timeout_ms)
        try:
            return client(**options)
        except KafkaError as err:
            raise BrokerUnavailableError(
                f"no Kafka broker answers at {self.bootstrap_servers} ({type(err).__name__})"
            ) from None

    def topic_plan(self) -> list[NewTopic]:
        """The contract topics as rolloutlake creates them.

        `rollout.runs` is compacted (keyed by run): a run's latest `run_started` stays
        however long the run lasts, whatever the retention of the other topics.
        """
        topics = self.topics
        compacted = {"cleanup.policy": "compact"}
        return [
            NewTopic(topics.runs, 1, 1, topic_configs=compacted),
            NewTopic(topics.events, self.event_partitions, 1),
            NewTopic(topics.decisions, self.decision_partitions, 1),
            NewTopic(topics.control, 1, 1),
            NewTopic(topics.deadletter, 1, 1),
        ]

    def ensure_topics(self) -> Topics:
        """Create the contract topics (`topic_plan`) that are missing."""
        admin = self.admin()
        try:
            existing = set(admin.list_topics())
            missing = [topic for topic in self.topic_plan() if topic.name not in existing]
            for topic in missing:
                try:
                    admin.create_topics([topic])
                except TopicAlreadyExistsError:
                    pass
        except KafkaError as err:
            raise BrokerUnavailableError(
                f"could not create topics on {self.bootstrap_servers}: {err}"
            ) from None
        finally:
            admin.close()
        return self.topics
