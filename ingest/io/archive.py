"""The one reader of the `events` archive, the source of truth for restarts and replay.

`read_archive` gives archived events in (topic, partition, offset) order with the event
time the group stage gave each (`events.event_time`; `ingested_at` for rows archived
before event times were stored). The group stage rebuilds its partitions' undecided
groups from it, the batch stage re-assembles decisions too large to travel, and
`rolloutlake replay` re-derives whole runs (`archived_events` turns the rows Spark reads
into the same events).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from ingest.core.assembly import GroupBuilder
from ingest.core.model import Group
from ingest.core.ordering import micros
from ingest.io.lake import Lake
from schemas.events import TrajectoryEvent, parse_trajectory_event

# The columns an archived event is rebuilt from (`archived_events`).
ARCHIVE_COLUMNS = ["run_id", "group_index", "event_id", "type", "topic", "partition", "offset",
            "ingested_at", "event_time", "payload"]


@dataclass(frozen=True, slots=True)
class ArchivedEvent:
    """One `events` row; the payload is parsed only when asked for (`event`)."""

    run_id: str
    group_index: int | None
    event_id: str
    type: str
    topic: str
    partition: int
    offset: int
    at_us: int  # its event time
    payload: str

    def event(self) -> TrajectoryEvent:
        """The payload of a row with a group_index (run_started rows are read as payload)."""
        return parse_trajectory_event(orjson.loads(self.payload))


def read_archive(lake: Lake, where: pc.Expression) -> list[ArchivedEvent]:
    """The archived events matching `where`, in (topic, partition, offset) order."""
    return archived_events(lake.read("events", filter=where, columns=ARCHIVE_COLUMNS))


def archived_events(table: pa.Table) -> list[ArchivedEvent]:
    """`events` rows with the `ARCHIVE_COLUMNS`, in (topic, partition, offset) order: what
    `read_archive` reads, and what the Spark replay gets per group."""
    table = table.sort_by(
        [("topic", "ascending"), ("partition", "ascending"), ("offset", "ascending")])
    return [
        ArchivedEvent(run_id, group_index, event_id, type_, topic, partition, offset,
                      micros((event_time or ingested_at).timestamp()), payload)
        for run_id, group_index, event_id, type_, topic, partition, offset, ingested_at,
        event_time, payload in zip(*(table.column(c).to_pylist() for c in ARCHIVE_COLUMNS),
                                   strict=True)
    ]


def archived_group(lake: Lake, run_id: str, group_index: int) -> Group:
    """The group re-assembled from its archived events, in (partition, offset) order."""
    rows = read_archive(lake, (pc.field("run_id") == run_id)
                        & (pc.field("group_index") == group_index))
    builder = GroupBuilder(run_id, group_index, rows[0].at_us / 1e6 if rows else 0.0)
    for row in rows:
        builder.apply(row.event())
    return builder.group
