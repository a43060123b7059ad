"""The gateway's connection to Kafka: one `RolloutPublisher`, rebuilt after a broker outage.

Requests never wait for a connection: while none is up they fail fast with
`BrokerUnavailableError` (HTTP 503) and a background thread keeps reconnecting. A
publisher whose sends failed is replaced, because an idempotent producer that lost its
broker keeps failing with `UnknownProducerIdError` once a fresh broker answers. A broker
whose ACLs refuse the gateway's principal is no outage: requests are answered with
`AccessRefusedError` (HTTP 503, naming principal and topic), the publisher is kept, and
the connector tries again slowly, so that ACLs granted later take effect without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kafka.errors import KafkaError
from kafka.producer.future import RecordMetadata

from ingest.io.kafka import PUBLISHERS, KafkaSettings, Record, acl_refusal, not_authorized
from ingest.sdk.publisher import RolloutPublisher
from schemas.errors import AccessRefusedError, BrokerUnavailableError, RolloutlakeError

log = logging.getLogger(__name__)

RECONNECT_INTERVAL_S = 1.0
# How often a principal the broker's ACLs refuse tries again.
REFUSED_RETRY_S = 10.0


class _NoLinger(KafkaSettings):
    """The gateway's producer settings: no linger. Every request waits for its own acks,
    so lingering only adds latency (5 ms linger: ~8 ms p50 per acked send on Tansu; none:
    ~1 ms); records sent while a request is in flight still share the next batch."""

    def producer(self, **overrides: Any) -> Any:
        return super().producer(**{"linger_ms": 0, **overrides})


class GatewayProducer:
    """Owns the publisher; `send` publishes records and waits for every ack."""

    def __init__(self, kafka: KafkaSettings, *, publish_timeout_s: float):
        self.kafka = kafka
        self.topics = kafka.topics
        self.publish_timeout_s = publish_timeout_s
        self._publisher: RolloutPublisher | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._connected = threading.Event()
        self._connector: threading.Thread | None = None
        self._connect_error: RolloutlakeError | None = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def connect_error(self) -> RolloutlakeError | None:
        """Why the last try to connect failed, while there is no publisher."""
        return None if self.connected else self._connect_error

    def start(self, wait_s: float) -> None:
        """Start connecting; wait up to `wait_s` for the first connection."""
        self._reconnect()
        self._connected.wait(wait_s)

    def publisher(self) -> RolloutPublisher:
        """The live publisher, or `BrokerUnavailableError` while (re)connecting."""
        publisher = self._publisher
        if publisher is None:
            if isinstance(self._connect_error, AccessRefusedError):
                raise AccessRefusedError(str(self._connect_error))
            raise BrokerUnavailableError(
                f"no Kafka broker answers at {self.kafka.bootstrap_servers}; reconnecting"
            )
        return publisher

    def send(self, records: Sequence[Record]) -> list[RecordMetadata]:
        """Publish all records and wait for their acks; any failure -> BrokerUnavailableError.
        Returns each record's metadata (partition, offset), in order.

        A failed batch may be partly delivered: callers make retries safe by reusing
        event ids, which the processor applies once.
        """
        publisher = self.publisher()
        deadline = time.monotonic() + self.publish_timeout_s
        try:
            futures = [publisher.send_raw(topic, key, value) for topic, key, value in records]
            return [future.get(timeout=max(0.0, deadline - time.monotonic()))
                    for future in futures]
        except (KafkaError, BrokerUnavailableError) as err:
            raise self._failed(publisher, err) from None

    async def send_async(self, records: Sequence[Record]) -> list[RecordMetadata]:
        """`send` for the event loop: hands the records to the producer (no I/O, no thread
        hop) and awaits the acks, which the producer's sender thread reports back."""
        publisher = self.publisher()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[RecordMetadata]] = loop.create_future()
        acks: list[RecordMetadata | None] = [None] * len(records)
        remaining = [len(records)]
        guard = threading.Lock()

        def settle(index: int, metadata: RecordMetadata) -> None:
            acks[index] = metadata
            with guard:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                loop.call_soon_threadsafe(_resolve, done, acks, None)

        def fail(err: BaseException) -> None:
            loop.call_soon_threadsafe(_resolve, done, None, err)

        try:
            for index, (topic, key, value) in enumerate(records):
                future = publisher.send_raw(topic, key, value)
                future.add_callback(settle, index)
                future.add_errback(fail)
            if not records:
                return []
            return await asyncio.wait_for(done, self.publish_timeout_s)
        except (KafkaError, BrokerUnavailableError, TimeoutError) as err:
            raise self._failed(publisher, err) from None

    def _failed(self, publisher: RolloutPublisher, err: Exception) -> BrokerUnavailableError:
        """What a request whose sends failed with `err` answers. A publisher the broker's ACLs
        refuse is sound and kept; any other failure replaces it."""
        if isinstance(err, AccessRefusedError):
            return err
        refusal = acl_refusal(err)
        if refusal is not None:
            return not_authorized(self.kafka, refusal, PUBLISHERS)
        self._discard(publisher)
        return BrokerUnavailableError(
            f"the broker did not acknowledge the events within {self.publish_timeout_s} s "
            f"({type(err).__name__})")

    def close(self) -> None:
        """Graceful shutdown: flush what was sent, stop reconnecting."""
        self._stopping.set()
        with self._lock:
            publisher, self._publisher = self._publisher, None
        if publisher is not None:
            try:
                publisher.close()
            except RolloutlakeError as err:
                log.warning("producer flush at shutdown failed: %s", err)

    def _discard(self, publisher: RolloutPublisher) -> None:
        with self._lock:
            if self._publisher is not publisher:
                return  # another request already replaced it
            self._publisher = None
            self._connected.clear()
        # Closing waits for the failed records to time out; do it off the request path.
        threading.Thread(target=_close_quietly, args=(publisher,), daemon=True).start()
        self._reconnect()

    def _reconnect(self) -> None:
        with self._lock:
            if self._connector is not None and self._connector.is_alive():
                return
            self._connector = threading.Thread(
                target=self._connect_loop, name="gateway-kafka-connect", daemon=True
            )
            self._connector.start()

    def _connect_loop(self) -> None:
        logged = None
        while not self._stopping.is_set():
            try:
                publisher = RolloutPublisher(_NoLinger(**self.kafka.model_dump()))
            except RolloutlakeError as err:
                self._connect_error = err
                refused = isinstance(err, AccessRefusedError)
                if str(err) != logged:  # once per cause, not at every try
                    logged = str(err)
                    if refused:
                        log.error("%s; trying again every %g s", err, REFUSED_RETRY_S)
                    else:
                        log.warning("kafka not reachable, retrying: %s", err)
                self._stopping.wait(REFUSED_RETRY_S if refused else RECONNECT_INTERVAL_S)
                continue
            with self._lock:
                if not self._stopping.is_set():
                    self._connect_error = None
                    self._publisher = publisher
                    self._connected.set()
                    log.info("connected to kafka at %s", self.kafka.bootstrap_servers)
                    return
            _close_quietly(publisher)  # shutdown began while connecting
            return


def _resolve(done: asyncio.Future[Any], value: Any, err: BaseException | None) -> None:
    if done.done():
        return
    if err is not None:  # a KafkaError as kafka-python reports it: a refusal stays one
        done.set_exception(err if isinstance(err, KafkaError)
                           else KafkaError(f"{type(err).__name__}: {err}"))
    else:
        done.set_result(value)


def _close_quietly(publisher: RolloutPublisher) -> None:
    try:
        publisher.close()
    except (RolloutlakeError, KafkaError) as err:
        log.debug("closing a failed producer: %s", err)
