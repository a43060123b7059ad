"""Batch stage: `rollout.decisions` -> groups, samples, training_batches, steps, step_metrics.

The stage is a deterministic state machine per run (`RunBatcher`) fed by the run's
decisions in event-time order: a `DecisionMerge` per decisions partition holds each
decision until every events partition's watermark has passed it, then applies it in
`OrderKey` order, so which group fills which step does not depend on how the group
stages' output interleaved. On every (re)assignment the stage restores its partitions'
latest snapshot (`batch_snapshot.py`) and replays the records after it (all of them
without one), and each table keeps only rows whose source offset is newer than the app
transaction that table recorded for the partition; a row's source is the record whose
arrival released it (decisions, notices and watermarks alike), so sources grow with
offsets. After a crash at any moment the tables end up exactly as after an uninterrupted
run; nothing is written twice. Seal times are event times from the decisions themselves,
not the clock, so a replay reproduces them too.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from kafka import TopicPartition

from ingest.core.batching import Effects, RunBatcher, StepDemand
from ingest.core.decided import DecidedGroup, DecisionHeader, Opened, fragments_table
from ingest.core.ordering import OPENED, DecisionMerge
from ingest.core.rows import groups_table, metric_rows, steps_row
from ingest.io.archive import archived_group
from ingest.io.lake import Lake, TxnMark
from ingest.io.spool import DecisionSpool, spooled_value
from ingest.processor.batch_snapshot import (
    BatchSnapshots,
    BatchState,
    Snapshot,
    decision_fingerprint,
)
from ingest.processor.config import ProcessorConfig
from ingest.processor.decisions import (
    UnreadableRecord,
    decision_header,
    decode_fragments,
    opened_notice,
    sender_lake,
    watermark_notice,
)
from ingest.processor.membership import GroupMember
from ingest.processor.offsets import app_id
from ingest.processor.stage import Stage
from schemas.control import Demand, StepSealed
from schemas.errors import RolloutlakeError
from schemas.tables import STEP_METRICS, STEPS

log = logging.getLogger(__name__)

# Commit order (see `_commit`). Every table filters by its own recorded offset, and a
# restart resumes at the snapshot written after them all, so the order is not needed for
# correctness. Within a seal, `steps` follows `training_batches`, so a step a reader sees
# has its whole batch. AUDIT_TABLES commit beside the seals, not after them: a `groups`
# row can show a step a moment before the `steps` row, never a batch that is incomplete.
TABLE_ORDER = ("training_batches", "steps", "samples", "step_metrics", "groups")
AUDIT_TABLES = ("samples", "step_metrics", "groups")
STEP_KEY = "rolloutlake.steps"


@dataclass
class _Pending:
    """Rows produced by one poll, per table, each with the offset that produced it."""

    rows: dict[str, list[pa.Table]] = field(default_factory=lambda: defaultdict(list))
    sources: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    last_offset: dict[int, int] = field(default_factory=dict)
    sealed: list[tuple[str, int, int, Any]] = field(default_factory=list)  # run, step, p, SealedBatch
    closed: list[tuple[str, int, int, int, dict[str, float]]] = field(default_factory=list)
    demands: list[tuple[str, int, int, StepDemand]] = field(default_factory=list)  # run, p, offset

    def add(self, table: str, rows: pa.Table, partition: int, offset: int) -> None:
        self.rows[table].append(rows)
        self.sources[table].extend([(partition, offset)] * rows.num_rows)


class BatchStage(Stage):
    """Consumer-group member on `rollout.decisions` (keyed by run: a run has one owner)."""

    # Not training_batches (trainers read it at recorded versions, one commit per step) or
    # dead_letters (raw messages, up to 8 MiB each, rare).
    compacted_tables = ("samples", "groups", "steps", "step_metrics")

    def __init__(self, config: ProcessorConfig, lake: Lake, spool: DecisionSpool | None = None,
                 member: GroupMember | None = None):
        super().__init__(config, lake, role="batches", member=member)
        # Where this instance's group stage learns which decisions partitions are read here
        # (it leaves their fragments in the spool, `ingest/io/spool.py`).
        self.spool = spool
        self._spool_missed = False  # said once that a spool reference could not be read
        self.batchers: dict[str, RunBatcher] = {}
        self.run_partition: dict[str, int] = {}
        # Opened groups of runs whose run_started is not read yet (a worker may start
        # groups before the run's config reaches the processor), by group index (a
        # restarted group stage sends its notices again; the first one stands): applied, in
        # order, when the run's batcher is created, so the step counts every group issued
        # for it.
        self.awaiting_config: dict[str, dict[int, Opened]] = {}
        self.recorded: dict[tuple[str, int], int | None] = {}
        self.closed_steps: set[tuple[str, int]] = set()
        self.merges: dict[int, DecisionMerge] = {}  # decisions partition -> held items
        self._applied = False  # this poll took over or applied something, not only watermarks
        self._runs_caught_up = False  # this poll read the runs topic to its end (_batcher)
        self.snapshots = BatchSnapshots(lake, self.topics.decisions, config.snapshot_every)
        self.restored: dict[int, Snapshot | None] = {}
        self.resumed_from: dict[int, int] = {}  # partition -> offset taken over at
        self.foreign: set[str] = set()  # other lakes whose records were skipped
        # A Delta commit runs mostly in Rust, off the GIL: the audit tables' commits of a
        # poll overlap, and a decision's `groups` row waits for one commit, not three.
        self.committers = ThreadPoolExecutor(max_workers=len(AUDIT_TABLES),
                                             thread_name_prefix="commit")
        # A step's seal (~100 ms: its whole batch) runs on a thread of its own, one seal
        # after the other, while the next polls' decisions get their audit rows: those
        # would otherwise wait the seal out (the tail of a decision's latency).
        self.sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="seal")
        self.sealing: Future[None] | None = None

    def close(self, timeout_s: float | None = None) -> None:
        # A failed seal was raised by the poll or flush after it, or the processor is
        # stopping on another error: no snapshot passed it, so the next run seals again.
        if self.sealing is not None and (error := self.sealing.exception()) is not None:
            log.error("a step's seal failed on the way out (%s): the next run seals it", error)
        super().close(timeout_s)
        self.committers.shutdown(wait=True)
        self.sealer.shutdown(wait=True)

    # -- partition ownership ---------------------------------------------------------------

    def _release(self, partitions: set[int]) -> None:
        # A seal committed after a new owner took the partition over would add its rows
        # a second time: that owner skips only what the lake recorded when it took over.
        # (A failure is raised by the next poll: this runs inside the client's poll.)
        if self.sealing is not None:
            wait([self.sealing])
        for run_id in [r for r, p in self.run_partition.items() if p in partitions]:
            self.batchers.pop(run_id, None)
            self.awaiting_config.pop(run_id, None)
            self.run_partition.pop(run_id, None)
        for partition in partitions:
            self.merges.pop(partition, None)
        if self.spool is not None:
            self.spool.own(self.owned - partitions)

    def _take_over(self, assigned: set[TopicPartition]) -> None:
        self.runs.catch_up()
        metrics = self.lake.read("step_metrics", columns=["run_id", "step"])
        self.closed_steps = set(
            zip(metrics.column("run_id").to_pylist(), metrics.column("step").to_pylist(), strict=True)
        )
        self._applied = True  # a take-over is activity: idle counts from here
        events = self.consumer.partitions_for_topic(self.topics.events)
        event_partitions = len(events) if events else self.config.kafka.event_partitions
        for tp in assigned:
            self.merges[tp.partition] = DecisionMerge(event_partitions)
            for table in TABLE_ORDER:
                self.recorded[(table, tp.partition)] = self.lake.txn_version(
                    table, app_id(table, tp.topic, tp.partition)
                )
            self._restore(tp)
        if self.spool is not None:
            self.spool.own(self.owned | {tp.partition for tp in assigned})

    def _restore(self, tp: TopicPartition) -> None:
        """Load the partition's latest snapshot, check the topic, seek.

        From the snapshot's offset on (or from offset 0 without one) the state machine
        rebuilds exactly, and the tables skip rows they already hold.
        """
        snapshot = self.snapshots.latest(tp.partition)
        self.restored[tp.partition] = snapshot
        recorded = self._recorded("groups", tp.partition)
        if snapshot is not None and (recorded is None or recorded < snapshot.offset):
            recorded = snapshot.offset
        self.check_continuity(tp, recorded)
        start = 0
        if snapshot is not None:
            self.batchers.update(snapshot.state.batchers)
            self.awaiting_config.update(snapshot.state.awaiting_config)
            runs = set(snapshot.state.batchers) | set(snapshot.state.awaiting_config)
            self.run_partition.update(dict.fromkeys(runs, tp.partition))
            self.merges[tp.partition] = snapshot.state.merge
            start = snapshot.offset + 1
        self.consumer.seek(tp, start)
        self.resumed_from[tp.partition] = start
        log.info("%s[%d]: resuming at offset %d (%s; tables recorded %s)", tp.topic,
                 tp.partition, start,
                 "after its snapshot" if snapshot else "no snapshot: replaying",
                 {t: self._recorded(t, tp.partition) for t in TABLE_ORDER})

    def _stored_message(self, tp: TopicPartition, up_to: int) -> tuple[int, bytes] | None:
        snapshot = self.restored.get(tp.partition)
        return None if snapshot is None else (snapshot.offset, snapshot.fingerprint)

    def _fingerprint(self, record: Any) -> bytes:
        return decision_fingerprint(record)

    def _snapshot(self, partitions: Iterable[int]) -> None:
        partitions = list(partitions)
        if not partitions:
            return
        # A restart resumes after the snapshot: every seal up to it must be in the lake.
        self._sealed()
        self.snapshots.save({
            p: (self.last_records[p], BatchState(
                {r: b for r, b in self.batchers.items() if self.run_partition.get(r) == p},
                self.merges[p],
                {r: o for r, o in self.awaiting_config.items() if self.run_partition.get(r) == p}))
            for p in partitions if p in self.last_records
        })

    # -- the loop --------------------------------------------------------------------------

    def _new_batch(self) -> _Pending:
        return _Pending()

    def _batcher(self, run_id: str, partition: int) -> RunBatcher | None:
        config = self.runs.get(run_id)
        if config is None and not self._runs_caught_up:
            # Once per poll: a stream of items of a run whose run_started never comes
            # would otherwise cost a broker round trip each.
            self.runs.catch_up()
            self._runs_caught_up = True
            config = self.runs.get(run_id)
            if config is None:
                # A group stage saves a run's config to the lake before it decides any of
                # its groups, so a decision's config is there even when this stage's
                # reader of the runs topic is behind (a stalled fetch, a slow broker).
                self.runs.load(self.lake)
                config = self.runs.get(run_id)
        if config is None:
            return None
        batcher = self.batchers.get(run_id)
        if batcher is None:
            batcher = self.batchers[run_id] = RunBatcher(run_id, config)
            self.run_partition[run_id] = partition
            for opened in self.awaiting_config.pop(run_id, {}).values():
                batcher.apply(opened)
        batcher.config = config  # a later run_started applies from here on
        return batcher

    def poll_once(self) -> int:
        """As `Stage.poll_once`; a poll that only moved watermarks is no activity, so
        `--until-idle` still ends once every decision is applied."""
        before, self._applied = self.last_activity, False
        self._runs_caught_up = False
        count = super().poll_once()
        if not self._applied:
            self.last_activity = before
        return count

    def _handle(self, record: Any, pending: _Pending) -> None:
        sent_for = sender_lake(record)
        if sent_for not in (None, self.lake_id):
            if sent_for not in self.foreign:
                self.foreign.add(sent_for)
                log.warning("%s[%d]@%d: records sent for another lake (events table id %s; "
                            "this one's is %s), by a deployment of its own on these topics, "
                            "are skipped", record.topic, record.partition, record.offset,
                            sent_for, self.lake_id)
            return
        merge = self.merges[record.partition]
        late = merge.late
        try:
            mark = watermark_notice(record)
            item = None if mark is not None else opened_notice(record) or decision_header(record)
        except UnreadableRecord as err:  # not from a group stage: a restart would meet it again
            self.dead_letters.add(record.topic, record.partition, record.offset,
                                  f"unreadable decisions record: {err}", record.value)
            return
        if mark is not None:
            merge.watermark(mark["partition"], mark["at_us"], mark.get("next_offset"))
        else:
            self._applied = True
            if item is None:
                self.dead_letters.add(record.topic, record.partition, record.offset,
                                      "not a rolloutlake decision (no 'decision' header)",
                                      record.value)
                return
            key = item.order_key()
            applied = self.batchers.get(key.run_id)
            if applied is not None and key.group_index in (
                    applied.opened if key.kind == OPENED else applied.decided):
                if key.kind != OPENED:  # rare (restarts only); says which copy stood
                    log.info("%s[%d]@%d: decision of group %d of run %s sent again; the one "
                             "applied before stands", record.topic, record.partition,
                             record.offset, key.group_index, key.run_id)
                return  # sent again after a group-stage restart; the first one stands
            merge.add(key, (record.offset, item, self._fragments_value(record)))
        for _key, (offset, item, value) in merge.ready():
            self._applied = True
            if isinstance(item, Opened):
                batcher = self._batcher(item.run_id, record.partition)
                if batcher is not None:
                    batcher.apply(item)
                else:
                    self.awaiting_config.setdefault(item.run_id, {}).setdefault(
                        item.group_index, item)
                    self.run_partition[item.run_id] = record.partition
            else:
                self._decide(item, value, offset, record, pending)
        if merge.late > late:
            log.warning("decisions partition %d: a decision came after later ones were "
                        "applied (an event later than watermark_lag_s on an idle events "
                        "partition that changed owner); applied now", record.partition)

    def _fragments_value(self, record: Any) -> bytes | pa.Buffer | None:
        """The decision's fragments (`spool.spooled_value`); None where they cannot be read
        here, and its group is re-assembled from the archive."""
        value, unread = spooled_value(record)
        if unread is not None and not self._spool_missed:
            self._spool_missed = True
            log.info("%s[%d]@%d: the decision's fragments are %s; its group, and any other "
                     "such, is re-assembled from the events archive", record.topic,
                     record.partition, record.offset, unread)
        return value

    def _decide(self, header: DecisionHeader, value: bytes | pa.Buffer | None, offset: int,
                release: Any, pending: _Pending) -> None:
        """Apply one decision (from `offset`), released by the record `release`: its
        output rows carry the releasing record's offset."""
        batcher = self._batcher(header.run_id, release.partition)
        if batcher is None:
            self.dead_letters.add(release.topic, release.partition, offset,
                                  f"decision for run {header.run_id} without run_started",
                                  None if value is None else bytes(value),
                                  run_id=header.run_id, group_index=header.group_index)
            return
        if header.fragments_in_archive or value is None:
            fragments = fragments_table(
                archived_group(self.lake, header.run_id, header.group_index),
                batcher.config.reward_key, with_tokens=header.decision == "kept",
            )
        else:
            try:
                fragments = decode_fragments(value)
            except UnreadableRecord as err:
                self.dead_letters.add(release.topic, release.partition, offset,
                                      f"unreadable decisions record: {err}", bytes(value),
                                      run_id=header.run_id, group_index=header.group_index)
                return
        effects = batcher.apply(DecidedGroup(header, fragments))
        self._collect(header.run_id, release.partition, release.offset, effects, pending)

    def _collect(self, run_id: str, partition: int, offset: int, effects: Effects,
                 pending: _Pending) -> None:
        if effects.groups:
            pending.add("groups", groups_table(effects.groups), partition, offset)
        for samples in effects.samples:
            pending.add("samples", samples, partition, offset)
        for sealed in effects.sealed:
            pending.add("training_batches", sealed.rows, partition, offset)
            pending.sealed.append((run_id, sealed.step, offset, sealed))
        for step, metrics in effects.closed:
            pending.closed.append((run_id, step, partition, offset, metrics))
        for demand in effects.demands:
            pending.demands.append((run_id, partition, offset, demand))

    def flush(self) -> None:
        """Close every sealed step (shutdown), so the last steps get their metrics too."""
        # Snapshot first: a restart resumes with the steps open, as an uninterrupted run
        # has them.
        self._snapshot(list(self.last_records))
        held = sum(len(merge) for merge in self.merges.values())
        if held:
            log.warning("stopping with %d decisions and notices held: the events partitions' "
                        "watermarks have not passed them (their group stage stopped first?); "
                        "the next run applies them", held)
        pending = _Pending()
        for run_id, batcher in self.batchers.items():
            self._collect(run_id, self.run_partition[run_id], -1, batcher.flush(), pending)
        self._commit(pending)
        self._sealed()

    # -- commit ----------------------------------------------------------------------------

    def _commit(self, pending: _Pending) -> None:
        """Samples, metrics and groups side by side, the poll's seal (if any) handed to the
        sealer; demands go out first: a restart resends those newer than the `groups` rows.
        A seal that failed fails the poll after it."""
        if not self._hand_off_running:
            self._sealed()  # raises a seal's error: nothing is committed after it
        topic = self.topics.decisions
        marks = dict(pending.last_offset)
        published = {p: self._recorded("groups", p) for p in marks}
        sent_demands = []
        for run_id, demand in self._new_demands(pending, published):
            needed = Demand(run_id=run_id, step=demand.step, groups_needed=demand.groups_needed,
                            kept=demand.kept, in_flight=demand.in_flight, issued=demand.issued)
            sent_demands.append(self.producer.send(self.topics.control, key=run_id.encode(),
                                                   value=needed.model_dump_json().encode()))
        if sent_demands:
            # before the `groups` rows, which mark them as published
            self.await_sent(sent_demands, "demand messages")
        commits: list[Future[Any]] = [self.committers.submit(self._write, "samples", pending, marks),
                   self.committers.submit(self._write_metrics, pending, marks),
                   self.committers.submit(self._write, "groups", pending, marks)]
        if pending.rows.get("training_batches") or pending.sealed:
            self.sealing = self.sealer.submit(self._seal, self.sealing, pending, marks)
        wait(commits)  # all of them, even when one fails, before anything else is written
        for commit in commits:
            commit.result()
        self.dead_letters.commit(
            [TxnMark(app_id("dead_letters", topic, p), o) for p, o in marks.items()]
        )
        self._snapshot([p for p, o in marks.items() if self.snapshots.due(p, o)])

    def _sealed(self) -> None:
        """Wait for the seals handed to the sealer; raises a failed one's error, at every
        call (each seal after it fails too)."""
        if self.sealing is not None:
            self.sealing.result()

    def _seal(self, previous: Future[None] | None, pending: _Pending,
              marks: dict[int, int]) -> None:
        """`training_batches`, then `steps`, then `step_sealed`; never after a seal that
        failed: its offsets would be marked as written without its rows."""
        if previous is not None:
            previous.result()
        # What the table held before this write: a step at or below it was written before
        # a restart, by another commit than this one.
        held = {p: self._recorded("training_batches", p) for p in marks}
        batch_version = self._write("training_batches", pending, marks)
        new_steps = self._write_steps(pending, batch_version, held, marks)
        sent_seals = []
        for run_id, step, sealed_at in new_steps:
            sealed = StepSealed(run_id=run_id, step=step, sealed_at=sealed_at)
            sent_seals.append(self.producer.send(self.topics.control, key=run_id.encode(),
                                                 value=sealed.model_dump_json().encode()))
        if sent_seals:
            self.await_sent(sent_seals, "step_sealed messages")

    def _new_demands(self, pending: _Pending, published: dict[int, int | None]
                     ) -> list[tuple[str, StepDemand]]:
        """The poll's demands not published before a restart (their record is newer than
        the `groups` rows committed then, written after the demands are sent) and whose step is
        still open at the end of the poll."""
        out = []
        for run_id, partition, offset, demand in pending.demands:
            before = published.get(partition)
            batcher = self.batchers.get(run_id)
            if (before is not None and offset <= before) or batcher is None \
                    or demand.step in batcher.sealed:
                continue
            out.append((run_id, demand))
        return out

    def _recorded(self, table: str, partition: int) -> int | None:
        return self.recorded.get((table, partition))

    def _advance(self, table: str, partition: int, offset: int) -> None:
        recorded = self._recorded(table, partition)
        self.recorded[(table, partition)] = offset if recorded is None else max(offset, recorded)

    def _write(self, table: str, pending: _Pending, marks: dict[int, int]) -> int | None:
        """Append the poll's rows of `table` that the table does not hold yet."""
        parts = pending.rows.get(table, [])
        version = None
        if parts:
            recorded = {p: self._recorded(table, p) for p in marks}
            keep = [
                (at := recorded.get(p)) is None or o > at for p, o in pending.sources[table]
            ]
            rows = pa.concat_tables(parts)
            if not all(keep):  # only after a restart: a filter copies every token buffer
                rows = rows.filter(pa.array(keep, pa.bool_()))
            if rows.num_rows:
                version = self.lake.append(
                    table, rows,
                    [TxnMark(app_id(table, self.topics.decisions, p), o) for p, o in marks.items()],
                )
        for p, o in marks.items():
            self._advance(table, p, o)
        return version

    def _write_steps(self, pending: _Pending, batch_version: int | None,
                     batches_held: dict[int, int | None], marks: dict[int, int]
                     ) -> list[tuple[str, int, float]]:
        """`steps` rows of the poll's sealed steps, each with the `training_batches`
        version holding its batch: `batch_version` (this seal's commit), unless the table
        held the step's offset before it (`batches_held`), and then found in the log."""
        new_rows = []
        for run_id, step, offset, sealed in pending.sealed:
            partition = self.run_partition[run_id]
            recorded = self._recorded("steps", partition)
            if recorded is not None and offset <= recorded:
                continue
            version = batch_version
            held = batches_held.get(partition)
            if version is None or (held is not None and offset <= held):
                version = self._find_batch_version(run_id, step)
            new_rows.append(steps_row(run_id, sealed, version))
        if new_rows:
            self.lake.append(
                "steps", pa.Table.from_pylist(new_rows, schema=STEPS.schema),
                [TxnMark(app_id("steps", self.topics.decisions, p), o) for p, o in marks.items()],
            )
        for p, o in marks.items():
            self._advance("steps", p, o)
        return [(r["run_id"], r["step"], r["sealed_at"] / 1e6) for r in new_rows]

    def _find_batch_version(self, run_id: str, step: int) -> int:
        """The training_batches version holding a step written before a restart."""
        version = self.lake.first_version_with(
            "training_batches", f"run_id = '{run_id}' AND step = {int(step)}")
        if version is None:
            raise RolloutlakeError(
                f"run {run_id} step {step}: training_batches recorded the step's offset but "
                "holds none of its rows"
            )
        return version

    def _write_metrics(self, pending: _Pending, marks: dict[int, int]) -> None:
        rows = []
        for run_id, step, _partition, _offset, metrics in pending.closed:
            if (run_id, step) in self.closed_steps:
                continue
            self.closed_steps.add((run_id, step))
            rows.extend(metric_rows(run_id, step, metrics))
        if rows:
            # Keyed by (run, step): a replayed closure is skipped above, so no offset marks
            # are needed (and a flush at shutdown has no offset of its own).
            self.lake.append("step_metrics", pa.Table.from_pylist(rows, schema=STEP_METRICS.schema))

    @property
    def idle(self) -> bool:
        held = any(len(merge) for merge in self.merges.values())
        return super().idle and not held

    @property
    def _handed_off(self) -> Future[None] | None:
        return self.sealing
