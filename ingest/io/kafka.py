"""Kafka plumbing shared by every service: topic names, client settings, topic creation.

All clients are kafka-python. Sizes are raised so 8 MiB events pass end to end; topics are
created explicitly because brokers such as Tansu auto-create unknown topics with one
partition. A secured Kafka (TLS, SASL PLAIN or SCRAM) is configured on `KafkaSettings`, or
through `ROLLOUTLAKE_KAFKA_*` environment variables that every service reads the same way
(docs/kafka-security.md); secrets are `SecretStr`, never logged.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import (
    AuthorizationError,
    ClusterAuthorizationFailedError,
    KafkaError,
    KafkaTimeoutError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
)
from kafka.partitioner.default import murmur2
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from ingest.io.kafka_transport import deliver_bytes_before_close
from schemas.errors import (
    AccessRefusedError,
    BrokerUnavailableError,
    RolloutlakeError,
    refused_resource,
)

log = logging.getLogger(__name__)

deliver_bytes_before_close()  # every client is built through this module

MAX_EVENT_BYTES = 8 * 1024 * 1024
# Record batches carry headers and framing on top of the value.
MAX_REQUEST_BYTES = MAX_EVENT_BYTES + 1024 * 1024

SECURITY_ENV_PREFIX = "ROLLOUTLAKE_KAFKA_"
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
# Settings a deployment gives through the environment rather than flags; a `_FILE` variant
# of each secret names a file holding it (Docker and Kubernetes secrets).
SECURITY_FIELDS = ("security_protocol", "sasl_mechanism", "sasl_username", "sasl_password",
                   "ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_key_password",
                   "ssl_check_hostname")
SECRET_FIELDS = ("sasl_password", "ssl_key_password")


def fetch_position(consumer: KafkaConsumer, tp: Any) -> int | None:
    """The next offset `consumer` fetches of its assigned `tp`, None until it is known.

    Read from the consumer's subscription state: `position()` may send a request and
    block, and kafka-python has no public view of the state without one.
    """
    state = consumer._subscription.assignment.get(tp)
    return None if state is None or state.position is None else state.position.offset


def subscribe_once_listed(consumer: KafkaConsumer, topic: str, listener: Any = None, *,
                          timeout_s: float) -> None:
    """Subscribe `consumer` to `topic` once its metadata lists the topic's partitions.

    Subscribed before, the first join (immediate on Apache Kafka) assigns nothing, and the
    rebalance that follows the metadata update can complete after `poll` returned:
    kafka-python then never applies that assignment and the member waits forever.
    Subscribed after, the coordinator still takes its snapshot of the subscribed topics'
    partitions only from the next metadata response, which can come after the first
    join: the member is then assigned its partitions, finds the snapshot changed and
    rebalances at once, with the same risk. The snapshot is taken here, from the metadata
    that listed the topic.
    """
    deadline = time.monotonic() + timeout_s
    while not consumer.partitions_for_topic(topic):
        if time.monotonic() > deadline:
            raise RolloutlakeError(
                f"topic {topic} does not exist on {','.join(consumer.config['bootstrap_servers'])} "
                f"(no partitions listed within {timeout_s:.0f} s)")
        time.sleep(0.1)
    consumer.subscribe([topic], listener=listener)
    consumer._coordinator._handle_metadata_update(consumer._client.cluster)


def close_producer(producer: KafkaProducer, timeout_s: float | None) -> bool:
    """Close `producer`, waiting up to `timeout_s` for what it has not sent yet; False when
    records were still unsent then, and were dropped.

    kafka-python 3.0's `close(timeout)` flushes first and, with records still pending (a
    broker that is gone: an idempotent producer retries them until `delivery_timeout_ms`,
    120 s), raises KafkaTimeoutError before it reaches its force close. The producer then
    lives on, a `flush()` blocked in another thread stays blocked, and so does the
    interpreter's exit, which joins that thread. The sender's force close aborts the pending
    batches, which ends such a flush too.
    """
    try:
        producer.close(timeout=timeout_s)
    except KafkaTimeoutError:
        producer._sender.force_close()
        return False
    return True


def unacknowledged(producer: KafkaProducer, sent: list[Any], timeout_s: float | None
                   ) -> str | None:
    """Flush `producer` for up to `timeout_s` and check `sent`, futures of its sends: None
    when each was acknowledged, else how it was not (" within 30 s", ": <error>"), to follow
    "not acknowledged by the broker" in the caller's error.

    kafka-python's `flush()` returns once every record has completed, acknowledged or failed
    (an idempotent producer gives a record up after its 120 s delivery timeout), and does
    not say which: without the check a record the broker never took passes for sent.
    """
    try:
        producer.flush(timeout=timeout_s)
    except KafkaTimeoutError:
        return f" within {timeout_s:g} s"
    except KafkaError as err:
        return f": {err}"
    failed = next((future for future in sent if future.failed()), None)
    return None if failed is None else f": {failed.exception}"


def poll_in_group(consumer: KafkaConsumer, timeout_ms: int, *, join_wait_ms: int) -> dict:
    """`consumer.poll(timeout_ms)`, a join of its group that is due or in flight first
    waited out for up to `join_wait_ms`; a poll that completes a join returns nothing, so
    that the caller takes over its new partitions before it waits for their records.

    kafka-python 3.0.12 runs a join (JoinGroup, then SyncGroup) as a task that a poll
    whose time is up leaves in flight; when the task completes before the next poll,
    that poll finds it done, throws its assignment away and joins again. On Tansu, which
    holds every JoinGroup for half the session timeout, that costs a second at least, and
    a member whose polls are short beside the work between them (a busy stage, a starved
    machine) can lose join after join and never be assigned. A join that ends inside one
    long wait is never lost. While the coordinator is unknown (a broker outage) the poll
    keeps its own short timeout.
    """
    coordinator = consumer._coordinator
    if not coordinator.coordinator_unknown() and coordinator.need_rejoin():
        if coordinator.ensure_active_group(timeout_ms=join_wait_ms):
            return {}
    return consumer.poll(timeout_ms=timeout_ms)


# A `PartitionReader` found behind the end offsets this many checks in a row (at least
# STALL_CHECK_S apart) without having read anything since the previous one is replaced.
STALLED_CHECKS = 20
STALL_CHECK_S = 0.5


class PartitionReader:
    """A consumer of every partition of `topics`, in no consumer group, that replaces
    itself when its fetches stall.

    kafka-python 3.0 can leave a fetch that never completes (seen on Apache Kafka): the
    consumer then reads nothing more of its partitions, for ever, with no error. A reader
    compares its positions with the end offsets (`behind`, and from `poll` at most every
    STALL_CHECK_S); behind with nothing read for STALLED_CHECKS checks in a row, it goes on
    from the same positions with a new consumer.
    """

    def __init__(self, kafka: KafkaSettings, topics: list[str], *, what: str,
                 from_end: bool = False, start: Mapping[TopicPartition, int] | None = None):
        self._kafka = kafka
        self._topics = topics
        self._what = what  # names the reader in the log line
        self._from_end = from_end
        self.tps: list[TopicPartition] = []
        self.consumer = self._open(dict(start or {}), from_end=from_end)
        self._positions_checked: dict[TopicPartition, int | None] = {}
        self._stalled_checks = 0
        self._checked_at = time.monotonic()

    def _open(self, positions: dict[TopicPartition, int | None], *, from_end: bool) -> KafkaConsumer:
        """A consumer of every partition of the topics, at `positions` (else the start, or
        the end with `from_end`)."""
        consumer = self._kafka.consumer(group_id=None)
        self.tps = [TopicPartition(topic, p) for topic in self._topics
                    for p in sorted(consumer.partitions_for_topic(topic) or {0})]
        consumer.assign(self.tps)
        for tp in self.tps:
            offset = positions.get(tp)
            if offset is not None:
                consumer.seek(tp, offset)
            elif from_end:
                consumer.seek_to_end(tp)
                consumer.position(tp)  # resolve "end" now, not at the first poll
            else:
                consumer.seek_to_beginning(tp)
        return consumer

    def poll(self, timeout_ms: int, max_records: int | None = None
             ) -> dict[TopicPartition, list[Any]]:
        """What arrived, as `KafkaConsumer.poll`; checks for a stall when one is due (a
        broker that does not answer the check is left to the caller's next poll). Raises
        `TopicAuthorizationFailedError` for topics the broker's ACLs hide."""
        polled = self.consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        # A topic the principal may not DESCRIBE: kafka-python logs it at every metadata
        # refresh and reads nothing, for ever.
        refused = self.consumer._cluster.unauthorized_topics & set(self._topics)
        if refused:
            raise TopicAuthorizationFailedError(refused)
        if time.monotonic() - self._checked_at >= STALL_CHECK_S:
            try:
                self.behind(timeout_ms=max(timeout_ms, 1000))
            except KafkaError:
                pass
        return polled

    def behind(self, timeout_ms: int) -> list[TopicPartition]:
        """The partitions not read to their end offsets; replaces a stalled consumer.
        Raises `KafkaError` when the broker does not answer."""
        end = self.consumer.end_offsets(self.tps, timeout_ms=timeout_ms)
        positions = {tp: fetch_position(self.consumer, tp) for tp in self.tps}
        behind = [tp for tp in self.tps if (positions[tp] or 0) < end[tp]]
        now = time.monotonic()
        if now - self._checked_at < STALL_CHECK_S:
            return behind  # too soon after the last check to count as one
        self._checked_at = now
        stalled = bool(behind) and positions == self._positions_checked
        self._stalled_checks = self._stalled_checks + 1 if stalled else 0
        self._positions_checked = positions
        if self._stalled_checks >= STALLED_CHECKS:
            log.warning("%s: %s stayed behind the end offsets %s with nothing read for %d "
                        "checks; reading on with a new consumer", self._what,
                        {f"{tp.topic}[{tp.partition}]": positions[tp] for tp in behind},
                        {f"{tp.topic}[{tp.partition}]": end[tp] for tp in behind},
                        self._stalled_checks)
            self.consumer.close()
            self.consumer = self._open(positions, from_end=self._from_end)
            self._stalled_checks = 0
        return behind

    def read_to_end(self, *, timeout_s: float, quiet_ms: int = 0, poll_ms: int = 200
                    ) -> Iterator[Any]:
        """Every record from the current positions up to the end offsets as of the call,
        then, with `quiet_ms`, on until a poll that long brings nothing (Tansu
        under-reports the end offset of a multi-record batch). Raises `TimeoutError` when
        that takes over `timeout_s` (a stalled fetch is replaced meanwhile) and
        `KafkaError` when the broker does not answer."""
        deadline = time.monotonic() + timeout_s
        end = self.consumer.end_offsets(self.tps, timeout_ms=max(1000, int(timeout_s * 1000)))
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._what}: could not read {', '.join(self._topics)} to "
                                   f"the end within {timeout_s:.0f} s")
            # Checked before polling: a reader already at the end (the gateway's registry
            # on every lookup) returns at once instead of waiting out a poll.
            if any((fetch_position(self.consumer, tp) or 0) < end[tp] for tp in self.tps):
                polled = self.poll(poll_ms)
            elif quiet_ms:
                polled = self.poll(quiet_ms)
                if not polled:
                    return
            else:
                return
            for records in polled.values():
                yield from records

    def close(self) -> None:
        self.consumer.close()


