"""Group stage: `rollout.events` -> `events` archive + group decisions on `rollout.decisions`.

Per poll: assemble events into groups (pure core), commit the archive and dead letters to
Delta with the consumed offsets as app transactions, then publish the decisions of the
groups that completed. Publishing after the commit means every decision's events are
durable; a crash between the two is healed on start by rebuilding undecided groups from
the archive and deciding them again (the batch stage ignores a repeated decision). A
poll's archive commit and the publishing behind it run on a thread of their own while the
stage polls and assembles the next records (`GroupStage.archiver`).

Time is event time (`ingest.core.ordering`): each partition's clock is the largest event
time archived on it, groups time out against it, and after every commit the stage
publishes each partition's watermark so the batch stage can apply decisions in order.
A partition with nothing left to read advances its clock to the wall clock minus
`watermark_lag_s`, so an idle partition never holds the others back.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from kafka import TopicPartition
from kafka.errors import KafkaTimeoutError

from ingest.core.assembly import GroupBuilder, fold_partition
from ingest.core.decide import decide
from ingest.core.decided import DecidedGroup, Opened
from ingest.core.ordering import PartitionClock, TimeoutQueue, micros, timeout_micros
from ingest.io.archive import read_archive
from ingest.io.kafka import key_partition
from ingest.io.lake import Lake, TxnMark
from ingest.io.spool import DecisionSpool
from ingest.processor.config import ProcessorConfig
from ingest.processor.decisions import (
    encode_decision,
    encode_opened,
    encode_watermark,
    lake_header,
)
from ingest.processor.membership import GroupMember
from ingest.processor.offsets import app_id
from ingest.processor.stage import Stage
from schemas.errors import EventValidationError
from schemas.events import (
    AnyEvent,
    GroupStarted,
    RunConfig,
    decode_trajectory_event,
    event_group_key,
)
from schemas.tables import EVENTS, utc_micros

log = logging.getLogger(__name__)

GroupKey = tuple[str, int]
NO_GROUP_STARTED = "no group_started"  # dead-letter error of a group that never started


# An idle partition's clock is advanced at most this often (each advance is a notice).
IDLE_ADVANCE_INTERVAL_S = 0.25
END_OFFSETS_TIMEOUT_MS = 1000  # the idle check's end-offset request: a poll waits this long at most


@dataclass
class _Pending:
    builder: GroupBuilder
    partition: int
    completed_at: tuple[int, int] | None = None  # (partition, offset) of the completing event
    completed_us: int | None = None  # event time of the completing event


def _cell_bounds(schema: pa.Schema) -> tuple[tuple[str, int | None], ...]:
    """(column, bound) per column to check: the integer columns' 2**(bits-1), None for a
    string column (its value must encode to UTF-8)."""
    return tuple((f.name, 1 << (f.type.bit_width - 1) if pa.types.is_integer(f.type) else None)
                 for f in schema
                 if pa.types.is_integer(f.type) or pa.types.is_string(f.type))


_EVENT_CELL_BOUNDS = _cell_bounds(EVENTS.schema)


def _check_cells(row: dict[str, Any]) -> None:
    """Raise ValueError for a value its `events` column cannot hold (the schema should have
    refused it; this keeps one such row from failing the whole Arrow table of a poll)."""
    for name, bound in _EVENT_CELL_BOUNDS:
        value = row[name]
        if value is None or isinstance(value, bytes):
            continue
        if bound is None:
            value.encode("utf-8")
        elif not isinstance(value, int) or not -bound <= value < bound:
            raise ValueError(f"{name} {value!r} does not fit the "
                             f"{EVENTS.schema.field(name).type} column")


class ArchiveRows:
    """`events` rows built column by column (payloads stay bytes until one Arrow cast)."""

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {name: [] for name in EVENTS.schema.names}

    @staticmethod
    def row(record: Any, event: AnyEvent, event_time_us: int | None = None) -> dict[str, Any]:
        """One row, checked against the column types; raises ValueError when it cannot be stored."""
        row = {
            "run_id": event.run_id, "event_id": event.event_id, "type": event.type,
            "group_index": getattr(event, "group_index", None),
            "rollout_id": getattr(event, "rollout_id", None),
            "topic": record.topic, "partition": record.partition, "offset": record.offset,
            "ingested_at": utc_micros(time.time()), "payload": record.value,
            "step": event.step if isinstance(event, GroupStarted) else None,
            "event_time": event_time_us,
        }
        _check_cells(row)
        return row

    def append(self, row: dict[str, Any]) -> None:
        for name, column in self.columns.items():
            column.append(row[name])

    def add(self, record: Any, event: AnyEvent, event_time_us: int | None = None) -> None:
        self.append(self.row(record, event, event_time_us))

    def __len__(self) -> int:
        return len(self.columns["run_id"])

    def table(self) -> pa.Table:
        payload = pa.array(self.columns["payload"], pa.binary()).cast(pa.string())
        arrays = [
            payload if name == "payload" else pa.array(self.columns[name], EVENTS.schema.field(name).type)
            for name in EVENTS.schema.names
        ]
        return pa.Table.from_arrays(arrays, schema=EVENTS.schema)


@dataclass
class _Batch:
    archive: ArchiveRows = field(default_factory=ArchiveRows)
    decisions: list[DecidedGroup | Opened] = field(default_factory=list)  # in publish order
    last_offset: dict[int, int] = field(default_factory=dict)


class GroupStage(Stage):
    """Consumer-group member on `rollout.events`; owns the groups of its partitions."""

    # The archive gets a commit every poll: uncompacted, its appends (and every decision
    # behind them) slow down as a long run's files accumulate.
    compacted_tables = ("events",)

    def __init__(self, config: ProcessorConfig, lake: Lake, spool: DecisionSpool | None = None,
                 member: GroupMember | None = None):
        super().__init__(config, lake, role="groups", member=member)
        self.spool = spool  # where decisions for this instance's batch stage leave fragments
        self.pending: dict[GroupKey, _Pending] = {}
        self.decided: dict[GroupKey, set[str]] = {}  # decided group -> its event ids
        self.dead: set[GroupKey] = set()  # timed out without a group_started
        self.recorded: dict[int, int | None] = {}  # partition -> archive txn version
        self._runs_recorded: dict[str, int | None] = {}  # runs app id -> archive txn version
        # (run_id, event_id) -> group_index of every archived event of the partitions taken
        # over: an id is unique within its run (CONTRACT section 2), across its groups.
        self.event_groups: dict[tuple[str, str], int] = {}
        self.clocks: dict[int, PartitionClock] = {}
        self.timeouts: dict[int, TimeoutQueue] = {}
        # partition -> (watermark, next offset) last published
        self._published: dict[int, tuple[int, int]] = {}
        self._idle_advanced_at: dict[int, float] = {}
        self._decisions_partitions: list[int] | None = None
        self._sent_by = lake_header(self.lake_id)  # on every decisions record
        # A poll's archive commit (Parquet and a Delta commit, ~40 ms for 6 MB of events,
        # in Rust off the GIL) and the publishing of its decisions behind it run on a
        # thread of their own, with table handles of their own, while the stage polls and
        # assembles the next records. One poll at a time, in poll order: a decision still
        # goes out only once its events are durable, and a watermark after the decisions
        # it covers. The next commit waits for it first and raises its error, so nothing
        # is written after a failed one.
        self.archive_lake = Lake(lake.root, lake.storage_options)
        self.archive_lake.after_commit = lake.after_commit  # the archive's compaction turns
        self.archiver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archive")
        self.archiving: Future[None] | None = None

    def close(self, timeout_s: float | None = None) -> None:
        if self.archiving is not None:
            done, _ = wait([self.archiving], timeout=timeout_s)
            # A failed commit or publish was raised by the poll after it (the error the
            # processor exits with), or the processor is stopping on another error, which
            # it says: the restart archives and publishes it again.
            if done and (error := self.archiving.exception()) is not None:
                log.info("a poll's archive commit or its decisions failed on the way out "
                         "(%s): the next run does it again", error)
        super().close(timeout_s)  # closing the producer ends a publish stuck on a lost broker
        self.archiver.shutdown(wait=True)

    @property
    def _handed_off(self) -> Future[None] | None:
        return self.archiving

    def _archive_written(self) -> None:
        """Wait for the poll handed to the archiver; raises its error."""
        if self.archiving is not None:
            self.archiving.result()

    def _archive_settled(self) -> None:
        """Wait for the poll handed to the archiver, its error left to the next commit
        (which raises it)."""
        if self.archiving is not None:
            wait([self.archiving])

    # -- partition ownership ---------------------------------------------------------------

    def _release(self, partitions: set[int]) -> None:
        # An archive commit landing after a new owner took the partition over would add
        # its rows a second time, and the decisions behind it would go out twice. (This
        # runs inside the client's poll.)
        self._archive_settled()
        for key in [k for k, p in self.pending.items() if p.partition in partitions]:
            del self.pending[key]
        for partition in partitions:
            self.recorded.pop(partition, None)
            self.clocks.pop(partition, None)
            self.timeouts.pop(partition, None)
            self._published.pop(partition, None)

    def _take_over(self, assigned: set[TopicPartition]) -> None:
        # The rebuild publishes watermarks of every owned partition: never before the
        # decisions still in the archiver that they cover.
        self._archive_written()
        # The archiver is idle now. Its handle may predate another owner's archive commits
        # to these partitions: its first commit would conflict with them and retry.
        self.archive_lake.refresh("events")
        self.runs.catch_up()
        decided = self.lake.read("groups", columns=["run_id", "group_index"])
        for key in zip(decided.column("run_id").to_pylist(),
                       decided.column("group_index").to_pylist(), strict=True):
            self.decided.setdefault(key, set())
        dead = self.lake.read("dead_letters", columns=["run_id", "group_index", "error"])
        for run_id, group_index, error in zip(*(dead.column(c).to_pylist() for c in dead.column_names), strict=True):
            if group_index is not None and error.startswith(NO_GROUP_STARTED):
                self.dead.add((run_id, group_index))
        for tp in sorted(assigned, key=lambda t: t.partition):
            recorded = self._archived_up_to(tp)
            self.check_continuity(tp, recorded)
            self.recorded[tp.partition] = recorded
            self.consumer.seek(tp, 0 if recorded is None else recorded + 1)
            self._load_event_ids(tp.partition)
            self.clocks[tp.partition] = PartitionClock()
            self.timeouts[tp.partition] = TimeoutQueue()
            self._rebuild(tp.partition)

    def _lake_positions(self, partitions: list[TopicPartition]
                        ) -> dict[TopicPartition, int | None]:
        return {tp: self._archived_up_to(tp) for tp in partitions}

    def _archived_up_to(self, tp: TopicPartition) -> int | None:
        """The last offset of `tp` the events archive recorded; None before any."""
        return self.lake.txn_version("events", app_id("events", tp.topic, tp.partition))

    def _load_event_ids(self, partition: int) -> None:
        archive = self.lake.read(
            "events",
            filter=(pc.field("topic") == self.topics.events) & (pc.field("partition") == partition),
            columns=["run_id", "event_id", "group_index"],
        )
        self.event_groups.update(zip(
            zip(archive.column("run_id").to_pylist(), archive.column("event_id").to_pylist(),
                strict=True),
            archive.column("group_index").to_pylist(), strict=True,
        ))

    def _rebuild(self, partition: int) -> None:
        """Re-assemble the partition's undecided groups from the archive, in offset order."""
        archive = read_archive(self.lake, (pc.field("topic") == self.topics.events)
                               & (pc.field("partition") == partition))
        if not archive:
            return
        clock = self.clocks[partition]
        clock.advance(max(row.at_us for row in archive))
        for row in archive:
            ids = None if row.group_index is None else self.decided.get((row.run_id, row.group_index))
            if ids is not None:
                # A late redelivery of this event is a duplicate, not an event for a
                # decided group.
                ids.add(row.event_id)
        folded = fold_partition(archive, lambda *key: key in self.decided or key in self.dead)
        batch = _Batch()
        for key, group in folded.items():
            pending = self._open(key, partition, group.first_us, group.builder)
            if group.completed is not None:
                pending.completed_us, offset = group.completed
                pending.completed_at = (partition, offset)
            if group.started is not None:  # the notice may not have gone out before the restart
                at_us, offset, step = group.started
                batch.decisions.append(Opened(key[0], key[1], step, at_us, partition, offset))
        # Only complete groups are decided; the others wait for their remaining events.
        complete = {k: at for k in folded if (at := self.pending[k].completed_at) is not None}
        for key in sorted(complete, key=complete.__getitem__):
            self._try_decide(key, batch)
        self._expire(partition, batch)  # timed out before the restart, not yet published
        again = sorted(d.header.group_index for d in batch.decisions
                       if isinstance(d, DecidedGroup))
        log.info("partition %d: rebuilt %d undecided groups; decided %d of them again %s",
                 partition, len(folded), len(again), again[:50])
        self._publish(batch.decisions, self._watermarks_due())
        self.dead_letters.commit([])

    # -- the loop --------------------------------------------------------------------------

    def _new_batch(self) -> _Batch:
        return _Batch()

    def _handle(self, record: Any, batch: _Batch) -> None:
        try:
            self._handle_record(record, batch)
        except Exception as err:  # noqa: BLE001 - nothing a producer sends may stop the stage
            log.exception("record %s[%d]@%d could not be processed", record.topic,
                          record.partition, record.offset)
            self.dead_letters.add(record.topic, record.partition, record.offset,
                                  f"cannot be processed: {type(err).__name__}: {err}",
                                  record.value)

    def _wrong_partition(self, record: Any, run_id: str, group_index: int) -> str | None:
        """Why the event is on another partition than its group's key hashes to, or None."""
        pending = self.pending.get((run_id, group_index))
        if pending is not None and pending.partition == record.partition:
            return None  # the group's first event was checked (or archived) here
        partitions = self.consumer.partitions_for_topic(record.topic)
        if not partitions:
            return None
        key = event_group_key(run_id, group_index)
        expected = key_partition(key, len(partitions))
        if expected == record.partition:
            return None
        return (f"event arrived on partition {record.partition}, but its group's key "
                f"{key.decode()!r} belongs on partition {expected} of {len(partitions)} "
                "(murmur2, CONTRACT section 1): the producer uses another partitioner; "
                "librdkafka-based clients must set partitioner=murmur2_random "
                "(docs/producers.md)")

    def _handle_record(self, record: Any, batch: _Batch) -> None:
        partition, offset = record.partition, record.offset
        recorded = self.recorded.get(partition)
        if recorded is not None and offset <= recorded:
            return  # archived before a restart
        try:
            event = decode_trajectory_event(record.value)
        except EventValidationError as err:
            self.dead_letters.add(record.topic, partition, offset, str(err), record.value)
            return
        key = (event.run_id, event.group_index)
        reject = self._wrong_partition(record, event.run_id, event.group_index)
        owner = self.event_groups.get((event.run_id, event.event_id))
        if reject is not None:
            pass
        elif owner == event.group_index:
            return  # a duplicate delivery of an event already archived
        elif owner is not None:
            reject = (f"event_id {event.event_id!r} is already used by group {owner} of run "
                      f"{event.run_id}: an event id is unique within its run")
        elif key in self.decided:
            if event.event_id in self.decided[key]:
                return  # a duplicate delivery of an event already applied
            reject = f"group {event.group_index} of run {event.run_id} is already decided"
        elif key in self.dead:
            reject = f"{NO_GROUP_STARTED} for group {event.group_index}: the group was dead-lettered"
        at_us = self.clocks[partition].event_time(event.ts, record.timestamp, time.time())
        if reject is None:
            row = ArchiveRows.row(record, event, at_us)  # raises before the group changes
            pending = self.pending.get(key) or self._open(key, partition, at_us)
            result = pending.builder.apply(event)
            if not pending.builder.event_ids:
                del self.pending[key]  # its first event was refused: no group yet
            if result.status == "duplicate":
                return
            reject = result.reason
            if result.evicted:
                self._dead_letter_evicted(key, result.evicted, batch)
        if reject is not None:
            self.dead_letters.add(record.topic, partition, offset, reject, record.value,
                                  run_id=event.run_id, group_index=event.group_index)
            return
        batch.archive.append(row)
        self.event_groups[(event.run_id, event.event_id)] = event.group_index
        if isinstance(event, GroupStarted):
            batch.decisions.append(Opened(event.run_id, event.group_index, event.step, at_us,
                                           partition, offset))
        if pending.builder.group.complete and pending.completed_at is None:
            pending.completed_at, pending.completed_us = (partition, offset), at_us
            self._try_decide(key, batch)
        if self.clocks[partition].advance(at_us):
            self._expire(partition, batch)

    def _open(self, key: GroupKey, partition: int, first_us: int,
              builder: GroupBuilder | None = None) -> _Pending:
        """A new undecided group whose first archived event has event time `first_us`
        (`builder`: the group as far as the archive has it)."""
        builder = builder or GroupBuilder(key[0], key[1], first_us / 1e6)
        pending = self.pending[key] = _Pending(builder, partition)
        self.timeouts[partition].add(key[0], key[1], first_us)
        return pending

    def _dead_letter_evicted(self, key: GroupKey, evicted: tuple[tuple[str, str], ...],
                             batch: _Batch) -> None:
        """Dead-letter archived fragments that turned out to lie beyond their rollout's
        fragment_count (their archive rows stay: replay evicts them the same way)."""
        reasons = dict(evicted)
        for event_id, topic, partition, offset, raw in self._archived(key, batch, list(reasons)):
            self.dead_letters.add(topic, partition, offset, reasons[event_id], raw,
                                  run_id=key[0], group_index=key[1])

    def _archived(self, key: GroupKey, batch: _Batch, event_ids: list[str] | None = None
                  ) -> list[tuple[str, str, int, int, bytes]]:
        """(event_id, topic, partition, offset, raw) of the group's archived events, those
        of this poll (not committed yet) and of the poll in the archiver included; only
        `event_ids` when given."""
        # Not `_archive_written`: an error raised in a handler would dead-letter the event.
        self._archive_settled()
        wanted = None if event_ids is None else set(event_ids)
        found: dict[str, tuple[str, str, int, int, bytes]] = {}
        c = batch.archive.columns
        for i, event_id in enumerate(c["event_id"]):
            if ((c["run_id"][i], c["group_index"][i]) == key
                    and (wanted is None or event_id in wanted)):
                found[event_id] = (event_id, c["topic"][i], c["partition"][i], c["offset"][i],
                                   c["payload"][i])
        where = (pc.field("run_id") == key[0]) & (pc.field("group_index") == key[1])
        if wanted is not None:
            where &= pc.field("event_id").isin(sorted(wanted))
        archived = self.lake.read("events", filter=where,
                                  columns=["event_id", "topic", "partition", "offset", "payload"])
        for event_id, topic, partition, offset, payload in zip(
            *(archived.column(n).to_pylist() for n in archived.column_names), strict=True
        ):
            found.setdefault(event_id, (event_id, topic, partition, offset, payload.encode()))
        return sorted(found.values(), key=lambda row: (row[2], row[3]))

    def _try_decide(self, key: GroupKey, batch: _Batch) -> None:
        pending = self.pending[key]
        config = self.runs.get(key[0])
        if config is None:
            return  # waits for its run_started (or times out)
        # Only groups with a completing event are passed here.
        assert pending.completed_at is not None and pending.completed_us is not None
        partition, offset = pending.completed_at
        self._finish(key, config, {"partition": partition, "offset": offset},
                     pending.completed_us, batch)

    def _finish(self, key: GroupKey, config: RunConfig, source: dict[str, int], at_us: int,
                batch: _Batch, *, timed_out: bool = False) -> None:
        pending = self.pending.pop(key)
        group = pending.builder.group
        decided = decide(group, config, at_us=at_us, source=source,
                         decided_at=time.time(), timed_out=timed_out)
        if decided.error is not None:
            log.warning("%s", decided.error)
            if source["offset"] >= 0:
                self.dead_letters.add(self.topics.events, source["partition"], source["offset"],
                                      decided.error, None, run_id=group.run_id,
                                      group_index=group.group_index)
        batch.decisions.append(decided.group)
        self.decided[key] = pending.builder.event_ids

    def _decide_waiting(self, batch: _Batch) -> None:
        """Decide complete groups that were waiting for their run's config."""
        for key in [k for k, p in self.pending.items() if p.completed_at is not None]:
            if key in self.pending and self.runs.get(key[0]) is not None:
                self._try_decide(key, batch)

    def _timeout_s(self, run_id: str) -> float:
        config = self.runs.get(run_id)
        return config.group_timeout_s if config else self.config.default_group_timeout_s

    def _expire(self, partition: int, batch: _Batch) -> None:
        """Time out the partition's groups still undecided when its clock reached
        first event + group_timeout_s; ordered at that deadline."""
        watermark = self.clocks[partition].watermark_us
        if watermark is None:
            return
        due = self.timeouts[partition].due(watermark,
                                           lambda run: timeout_micros(self._timeout_s(run)))
        for deadline_us, run_id, group_index in due:
            key = (run_id, group_index)
            pending = self.pending.get(key)
            if pending is None or pending.partition != partition:
                continue  # decided meanwhile
            group = pending.builder.group
            config = self.runs.get(run_id)
            if group.started and config is not None:
                self._finish(key, config, {"partition": partition, "offset": -1}, deadline_us,
                             batch, timed_out=True)
            else:
                self._dead_letter_group(key, pending, self._timeout_s(run_id), batch)

    def _dead_letter_group(self, key: GroupKey, pending: _Pending, timeout: float,
                           batch: _Batch) -> None:
        """A group without group_started (or run) after its timeout: its events are rejected."""
        del self.pending[key]
        self.dead.add(key)
        what = "group_started" if not pending.builder.group.started else "run_started for its run"
        error = f"{NO_GROUP_STARTED}: no {what} within {timeout:g} s of the group's first event"
        for _event_id, topic, partition, offset, raw in self._archived(key, batch):
            self.dead_letters.add(topic, partition, offset, error, raw,
                                  run_id=key[0], group_index=key[1])

    def _advance_idle(self, batch: _Batch) -> None:
        """Partitions with nothing left to read: their clock follows the wall clock, less
        `watermark_lag_s` (room for events still on their way), so they hold nothing up."""
        now = time.time()
        caught_up: dict[TopicPartition, int] = {}
        for partition in self.clocks:
            if partition in batch.last_offset:
                continue
            if now - self._idle_advanced_at.get(partition, 0.0) < IDLE_ADVANCE_INTERVAL_S:
                continue
            tp = TopicPartition(self.topics.events, partition)
            highwater = self.consumer.highwater(tp)
            position = self.consumer.position(tp)
            if highwater is not None and position < highwater:
                continue  # a backlog is still to be read: its own times count
            # No highwater: no fetch response for it since the take-over (kafka-python 3.0
            # on Apache Kafka can leave a fetch unanswered). Only the end offset can tell,
            # and a partition read to it must not hold back every step.
            caught_up[tp] = position
        if not caught_up:
            return
        # `highwater` is that of the partition's last fetch response, which can be seconds
        # old: kafka-python fetches a partition again only once the records of its last
        # fetch (of every partition, from Apache Kafka) are consumed. Advancing then would
        # give records already in the broker a later time than their own, so event times
        # would depend on consumption speed. The broker's end offset says what is there.
        try:
            end = self.consumer.end_offsets(list(caught_up), timeout_ms=END_OFFSETS_TIMEOUT_MS)
        except KafkaTimeoutError:
            return  # no answer (broker lost?): nothing counts as idle
        for tp, position in caught_up.items():
            if position < end.get(tp, position + 1):
                continue
            self._idle_advanced_at[tp.partition] = now
            if self.clocks[tp.partition].advance(micros(now - self.config.watermark_lag_s)):
                self._expire(tp.partition, batch)

    # -- commit and publish ----------------------------------------------------------------

    def _archive_runs(self) -> None:
        """Archive run_started events too, so replay and audit know each run's config."""
        rows, marks = ArchiveRows(), {}
        for record, event in self.runs.take_records():
            app = app_id("events", record.topic, record.partition)
            if app not in self._runs_recorded:
                self._runs_recorded[app] = self.lake.txn_version("events", app)
            recorded = self._runs_recorded[app]
            if recorded is not None and record.offset <= recorded:
                continue
            rows.add(record, event)
            marks[app] = record.offset
        if len(rows):
            self.lake.append("events", rows.table(),
                             [TxnMark(app, offset) for app, offset in marks.items()])
            self._runs_recorded.update(marks)

    def _commit(self, batch: _Batch) -> None:
        """Dead letters here; the archive and the decisions behind it handed to the
        archiver, once the previous poll's are written (its error stops the stage)."""
        self._decide_waiting(batch)
        self._advance_idle(batch)
        self._archive_written()  # before `_archive_runs`: one writer of `events` at a time
        self._archive_runs()
        topic = self.topics.events
        marks = [TxnMark(app_id("dead_letters", topic, p), o) for p, o in batch.last_offset.items()]
        self.dead_letters.commit(marks)
        archive = None
        if batch.last_offset:
            archive = (batch.archive, [TxnMark(app_id("events", topic, p), o)
                                       for p, o in batch.last_offset.items()])
            # Later records of these partitions lie beyond; the watermarks below are sent
            # only once the archive holds these.
            self.recorded.update(batch.last_offset)
        watermarks = self._watermarks_due()
        if archive is not None or batch.decisions or watermarks:
            self.archiving = self.archiver.submit(self._archive_and_publish, archive,
                                                  batch.decisions, watermarks)

    def _archive_and_publish(self, archive: tuple[ArchiveRows, list[TxnMark]] | None,
                             decisions: list[DecidedGroup | Opened],
                             watermarks: list[tuple[int, tuple[int, int]]]) -> None:
        """The archiver's work for one poll: its events, then its decisions and watermarks."""
        if archive is not None:
            rows, marks = archive
            self.archive_lake.append("events", rows.table(), marks)
        self._publish(decisions, watermarks)

    def _publish(self, decisions: list[DecidedGroup | Opened],
                 watermarks: list[tuple[int, tuple[int, int]]]) -> None:
        """Decisions and notices, then the watermarks (after them, on the same partitions,
        so a watermark never overtakes a decision it covers). A decision bound for this
        instance's own batch stage leaves its fragments in the spool (`ingest/io/spool.py`)."""
        records = [(item.run_id, encode_opened(item), b"") if isinstance(item, Opened)
                   else (item.header.run_id, *encode_decision(item)) for item in decisions]
        targets = self._decisions_targets()
        # Each run's records go where the producer's partitioner would put them, named
        # here so that the spool knows whether the instance's own batch stage reads them.
        partitions = [targets[key_partition(run_id.encode(), len(targets))]
                      for run_id, _, _ in records]
        refs = (self.spool.carry([value for _, _, value in records], partitions)
                if self.spool is not None else [None] * len(records))
        sent = []
        for (run_id, headers, value), partition, ref in zip(records, partitions, refs,
                                                            strict=True):
            if ref is not None:
                headers, value = [*headers, ref.header()], b""
            sent.append(self.producer.send(
                self.topics.decisions, key=run_id.encode(), value=value, partition=partition,
                headers=[*headers, self._sent_by]))
        for partition, bound in watermarks:
            for target in targets:
                sent.append(self.producer.send(
                    self.topics.decisions, partition=target, value=b"",
                    headers=[*encode_watermark(partition, *bound), self._sent_by]))
        if sent:
            self.await_sent(sent, "decisions")
        if decisions:  # work for the batch stage, which idleness waits for (`idle_for`)
            self.last_activity = time.monotonic()

    def _decisions_targets(self) -> list[int]:
        """The partitions of `rollout.decisions`, as the producer's metadata first had them."""
        if self._decisions_partitions is None:
            found = self.producer.partitions_for(self.topics.decisions)
            self._decisions_partitions = sorted(found or {0})
        return self._decisions_partitions

    def _watermarks_due(self) -> list[tuple[int, tuple[int, int]]]:
        """(partition, bound) of each owned partition whose bound moved since the last
        notice: its watermark and the offset after the last record processed
        (`ordering.Bound`), to send to every decisions partition.

        A complete group still waiting for its run's config holds its partition's bound at
        its completing event, so its decision can still take its place.
        """
        self._decisions_targets()
        held: dict[int, tuple[int, int]] = {}
        for pending in self.pending.values():
            if pending.completed_us is not None and pending.completed_at is not None:
                at = (pending.completed_us, pending.completed_at[1])
                held[pending.partition] = min(held.get(pending.partition, at), at)
        due = []
        for partition, clock in self.clocks.items():
            if clock.watermark_us is None:
                continue
            recorded = self.recorded.get(partition)
            bound = (clock.watermark_us, 0 if recorded is None else recorded + 1)
            bound = min(bound, held.get(partition, bound))
            if partition in self._published and bound <= self._published[partition]:
                continue
            self._published[partition] = bound
            due.append((partition, bound))
        return due
