"""What both processor stages share: a consumer-group member with its producer and runs.

kafka-python calls rebalance listeners on its network thread, where blocking calls are not
allowed, so a stage only notes newly assigned partitions there and takes them over (reads
Delta, seeks) at the top of its next `poll_once`.
"""

from __future__ import annotations

import time
from typing import Any

from kafka import ConsumerRebalanceListener, TopicPartition

from ingest.lake import Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.io import DeadLetters, RunRegistry
from schemas.errors import RolloutlakeError

TOPIC_WAIT_S = 10.0


class Stage(ConsumerRebalanceListener):
    """Subclasses implement `_take_over`, `_release`, `_new_batch`, `_handle`, `_commit`."""

    def __init__(self, config: ProcessorConfig, lake: Lake, *, topic: str, role: str):
        self.config = config
        self.lake = lake
        self.topics = config.kafka.topics
        # Decisions stay on loopback or a LAN inside the deployment: compressing them costs
        # more CPU on both stages than it saves on the wire.
        self.producer = config.kafka.producer(compression_type=None)
        self.dead_letters = DeadLetters(lake, self.producer, self.topics.deadletter)
        self.runs = RunRegistry(config.kafka, self.dead_letters)
        self.consumer = config.kafka.consumer(
            group_id=f"{config.consumer_group}-{role}",
            session_timeout_ms=config.session_timeout_ms,
            heartbeat_interval_ms=max(500, config.session_timeout_ms // 3),
            max_poll_records=config.max_poll_records,
        )
        try:
            self._wait_for_partitions(topic)
        except RolloutlakeError:
            self.close()
            raise
        self.consumer.subscribe([topic], listener=self)
        self.last_activity = time.monotonic()
        self.joined = False  # idle only counts once the consumer group assigned partitions
        self.newly_assigned: set[TopicPartition] = set()

    def _wait_for_partitions(self, topic: str) -> None:
        """Subscribe only once this client's metadata lists the topic's partitions.

        Otherwise the first join (immediate on Apache Kafka) assigns nothing, and the
        rebalance that follows the metadata update can complete after `poll` returned:
        kafka-python then never applies that assignment and the stage waits forever.
        """
        deadline = time.monotonic() + TOPIC_WAIT_S
        while not self.consumer.partitions_for_topic(topic):
            if time.monotonic() > deadline:
                raise RolloutlakeError(
                    f"topic {topic} does not exist on {self.config.kafka.bootstrap_servers} "
                    f"(no partitions listed within {TOPIC_WAIT_S:.0f} s)"
                )
            time.sleep(0.1)

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.newly_assigned |= set(assigned)

    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.newly_assigned -= set(revoked)
        self._release({tp.partition for tp in revoked})

    def poll_once(self) -> int:
        """One poll: take over new partitions, process what arrived, commit. Returns count."""
        self.runs.refresh()
        polled = self.consumer.poll(timeout_ms=self.config.poll_timeout_ms)
        if self.newly_assigned:
            assigned, self.newly_assigned = self.newly_assigned, set()
            self._take_over(assigned)
            self.joined = True
            self.last_activity = time.monotonic()
            # Records fetched before the seek come again from the new position.
            polled = {tp: r for tp, r in polled.items() if tp not in assigned}
        batch = self._new_batch()
        count = 0
        for tp, records in polled.items():
            for record in records:
                self._handle(record, batch)
                batch.last_offset[tp.partition] = record.offset
            count += len(records)
        self._commit(batch)
        if count:
            self.last_activity = time.monotonic()
        return count

    def check_continuity(self, tp: TopicPartition, recorded: int | None) -> None:
        """Refuse to resume a partition that is empty although the lake has consumed it.

        That happens when the topic was recreated (a restarted memory broker): its offsets
        start again at 0, below what the lake recorded, and resuming would skip every new
        message as already processed.
        """
        if recorded is None:
            return
        end = self.consumer.end_offsets([tp])[tp]
        if end == 0:
            raise RolloutlakeError(
                f"{tp.topic}[{tp.partition}] is empty but {self.lake.root} already holds it up "
                f"to offset {recorded}: the topic was recreated (a restarted in-memory "
                "broker?). Use a fresh lake or another --topic-prefix."
            )

    @property
    def idle(self) -> bool:
        return self.joined and not self.dead_letters.rows

    def close(self) -> None:
        self.producer.flush()
        self.consumer.close()
        self.runs.close()
        self.producer.close()

    def _take_over(self, assigned: set[TopicPartition]) -> None:
        raise NotImplementedError

    def _release(self, partitions: set[int]) -> None:
        raise NotImplementedError

    def _new_batch(self) -> Any:
        """An empty batch of this poll's outputs, with a `last_offset` dict per partition."""
        raise NotImplementedError

    def _handle(self, record: Any, batch: Any) -> None:
        raise NotImplementedError

    def _commit(self, batch: Any) -> None:
        raise NotImplementedError
