"""Run configurations as both processor stages read them: the `runs` table, then `rollout.runs`."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
import pyarrow as pa
from kafka import TopicPartition

from ingest.io.kafka import KafkaSettings, fetch_position
from ingest.io.lake import Lake, TxnMark
from ingest.processor.dead_letters import DeadLetters
from ingest.processor.offsets import app_id
from schemas.errors import EventValidationError
from schemas.events import RunConfig, RunStarted, decode_event
from schemas.tables import RUNS, utc_micros

log = logging.getLogger(__name__)
CATCH_UP_S = 10.0  # how long `catch_up` reads before it goes on with what it has
# Checks in a row (`read_to_end`, twice a second) that find the consumer behind the
# topic's end offsets without having read anything since the previous one, after which it
# is replaced: kafka-python 3.0 can leave a fetch that never completes (seen on Apache
# Kafka), and a group stage waits for its run's config until it is read.
STALLED_CHECKS = 20


class RunConfigs:
    """Run configurations from the `runs` table and `rollout.runs`, read in full by every
    stage instance.

    A later `run_started` replaces the config from the moment it is read. With a lake the
    `runs` table is read first, so run configs survive the topic's retention and a
    recreated topic; with `save` every `run_started` read is also written to it (once, by
    its offset).
    """

    def __init__(self, kafka: KafkaSettings, dead_letters: DeadLetters | None = None,
                 lake: Lake | None = None, *, save: bool = False):
        self.topic = kafka.topics.runs
        self.configs: dict[str, RunConfig] = {}
        self.datasets: dict[str, str | None] = {}
        # run_started records read since the last `take_records`, for the events archive
        self.records: list[tuple[Any, RunStarted]] = []
        self._dead_letters = dead_letters
        self._save_to = lake if save else None
        self._unsaved: list[dict[str, Any]] = []
        self._saved: dict[int, int | None] = {}  # partition -> recorded offset
        if lake is not None:
            self.load(lake)
        self._kafka = kafka
        self._tps: list[TopicPartition] = []
        self._consumer = self._reader({})
        self._positions_checked: dict[TopicPartition, int | None] = {}
        self._stalled_checks = 0

    def _reader(self, positions: dict[TopicPartition, int | None]) -> Any:
        """A consumer of every partition of the topic, at `positions` (else the start)."""
        consumer = self._kafka.consumer(group_id=None)
        partitions = consumer.partitions_for_topic(self.topic) or {0}
        self._tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(self._tps)
        for tp in self._tps:
            offset = positions.get(tp)
            if offset is None:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, offset)
        return consumer

    def load(self, lake: Lake) -> None:
        """The configs of the lake's `runs` table (the latest saved one per run), for the
        runs not read yet: one read from the topic is at least as new."""
        saved = lake.read("runs", columns=["run_id", "config", "dataset", "ingested_at",
                                           "offset"])
        known = set(self.configs)
        for run_id, config, dataset, _, _ in sorted(zip(
            *(saved.column(c).to_pylist() for c in saved.column_names), strict=True
        ), key=lambda row: (row[3], row[4])):
            if run_id not in known:
                self.configs[run_id] = RunConfig.model_validate_json(config)
                self.datasets[run_id] = dataset

    def refresh(self, timeout_ms: int = 0) -> bool:
        """Read whatever arrived; True when anything new was read."""
        changed = False
        while True:
            batch = self._consumer.poll(timeout_ms=timeout_ms, max_records=1000)
            if not batch:
                self._save()
                return changed
            timeout_ms = 0
            for records in batch.values():
                for record in records:
                    changed = True
                    self._apply(record)

    def catch_up(self) -> None:
        """Read up to the end offsets as of now (used at start, before any decision)."""
        end = self._consumer.end_offsets(self._tps)
        deadline = time.monotonic() + CATCH_UP_S
        while any(self._consumer.position(tp) < end[tp] for tp in self._tps):
            if time.monotonic() > deadline:
                log.warning("runs topic not fully read after %.0f s", CATCH_UP_S)
                return
            self.refresh(timeout_ms=200)

    def read_to_end(self, timeout_ms: int) -> bool:
        """Has every `run_started` published so far been read? A stage is not idle before:
        its groups may be waiting for their run's config. A consumer found behind with
        nothing read for STALLED_CHECKS checks in a row is replaced. Raises `KafkaError`
        when the broker does not answer."""
        end = self._consumer.end_offsets(self._tps, timeout_ms=timeout_ms)
        positions = {tp: fetch_position(self._consumer, tp) for tp in self._tps}
        behind = [tp for tp in self._tps if (positions[tp] or 0) < end[tp]]
        stalled = bool(behind) and positions == self._positions_checked
        self._stalled_checks = self._stalled_checks + 1 if stalled else 0
        self._positions_checked = positions
        if self._stalled_checks >= STALLED_CHECKS:
            log.warning("runs topic: %s stayed behind the end offsets %s with nothing read "
                        "for %d checks; reading it with a new consumer",
                        {tp.partition: positions[tp] for tp in behind},
                        {tp.partition: end[tp] for tp in behind}, self._stalled_checks)
            self._consumer.close()
            self._consumer = self._reader(positions)
            self._stalled_checks = 0
        return not behind

    def _apply(self, record: Any) -> None:
        try:
            event = decode_event(record.value, allowed=frozenset({"run_started"}))
        except EventValidationError as err:
            if self._dead_letters is not None:
                self._dead_letters.add(record.topic, record.partition, record.offset,
                                       str(err), record.value)
            return
        assert isinstance(event, RunStarted)
        self.configs[event.run_id] = event.config
        self.datasets[event.run_id] = event.dataset
        self.records.append((record, event))
        if self._save_to is not None:
            self._unsaved.append({
                "run_id": event.run_id, "event_id": event.event_id,
                "config": orjson.dumps(orjson.loads(record.value)["config"]).decode(),
                "dataset": event.dataset, "topic": record.topic, "partition": record.partition,
                "offset": record.offset, "ingested_at": utc_micros(time.time()),
            })

    def _save(self) -> None:
        """Write the run_started records not in the `runs` table yet (one commit)."""
        if self._save_to is None or not self._unsaved:
            return
        rows, self._unsaved = self._unsaved, []
        for partition in {r["partition"] for r in rows} - set(self._saved):
            self._saved[partition] = self._save_to.txn_version(
                "runs", app_id("runs", self.topic, partition))
        rows = [r for r in rows if self._saved[r["partition"]] is None
                or r["offset"] > self._saved[r["partition"]]]
        if not rows:
            return
        marks = {r["partition"]: r["offset"] for r in rows}
        self._save_to.append("runs", pa.Table.from_pylist(rows, schema=RUNS.schema),
                          [TxnMark(app_id("runs", self.topic, p), o) for p, o in marks.items()])
        self._saved.update(marks)

    def take_records(self) -> list[tuple[Any, RunStarted]]:
        records, self.records = self.records, []
        return records

    def get(self, run_id: str) -> RunConfig | None:
        return self.configs.get(run_id)

    def close(self) -> None:
        self._consumer.close()
