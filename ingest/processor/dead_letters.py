"""Dead letters: rejected messages, in the `dead_letters` table and on `rollout.deadletter`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from ingest.io.lake import Lake, TxnMark
from schemas.tables import DEAD_LETTERS, utc_micros

log = logging.getLogger(__name__)


@dataclass
class DeadLetters:
    """Rejected messages, written to the `dead_letters` table and `rollout.deadletter`.

    Keys (topic, partition, offset) already in the table are skipped, so rows produced
    again after a restart (a timeout re-detected, a replayed batch) are written once.
    """

    lake: Lake
    producer: Any  # KafkaProducer
    topic: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    _known: set[tuple[str, int, int]] | None = None

    def known(self) -> set[tuple[str, int, int]]:
        if self._known is None:
            table = self.lake.read("dead_letters", columns=["topic", "partition", "offset"])
            self._known = set(
                zip(
                    table.column("topic").to_pylist(),
                    table.column("partition").to_pylist(),
                    table.column("offset").to_pylist(),
                    strict=True,
                )
            )
        return self._known

    def add(self, topic: str, partition: int, offset: int, error: str, raw: bytes | None,
            *, run_id: str | None = None, group_index: int | None = None) -> None:
        key = (topic, partition, offset)
        known = self.known()
        if key in known:
            return
        known.add(key)
        # Reasons may quote input: keep a lone surrogate from failing the table write.
        error = error.encode("utf-8", "backslashreplace").decode("utf-8")
        self.rows.append(
            {
                "topic": topic, "partition": partition, "offset": offset, "error": error,
                "raw": raw, "at": utc_micros(time.time()), "run_id": run_id,
                "group_index": group_index,
            }
        )
        log.info("dead letter %s[%d]@%d: %s", topic, partition, offset, error)

    def commit(self, marks: list[TxnMark]) -> None:
        """Write pending rows (with the stage's marks) and mirror them to Kafka."""
        if not self.rows:
            return
        rows, self.rows = self.rows, []
        self.lake.append("dead_letters", pa.Table.from_pylist(rows, schema=DEAD_LETTERS.schema),
                         marks)
        for row in rows:
            self.producer.send(
                self.topic,
                key=None if row["run_id"] is None else row["run_id"].encode(),
                value=row["raw"] or b"",
                headers=[
                    ("error", row["error"].encode()),
                    ("source", f"{row['topic']}:{row['partition']}:{row['offset']}".encode()),
                ],
            )
