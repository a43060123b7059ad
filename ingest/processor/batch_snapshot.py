"""Snapshots of the batch stage's state in the `batch_state` table.

Without them a restarted batch stage replays its `rollout.decisions` partitions from
offset 0: restart time grows with the run's whole history, and a decision lost to
retention would change the batches. So every `snapshot_every` records (and at a clean
stop) the stage writes, per partition, the `RunBatcher`s of the runs it owns and the
partition's `DecisionMerge` (the notices and decisions read but held until every events
partition's watermark passes them, the watermarks, what was released), with the Delta
txn `batch_state@<topic>:<partition>` = the last offset they cover. It writes them after
the tables, so every table has recorded at least that offset: a restart loads the latest
snapshot, seeks to the offset after it, and the usual per-table offset filter drops the
rows it already holds. Both parts are needed: items held at the snapshot were read before
its offset and come no more, and the watermarks they wait for may have come before it.

`RunBatcher` and `DecisionMerge` are plain Python data (dicts, sets, dataclasses, Arrow
tables, bytes), stored with pickle: the lake is the processor's own storage and is trusted
like its code. A snapshot that no longer loads (the classes changed shape in an upgrade)
is ignored with a warning, and the stage replays from offset 0 as before.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ingest.core.batching import RunBatcher
from ingest.core.decided import Opened
from ingest.core.ordering import DecisionMerge
from ingest.io.lake import Lake, TxnMark
from ingest.processor.offsets import app_id
from schemas.tables import BATCH_STATE, utc_micros

log = logging.getLogger(__name__)

PICKLE_PROTOCOL = 5
# v2: the state is a `BatchState` (batchers and the ordering state), no longer the batchers
# alone; a v1 snapshot does not load and the stage replays from offset 0. v3: a
# `RunBatcher` keeps the config each open step opened with (`step_configs`). v4: it tracks
# each open step's groups in flight and its last demand. v5: the state keeps the opened
# notices of runs whose run_started has not been read yet (`awaiting_config`).
FORMAT = f"pickle-{PICKLE_PROTOCOL}-v5"


def decision_fingerprint(record: Any) -> bytes:
    """sha256 of a decisions message (key, headers, value), each part length-prefixed."""
    digest = hashlib.sha256()
    parts = [record.key or b""]
    for name, value in record.headers or []:
        parts += [name.encode(), value or b""]
    parts.append(record.value or b"")
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.digest()


@dataclass(frozen=True)
class BatchState:
    """What a decisions partition's records built up to an offset."""

    batchers: dict[str, RunBatcher]  # the runs of the partition
    merge: DecisionMerge  # the partition's held items and watermarks
    awaiting_config: dict[str, dict[int, Opened]]  # run -> group -> opened, no run_started yet


@dataclass(frozen=True)
class Snapshot:
    offset: int
    fingerprint: bytes
    state: BatchState


class BatchSnapshots:
    """Reads and writes the batch stage's snapshots for one decisions topic."""

    def __init__(self, lake: Lake, topic: str, every: int):
        self.lake = lake
        self.topic = topic
        self.every = every
        self.saved: dict[int, int] = {}  # partition -> offset of its latest snapshot

    def latest(self, partition: int) -> Snapshot | None:
        """The partition's latest snapshot that loads, or None (replay from offset 0)."""
        in_partition = (pc.field("topic") == self.topic) & (pc.field("partition") == partition)
        offsets = self.lake.read("batch_state", columns=["offset"], filter=in_partition)
        if offsets.num_rows == 0:
            return None
        offset = pc.max(offsets.column("offset")).as_py()
        row = self.lake.read("batch_state", columns=["fingerprint", "format", "state"],
                             filter=in_partition & (pc.field("offset") == offset)).to_pylist()[0]
        self.saved[partition] = offset
        try:
            if row["format"] != FORMAT:
                raise ValueError(f"format {row['format']!r}, not {FORMAT!r}")
            state = pickle.loads(row["state"])
        except Exception as err:  # noqa: BLE001 - any unpickling failure means "replay"
            log.warning("%s[%d]: snapshot at offset %d does not load (%s: %s); replaying from "
                        "offset 0", self.topic, partition, offset, type(err).__name__, err)
            return None
        return Snapshot(offset, row["fingerprint"], state)

    def due(self, partition: int, offset: int) -> bool:
        return offset - self.saved.get(partition, -1) >= self.every

    def save(self, partitions: dict[int, tuple[Any, BatchState]]) -> None:
        """One commit: per partition, (last record handled, the state it built)."""
        rows, marks = [], []
        for partition, (record, state) in sorted(partitions.items()):
            if record.offset <= self.saved.get(partition, -1):
                continue
            rows.append({
                "topic": self.topic, "partition": partition, "offset": record.offset,
                "fingerprint": decision_fingerprint(record), "format": FORMAT,
                "state": pickle.dumps(state, protocol=PICKLE_PROTOCOL),
                "runs": sorted(set(state.batchers) | set(state.awaiting_config)), "written_at": utc_micros(time.time()),
            })
            marks.append(TxnMark(app_id("batch_state", self.topic, partition), record.offset))
        if not rows:
            return
        self.lake.append("batch_state", pa.Table.from_pylist(rows, schema=BATCH_STATE.schema),
                         marks)
        for row in rows:
            self.saved[row["partition"]] = row["offset"]
