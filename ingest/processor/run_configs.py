"""Run configurations as both processor stages read them: the `runs` table, then `rollout.runs`."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
import pyarrow as pa

from ingest.io.kafka import KafkaSettings, PartitionReader
from ingest.io.lake import Lake, TxnMark
from ingest.processor.dead_letters import DeadLetters
from ingest.processor.offsets import app_id
from schemas.errors import EventValidationError
from schemas.events import RunConfig, RunStarted, decode_event
from schemas.tables import RUNS, utc_micros

log = logging.getLogger(__name__)
CATCH_UP_S = 10.0  # how long `catch_up` reads before it goes on with what it has


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
        # A group stage waits for its run's config until it is read: a stalled fetch
        # must not hold it up for ever.
        self._reader = PartitionReader(kafka, [self.topic], what="runs topic")

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
            batch = self._reader.poll(timeout_ms=timeout_ms, max_records=1000)
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
        try:
            for record in self._reader.read_to_end(timeout_s=CATCH_UP_S):
                self._apply(record)
        except TimeoutError as err:
            log.warning("%s", err)
        self._save()

    def all_read(self, timeout_ms: int) -> bool:
        """Has every `run_started` published so far been read? A stage is not idle before:
        its groups may be waiting for their run's config. Raises `KafkaError` when the
        broker does not answer."""
        return not self._reader.behind(timeout_ms=timeout_ms)

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
        self._reader.close()