def read_topics(kafka: KafkaSettings, topics: list[str], *, what: str, timeout_s: float,
                quiet_ms: int = 0) -> list[Any]:
    """Every record of `topics` from the beginning to the end (`PartitionReader.read_to_end`),
    by partition and offset."""
    reader = PartitionReader(kafka, topics, what=what)
    try:
        records = list(reader.read_to_end(timeout_s=timeout_s, quiet_ms=quiet_ms))
    finally:
        reader.close()
    return sorted(records, key=lambda r: (r.topic, r.partition, r.offset))


def key_partition(key: bytes, partitions: int) -> int:
    """The partition a key belongs on (CONTRACT section 1): murmur2, as the Java client and
    kafka-python compute it, and as librdkafka's `partitioner=murmur2_random` does."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


# (topic, key, value) of one message, already validated and encoded.
Record = tuple[str, bytes, bytes]


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

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    # Security settings come from the environment only: a flag would show a password in `ps`.
    cli_flags: ClassVar[dict[str, tuple[str, ...]]] = {name: () for name in SECURITY_FIELDS}

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
    security_protocol: SecurityProtocol = "PLAINTEXT"
    """`SSL` for TLS, `SASL_SSL` for TLS with a SASL login (managed Kafka), `SASL_PLAINTEXT`."""
    sasl_mechanism: SaslMechanism | None = None
    """SASL mechanism of a `SASL_*` protocol."""
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    """Never logged; from `ROLLOUTLAKE_KAFKA_SASL_PASSWORD` or `..._SASL_PASSWORD_FILE`."""
    ssl_cafile: Path | None = None
    """PEM bundle of the CAs that sign the brokers' certificates; unset: the system's CAs."""
    ssl_certfile: Path | None = None
    """PEM client certificate, for brokers that require TLS client authentication."""
    ssl_keyfile: Path | None = None
    """PEM private key of `ssl_certfile`."""
    ssl_key_password: SecretStr | None = None
    """Password of an encrypted `ssl_keyfile`."""
    ssl_check_hostname: bool = True
    """Check that the broker's certificate names the host connected to."""

    @model_validator(mode="before")
    @classmethod
    def _security_from_environment(cls, values: Any) -> Any:
        """Fill the security settings not given explicitly from `ROLLOUTLAKE_KAFKA_*`."""
        if not isinstance(values, dict):
            return values
        from_env = security_from_env(os.environ, skip=values.keys())
        for name, value in from_env.items():
            try:  # checked here, so that an error names the variable, not a flag
                TypeAdapter(cls.model_fields[name].rebuild_annotation()).validate_python(value)
            except ValidationError as err:
                message = err.errors(include_url=False)[0]["msg"]
                raise ValueError(f"{SECURITY_ENV_PREFIX}{name.upper()}: {message}") from None
        return {**from_env, **values}

    @model_validator(mode="after")
    def _security_is_complete(self) -> KafkaSettings:
        if self.security_protocol.startswith("SASL_"):
            missing = [name for name in ("sasl_mechanism", "sasl_username", "sasl_password")
                       if getattr(self, name) is None]
            if missing:
                raise ValueError(
                    f"kafka security_protocol {self.security_protocol} needs sasl_mechanism, "
                    f"sasl_username and sasl_password ({missing[0]} is not set)"
                )
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"kafka {name}: no such file: {path}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("kafka ssl_certfile and ssl_keyfile: give both or neither")
        return self

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

    def security_options(self) -> dict[str, Any]:
        """kafka-python's arguments for the configured protocol (none for PLAINTEXT)."""
        if self.security_protocol == "PLAINTEXT":
            return {}
        options: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL_"):
            assert self.sasl_password is not None  # checked by _security_is_complete
            options.update(sasl_mechanism=self.sasl_mechanism,
                           sasl_plain_username=self.sasl_username,
                           sasl_plain_password=self.sasl_password.get_secret_value())
        if self.security_protocol.endswith("SSL"):
            options["ssl_check_hostname"] = self.ssl_check_hostname
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                if getattr(self, name) is not None:
                    options[name] = str(getattr(self, name))
            if self.ssl_key_password is not None:
                options["ssl_password"] = self.ssl_key_password.get_secret_value()
        return options

    def _connect(self, client: type, options: dict[str, Any]) -> Any:
        options.setdefault("bootstrap_timeout_ms", self.bootstrap_timeout_ms)
        options.update(self.security_options())
        with _connection_errors() as seen:
            try:
                return client(**options)
            except KafkaError as err:
                reason = self._explain(seen)
                if reason is None:
                    last = _last_connection_error(seen)
                    raise BrokerUnavailableError(
                        f"no Kafka broker answers at {self.bootstrap_servers} "
                        f"({type(err).__name__}{'' if last is None else '; last: ' + last})"
                    ) from None
                raise BrokerUnavailableError(
                    f"cannot connect to Kafka at {self.bootstrap_servers}: {reason}"
                ) from None

    def _explain(self, seen: list[str]) -> str | None:
        """Why bootstrapping failed, from what kafka-python logged while it tried."""
        text = " ".join(seen)
        if "SaslAuthenticationFailed" in text:
            return (f"SASL {self.sasl_mechanism} login of user {self.sasl_username!r} was "
                    "refused (wrong username or password?)")
        if "CERTIFICATE_VERIFY_FAILED" in text:
            reason = text.split("certificate verify failed:", 1)[-1].split("(_ssl", 1)[0].strip()
            ca = self.ssl_cafile or "the system's CA bundle"
            return f"the broker's TLS certificate is not trusted by {ca} ({reason})"
        if any(sign in text for sign in _NOT_TLS_SIGNS):
            return (f"the broker does not speak TLS on that port (security_protocol "
                    f"{self.security_protocol})")
        if self.security_protocol in ("PLAINTEXT", "SASL_PLAINTEXT") and (
            _TLS_ALERT_FRAME in text or "socket disconnected" in text
        ):
            return (f"the broker closed the connection: it may expect TLS "
                    f"(security_protocol is {self.security_protocol}; try SSL or SASL_SSL)")
        return None

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

    def ensure_topics(self, needed: Collection[str] | None = None) -> Topics:
        """Create the contract topics (`topic_plan`) that are missing.

        Under ACLs a principal sees only the topics it may DESCRIBE, and may lack CREATE: a
        topic it can neither see nor create is an error when it is one of `needed` (default:
        all of them), and left to the services that use it otherwise. Raises
        `AccessRefusedError` naming the topics and the principal.
        """
        needed = set(self.topics.__dict__.values()) if needed is None else set(needed)
        refused = []
        admin = self.admin()
        try:
            existing = set(admin.list_topics())
            missing = [topic for topic in self.topic_plan() if topic.name not in existing]
            for topic in missing:
                try:
                    admin.create_topics([topic])
                except TopicAlreadyExistsError:
                    pass
                except TopicAuthorizationFailedError:
                    if topic.name in needed:
                        refused.append(topic.name)
        except KafkaError as err:
            raise BrokerUnavailableError(
                f"could not create topics on {self.bootstrap_servers}: {err}"
            ) from None
        finally:
            admin.close()
        if refused:
            raise AccessRefusedError(
                f"{self.principal()} may neither see nor create {', '.join(refused)} on "
                f"{self.bootstrap_servers}: grant it DESCRIBE on existing topics, or CREATE "
                "to let rolloutlake create them (docs/kafka-security.md, \"ACLs\")")
        return self.topics

    def principal(self) -> str:
        """Who the broker's ACLs see, in words."""
        if self.security_protocol.startswith("SASL"):
            return f"SASL user '{self.sasl_username}'"
        return f"this client ({self.security_protocol})"


