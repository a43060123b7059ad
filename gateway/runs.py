"""Known runs, read from the `rollout.runs` topic in full (the topic is the source of truth).

The gateway keeps no runs table of its own: runs started through the SDK and through
`POST /v1/runs` are found the same way. The registry reads the compacted history once and
then only the new tail on each lookup, so a `run_started` acknowledged by the broker is
visible to the next request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import cast

from kafka.errors import AuthorizationError, KafkaError

from ingest.io.kafka import PUBLISHERS, KafkaSettings, PartitionReader, not_authorized
from schemas.errors import BrokerUnavailableError, EventValidationError
from schemas.events import RunConfig, RunStarted, decode_event

_RUN_STARTED = frozenset({"run_started"})
# A request that looks a run up waits at most this long for the runs topic.
READ_LIMIT_S = 30.0


@dataclass(frozen=True)
class RunInfo:
    """The latest `run_started` of a run (a later one replaces the config)."""

    run_id: str
    config: RunConfig
    dataset: str | None
    started_at: float | None
    first_started_at: float | None
    event_id: str


class RunRegistry:
    """Thread-safe view of every run announced on the runs topic."""

    def __init__(self, kafka: KafkaSettings):
        self.kafka = kafka
        self._lock = threading.Lock()
        self._runs: dict[str, RunInfo] = {}
        self._reader: PartitionReader | None = None

    def all(self) -> list[RunInfo]:
        self.refresh()
        return sorted(self._runs.values(), key=lambda r: r.run_id)

    def get(self, run_id: str) -> RunInfo | None:
        self.refresh()
        return self._runs.get(run_id)

    def refresh(self) -> None:
        """Read the runs topic up to its current end; BrokerUnavailableError if down."""
        with self._lock:
            try:
                for record in self._connect().read_to_end(timeout_s=READ_LIMIT_S):
                    self._apply(record.value)
            except AuthorizationError as err:
                self._reset()
                raise not_authorized(self.kafka, err, PUBLISHERS) from None
            except (KafkaError, TimeoutError) as err:
                self._reset()
                why = (f"not read to the end within {READ_LIMIT_S:.0f} s"
                       if isinstance(err, TimeoutError) else type(err).__name__)
                raise BrokerUnavailableError(
                    f"could not read {self.kafka.topics.runs}: {why}") from None

    def close(self) -> None:
        with self._lock:
            self._reset()

    def _connect(self) -> PartitionReader:
        if self._reader is None:
            self._reader = PartitionReader(self.kafka, [self.kafka.topics.runs],
                                           what="gateway runs reader")
        return self._reader

    def _reset(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = None

    def _apply(self, raw: bytes) -> None:
        try:
            event = decode_event(raw, allowed=_RUN_STARTED)
        except EventValidationError:
            return  # the processor dead-letters it; the gateway just does not list it
        event = cast(RunStarted, event)
        previous = self._runs.get(event.run_id)
        self._runs[event.run_id] = RunInfo(
            run_id=event.run_id,
            config=event.config,
            dataset=event.dataset if event.dataset is not None else getattr(previous, "dataset", None),
            started_at=event.ts,
            first_started_at=previous.first_started_at if previous else event.ts,
            event_id=event.event_id,
        )
