"""Reading one group back from the `events` archive (the source of truth for replay)."""

from __future__ import annotations

import orjson
import pyarrow.compute as pc

from ingest.core.assembly import GroupBuilder
from ingest.core.model import Group
from ingest.io.lake import Lake
from schemas.events import parse_event


def archived_group(lake: Lake, run_id: str, group_index: int) -> Group:
    """The group re-assembled from its archived events, in (partition, offset) order."""
    rows = lake.read(
        "events",
        filter=(pc.field("run_id") == run_id) & (pc.field("group_index") == group_index),
        columns=["partition", "offset", "ingested_at", "event_time", "payload"],
    ).sort_by([("partition", "ascending"), ("offset", "ascending")])
    times = [e or i for e, i in zip(rows.column("event_time").to_pylist(),
                                    rows.column("ingested_at").to_pylist(), strict=True)]
    first = times[0] if times else None
    builder = GroupBuilder(run_id, group_index, first.timestamp() if first else 0.0)
    for payload in rows.column("payload").to_pylist():
        builder.apply(parse_event(orjson.loads(payload)))
    return builder.group