# The row of docs/kafka-security.md's ACL table that the SDK, the worker and the gateway share.
PUBLISHERS = "publishers"


def acl_refusal(err: BaseException | None) -> AuthorizationError | None:
    """`err` as the refusal by the broker's ACLs that it is, else None. kafka-python reports
    a refused InitProducerId (an idempotent producer whose principal may WRITE no topic)
    as a plain KafkaError that names ClusterAuthorizationFailedError."""
    if isinstance(err, AuthorizationError):
        return err
    if isinstance(err, KafkaError) and "ClusterAuthorizationFailedError" in str(err):
        return ClusterAuthorizationFailedError()
    return None


def not_authorized(settings: KafkaSettings, err: AuthorizationError,
                   service: str) -> AccessRefusedError:
    """A broker's ACL refusal as one line: who was refused which resource, and where the
    ACLs `service` needs are listed."""
    refused = ("an idempotent producer (it needs WRITE on a topic)"
               if isinstance(err, ClusterAuthorizationFailedError)
               else f"access to {refused_resource(err)}")
    return AccessRefusedError(
        f"the broker at {settings.bootstrap_servers} refuses {settings.principal()} {refused}: "
        f"grant it the ACLs of the {service} (docs/kafka-security.md, \"ACLs\")")


# What an SSL handshake with a plaintext listener fails with (OpenSSL 3 wording varies).
_NOT_TLS_SIGNS = ("WRONG_VERSION_NUMBER", "record layer failure", "UNEXPECTED_EOF_WHILE_READING")
# A TLS alert record (0x15 0x03 0x03 ...) read as a Kafka frame length: a plaintext client
# talking to a TLS listener.
_TLS_ALERT_FRAME = f"Invalid frame length: {int.from_bytes(bytes([0x15, 0x03, 0x03, 0x00]), 'big')}"


