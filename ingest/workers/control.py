"""Follows `rollout.control` for one run, so step seals reach the rollout loop as they happen.

The consumer is positioned at the end of every partition before the worker issues its
first group: seals of earlier worker runs are history, the ones that matter come later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import orjson
from kafka import TopicPartition
from pydantic import ValidationError

from ingest.kafka_io import KafkaSettings
from schemas.control import StepSealed

log = logging.getLogger(__name__)

POLL_MS = 100


class ControlFollower:
    """Calls `on_sealed(step)` from its own thread for each `step_sealed` of `run_id`."""

    def __init__(self, settings: KafkaSettings, run_id: str, on_sealed: Callable[[int], None]):
        self.run_id = run_id
        self.on_sealed = on_sealed
        self._consumer = settings.consumer()
        topic = settings.topics.control
        partitions = [TopicPartition(topic, p)
                      for p in sorted(self._consumer.partitions_for_topic(topic) or ())]
        self._consumer.assign(partitions)
        self._consumer.seek_to_end(*partitions)
        for partition in partitions:
            self._consumer.position(partition)  # resolve "end" now, not at the first poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="control-follower",
                                        daemon=True)

    def start(self) -> ControlFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._consumer.close()

    def _follow(self) -> None:
        while not self._stop.is_set():
            for records in self._consumer.poll(timeout_ms=POLL_MS).values():
                for record in records:
                    step = self._sealed_step(record.value)
                    if step is not None:
                        self.on_sealed(step)

    def _sealed_step(self, value: bytes | None) -> int | None:
        try:
            body = orjson.loads(value or b"null")
            if not isinstance(body, dict) or body.get("type") != "step_sealed":
                return None  # demand, weights_updated: not followed by this worker yet
            sealed = StepSealed.model_validate(body)
        except (orjson.JSONDecodeError, ValidationError) as err:
            log.warning("ignoring an unreadable rollout.control message: %s", err)
            return None
        return sealed.step if sealed.run_id == self.run_id else None
