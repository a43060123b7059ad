"""The producer SDK: rollout workers publish trajectory events through `RolloutPublisher`.

Every event is validated against the contract before anything is sent, keyed so all events
of a group share a partition, and refused with `EventTooLargeError` above 8 MiB.

    with RolloutPublisher("127.0.0.1:9092") as pub:
        pub.run_started("run-1", {"n_samples_per_prompt": 8, "rollout_batch_size": 32})
        pub.group_started("run-1", group_index=0, step=0, n_samples=8, prompt="2+2=")
        pub.sample_finished("run-1", group_index=0, rollout_id=0, status="completed",
                            prompt_tokens=[...], response_tokens=[...], reward=1.0)
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from kafka.errors import AuthorizationError, KafkaError
from kafka.producer.future import FutureRecordMetadata

from ingest.io.kafka import (
    MAX_EVENT_BYTES,
    PUBLISHERS,
    KafkaSettings,
    Record,
    Topics,
    acl_refusal,
    close_producer,
    not_authorized,
    unacknowledged,
)
from schemas.errors import AccessRefusedError, BrokerUnavailableError, EventTooLargeError
from schemas.events import (
    SCHEMA_VERSION,
    AnyEvent,
    RunStarted,
    encode_event,
    event_group_key,
    parse_event,
)

_UNSET: Any = object()
log = logging.getLogger(__name__)
# How often a publisher riding out an outage tries a new connection.
RECONNECT_INTERVAL_S = 1.0
PRUNE_SENDS = 10_000
PRUNE_BYTES = 64 * 1024 * 1024


def event_record(event: AnyEvent, topics: Topics, *, max_bytes: int = MAX_EVENT_BYTES) -> Record:
    """`event` encoded for its topic and key (CONTRACT section 1): `run_started` on the runs
    topic keyed by run, every other event on the events topic keyed `run_id:group_index`
    (one partition per group). EventTooLargeError above `max_bytes` encoded."""
    value = encode_event(event)
    if len(value) > max_bytes:
        raise EventTooLargeError(
            f"{event.type} event {event.event_id!r} is {len(value)} bytes encoded; "
            f"the limit is {max_bytes} bytes"
        )
    if isinstance(event, RunStarted):
        return topics.runs, event.run_id.encode(), value
    return topics.events, event_group_key(event.run_id, event.group_index), value


class RolloutPublisher:
    """Validating, idempotent Kafka producer of CONTRACT section 2 events."""

    def __init__(
        self,
        bootstrap_servers: str | KafkaSettings = "127.0.0.1:9092",
        *,
        producer_id: str | None = None,
        create_topics: bool = True,
        max_event_bytes: int = MAX_EVENT_BYTES,
        outage_grace_s: float = 0.0,
    ):
        """`outage_grace_s`: how long a `flush` that finds events unacknowledged rides the
        outage out (below) before it raises; 0 raises at once."""
        self.settings = (
            bootstrap_servers
            if isinstance(bootstrap_servers, KafkaSettings)
            else KafkaSettings(bootstrap_servers=bootstrap_servers)
        )
        self.create_topics = create_topics
        self.topics = self._ensure_topics()
        self.producer_id = producer_id
        self.max_event_bytes = max_event_bytes
        self.outage_grace_s = outage_grace_s
        self._producer = self.settings.producer()
        # The sends a flush checks, each with its record when there is a grace (to send it
        # again); those acknowledged are dropped every PRUNE_SENDS sends or PRUNE_BYTES.
        self._pending: list[tuple[FutureRecordMetadata, Record | None]] = []
        self._sent_since_prune = self._bytes_since_prune = 0

    def _ensure_topics(self) -> Topics:
        # Every contract topic where the principal may create it (their partition counts
        # matter before the processor runs); under ACLs a publisher needs only the two it
        # writes.
        topics = self.settings.topics
        return (self.settings.ensure_topics(needed=(topics.runs, topics.events))
                if self.create_topics else topics)

    # -- generic -----------------------------------------------------------------------

    def build(self, event_type: str, run_id: str, **fields: Any) -> AnyEvent:
        """Validate one event given its fields; fills `event_id`, `schema_version`, `ts`."""
        return build_event(event_type, run_id, producer_id=self.producer_id, **fields)

    def publish(self, event: AnyEvent) -> FutureRecordMetadata:
        """Send one validated event to its topic; returns the Kafka future.
        EventTooLargeError above `max_event_bytes` encoded."""
        return self.send_raw(*event_record(event, self.topics, max_bytes=self.max_event_bytes))

    def send_raw(self, topic: str, key: bytes, value: bytes) -> FutureRecordMetadata:
        """Send pre-encoded bytes (already validated by the caller) and track the future."""
        try:
            future = self._send(topic, key, value)
        except BrokerUnavailableError as err:
            # The producer's buffer stayed full, or it found no metadata, for `max_block_ms`;
            # or a ride-out that outlasted its grace closed it.
            if self.outage_grace_s <= 0 or isinstance(err, AccessRefusedError):
                raise
            self.flush()  # what is pending first
            if not self._replace_producer(time.monotonic() + self.outage_grace_s):
                raise
            future = self._send(topic, key, value)
        self._pending.append((future, (topic, key, value) if self.outage_grace_s > 0 else None))
        self._sent_since_prune += 1
        self._bytes_since_prune += len(value)
        if self._sent_since_prune >= PRUNE_SENDS or self._bytes_since_prune >= PRUNE_BYTES:
            # A failed send stays until a flush reports it.
            self._pending = [sent for sent in self._pending if not sent[0].succeeded()]
            self._sent_since_prune = self._bytes_since_prune = 0
        return future

    def _send(self, topic: str, key: bytes, value: bytes) -> FutureRecordMetadata:
        try:
            return self._producer.send(topic, key=key, value=value)
        except AuthorizationError as err:  # no DESCRIBE on the topic
            raise not_authorized(self.settings, err, PUBLISHERS) from None
        except KafkaError as err:
            raise BrokerUnavailableError(f"could not publish to {topic}: {err}") from None

    def flush(self, timeout_s: float | None = 30.0) -> None:
        """Block until every sent event is acknowledged; raise if any failed:
        `AccessRefusedError` naming the principal and topic when the broker's ACLs refused
        it, else `BrokerUnavailableError`.

        With `outage_grace_s`, events that a flush finds unacknowledged (a broker restarted,
        failed over, or away for a while) are sent again by a new producer until the broker
        takes them or the grace has passed. A new producer, because an idempotent one whose
        requests timed out can stop sending even once the broker is back (docs/producers.md).
        An event the broker had taken before its acknowledgement was lost is then published
        twice, which the processor applies once (by `event_id`).
        """
        give_up_at: float | None = None  # counted from the first round that fell short
        while True:
            why = unacknowledged(self._producer, [future for future, _ in self._pending],
                                 timeout_s)
            refused = next(filter(None, (acl_refusal(future.exception)
                                         for future, _ in self._pending if future.failed())),
                           None)
            if refused is not None or why is None:
                break
            now = time.monotonic()
            if give_up_at is None:
                give_up_at = now + self.outage_grace_s
            if now < give_up_at:
                log.warning("events not acknowledged by the broker%s; sending them again "
                            "with a new producer for up to %.0f s more", why, give_up_at - now)
            if now >= give_up_at or not self._replace_producer(give_up_at):
                if self.outage_grace_s > 0:
                    why = f"{why}, nor by a new producer within {self.outage_grace_s:g} s"
                break
            try:
                self._send_again()
            except AccessRefusedError:
                raise
            except BrokerUnavailableError:
                continue  # gone again: the next round finds the rest unacknowledged
        # A later flush checks what this one timed out on.
        self._pending = [sent for sent in self._pending if not sent[0].is_done]
        if refused is not None:
            raise not_authorized(self.settings, refused, PUBLISHERS)
        if why is not None:
            raise BrokerUnavailableError(f"events not acknowledged by the broker{why}")

    def _send_again(self) -> None:
        """Send the records not acknowledged again, with the new producer."""
        unacknowledged = [sent for sent in self._pending if not sent[0].succeeded()]
        resent: list[tuple[FutureRecordMetadata, Record | None]] = []
        for index, (_, record) in enumerate(unacknowledged):
            assert record is not None  # kept whenever there is a grace
            try:
                resent.append((self._send(*record), record))
            except BrokerUnavailableError:
                self._pending = resent + unacknowledged[index:]
                raise
        self._pending = resent

    def _replace_producer(self, give_up_at: float) -> bool:
        """Close the producer (what it still holds fails) and connect a new one, trying until
        `give_up_at`; False if no broker answered by then."""
        close_producer(self._producer, timeout_s=0)
        while True:
            try:
                self._ensure_topics()  # a broker restarted empty (Tansu keeps no topics)
                self._producer = self.settings.producer()
                return True
            except AccessRefusedError:
                raise
            except BrokerUnavailableError as err:
                if time.monotonic() + RECONNECT_INTERVAL_S >= give_up_at:
                    log.warning("no new producer: %s", err)
                    return False
                time.sleep(RECONNECT_INTERVAL_S)

    def close(self) -> None:
        """Flush (raising if an event was not acknowledged), then close. Events still unsent
        after the flush's 30 s, as on a broker that is gone, are dropped rather than retried
        until kafka-python's 120 s delivery timeout."""
        try:
            self.flush()
        finally:
            close_producer(self._producer, timeout_s=0)

    def __enter__(self) -> RolloutPublisher:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, BrokerUnavailableError):
            # The broker did not take an event in time: a flush now would wait its 30 s for
            # the same sends before raising the same error over this one.
            close_producer(self._producer, timeout_s=0)
        else:
            self.close()

    # -- one method per event type -----------------------------------------------------

    def run_started(self, run_id: str, config: dict[str, Any], *, dataset: str | None = None,
                    event_id: str | None = None) -> AnyEvent:
        return self._emit("run_started", run_id, config=config, dataset=dataset or _UNSET,
                          event_id=event_id or _UNSET)

    def group_started(self, run_id: str, *, group_index: int, step: int, n_samples: int,
                      prompt: Any = _UNSET, label: Any = _UNSET, prompt_ref: Any = _UNSET,
                      metadata: dict[str, Any] | None = None,
                      event_id: str | None = None) -> AnyEvent:
        return self._emit("group_started", run_id, group_index=group_index, step=step,
                          n_samples=n_samples, prompt=prompt, label=label,
                          prompt_ref=prompt_ref, metadata=metadata or _UNSET,
                          event_id=event_id or _UNSET)

    def sample_finished(self, run_id: str, *, group_index: int, rollout_id: int, status: str,
                        prompt_tokens: list[int], response_tokens: list[int],
                        loss_mask: list[int] | None = None,
                        rollout_log_probs: list[float] | None = None, reward: Any = _UNSET,
                        sample_index: int | None = None, fragment_count: int = 1,
                        fragment_index: int | None = None, weight_version: int | None = None,
                        response_text: str | None = None,
                        metadata: dict[str, Any] | None = None,
                        event_id: str | None = None) -> AnyEvent:
        """The last (or only) fragment of a rollout; leave `reward` out to send it later."""
        return self._emit(
            "sample_finished", run_id, group_index=group_index, rollout_id=rollout_id,
            status=status, prompt_tokens=prompt_tokens, response_tokens=response_tokens,
            loss_mask=_opt(loss_mask), rollout_log_probs=_opt(rollout_log_probs), reward=reward,
            sample_index=_opt(sample_index), fragment_count=fragment_count,
            fragment_index=_opt(fragment_index), weight_version=_opt(weight_version),
            response_text=_opt(response_text), metadata=metadata or _UNSET,
            event_id=event_id or _UNSET,
        )

    def compaction_fragment(self, run_id: str, *, group_index: int, rollout_id: int,
                            fragment_index: int, prompt_tokens: list[int],
                            response_tokens: list[int], loss_mask: list[int] | None = None,
                            rollout_log_probs: list[float] | None = None,
                            metadata: dict[str, Any] | None = None,
                            event_id: str | None = None) -> AnyEvent:
        return self._emit(
            "compaction_fragment", run_id, group_index=group_index, rollout_id=rollout_id,
            fragment_index=fragment_index, prompt_tokens=prompt_tokens,
            response_tokens=response_tokens, loss_mask=_opt(loss_mask),
            rollout_log_probs=_opt(rollout_log_probs), metadata=metadata or _UNSET,
            event_id=event_id or _UNSET,
        )

    def reward(self, run_id: str, *, group_index: int, rollout_id: int, reward: Any,
               event_id: str | None = None) -> AnyEvent:
        return self._emit("reward", run_id, group_index=group_index, rollout_id=rollout_id,
                          reward=reward, event_id=event_id or _UNSET)

    def sample_aborted(self, run_id: str, *, group_index: int, rollout_id: int, reason: str,
                       response_tokens: list[int] | None = None, recyclable: bool = False,
                       event_id: str | None = None) -> AnyEvent:
        return self._emit("sample_aborted", run_id, group_index=group_index,
                          rollout_id=rollout_id, reason=reason,
                          response_tokens=_opt(response_tokens), recyclable=recyclable,
                          event_id=event_id or _UNSET)

    def _emit(self, event_type: str, run_id: str, **fields: Any) -> AnyEvent:
        event = self.build(event_type, run_id, **fields)
        self.publish(event)
        return event


def build_event(event_type: str, run_id: str, *, producer_id: str | None = None,
                **fields: Any) -> AnyEvent:
    """One validated event from its fields (those left unset are left out); fills `event_id`,
    `schema_version`, `ts` and `producer`. EventValidationError names a bad field."""
    body = {k: v for k, v in fields.items() if v is not _UNSET}
    body.setdefault("event_id", uuid.uuid4().hex)
    body.setdefault("ts", time.time())
    if producer_id is not None:
        body.setdefault("producer", producer_id)
    body.update(type=event_type, run_id=run_id, schema_version=SCHEMA_VERSION)
    return parse_event(body)


def _opt(value: Any) -> Any:
    """Leave an optional field out of the event rather than sending an explicit null."""
    return _UNSET if value is None else value