# kafka-python's connection errors as it logs them: "Connection failed: KafkaTimeoutError:
# SASL Authentication timed out", "Bootstrap connection to bootstrap-0 failed:
# KafkaConnectionError: 111 ECONNREFUSED (backoff 0.12 secs)", "Bootstrap attempt to ...
# failed: ..."; not its giving up ("Bootstrap failed: ... Unable to bootstrap"), which the
# message says already.
_CONNECTION_ERROR = re.compile(
    r"(?:[Cc]onnection|attempt)\b.*?(\w+Error: [^()]*?)\s*(?:\(backoff [^)]*\))?$")


def _last_connection_error(seen: list[str]) -> str | None:
    """The last connection error kafka-python logged: a broker that is there but too slow
    to finish a TLS handshake or a SASL login reads differently from a closed port."""
    for message in reversed(seen):
        found = _CONNECTION_ERROR.search(message)
        if found:
            return found.group(1)
    return None


def security_from_env(env: Mapping[str, str], *, skip: Any = ()) -> dict[str, Any]:
    """The security settings given as `ROLLOUTLAKE_KAFKA_<FIELD>` (or `<FIELD>_FILE`)."""
    found: dict[str, Any] = {}
    for name in SECURITY_FIELDS:
        if name in skip:
            continue
        key = SECURITY_ENV_PREFIX + name.upper()
        if env.get(key):
            found[name] = env[key]
        elif name in SECRET_FIELDS and env.get(key + "_FILE"):
            path = Path(env[key + "_FILE"])
            try:
                found[name] = path.read_text().strip()
            except OSError as err:
                raise ValueError(f"{key}_FILE: cannot read {path}: {err.strerror}") from None
    return found


class _ConnectionErrorLog(logging.Handler):
    """Keeps what kafka-python logs (from its network thread) while a client bootstraps."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# Held while a client is built: the window changes the `kafka` logger for the process,
# and two stages build theirs at once (two overlapping windows restored it half-way).
_CONNECTION_WINDOW = threading.RLock()


@contextmanager
def _connection_errors() -> Iterator[list[str]]:
    """kafka-python only says 'unable to bootstrap'; why is in the lines it logs meanwhile.

    They go into the one-line error instead of the terminal: a failed bootstrap retries many
    times a second. Clients are built at start-up, so little else is logged in the window.
    """
    with _CONNECTION_WINDOW, _collecting_kafka_lines() as messages:
        yield messages


@contextmanager
def _collecting_kafka_lines() -> Iterator[list[str]]:
    kafka_log = logging.getLogger("kafka")
    saved = kafka_log.level, kafka_log.propagate
    collector = _ConnectionErrorLog()
    kafka_log.addHandler(collector)
    kafka_log.setLevel(min(kafka_log.getEffectiveLevel(), logging.WARNING))
    kafka_log.propagate = False
    try:
        yield collector.messages
    finally:
        kafka_log.removeHandler(collector)
        # setLevel, not the attribute: it clears the loggers' cached isEnabledFor answers,
        # which the window's WARNING level filled (kafka-python's lines would leak after it)
        kafka_log.setLevel(saved[0])
        kafka_log.propagate = saved[1]
