"""What both processor stages share: a consumer-group member with its producer and runs.

kafka-python calls rebalance listeners on its network thread, where blocking calls are not
allowed, so a stage only notes newly assigned partitions there and takes them over (reads
Delta, seeks) at the top of its next `poll_once`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import pyarrow.compute as pc
from kafka import ConsumerRebalanceListener, TopicPartition
from kafka.errors import InvalidSessionTimeoutError, KafkaError

from ingest.io.kafka import (
    close_producer,
    fetch_position,
    poll_in_group,
    unacknowledged,
)
from ingest.io.lake import BackgroundCompaction, Lake
from ingest.processor.config import ProcessorConfig
from ingest.processor.dead_letters import DeadLetters
from ingest.processor.health import (
    FreezeWatch,
    StageHealth,
    broker_connections,
    broker_reachable,
    topic_id,
)
from ingest.processor.membership import (
    SESSION_TIMEOUTS_MS,
    GroupMember,
    Role,
    group_consumer,
)
from ingest.processor.run_configs import RunConfigs
from schemas.errors import BrokerUnavailableError, ConfigError, RolloutlakeError

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 10.0
# How often a stage compares its positions with the end offsets (`idle` needs them
# reached), and after how many seconds of empty polls behind them it says why and, unless
# those partitions are paused, joins again with a new consumer (a fetch that never
# completes: kafka-python 3.0 on Apache Kafka).
CATCH_UP_CHECK_S = 0.5
STALL_REPORT_S = 10.0
# A partition the consumer lists as assigned that was never handed over (or was revoked
# and never assigned again) for this many seconds of polls: kafka-python 3.0 can leave a
# rejoin unfinished (seen on Apache Kafka), and the stage then joins with a new consumer.
REJOIN_AFTER_S = 30.0


class TopicUnreadableError(RolloutlakeError):
    """A partition that could not be read to check it (`Stage.check_continuity`)."""


class Stage(ConsumerRebalanceListener):
    """Subclasses implement `_take_over`, `_release`, `_new_batch`, `_handle`, `_commit`."""

    # The tables the stage appends to every poll, kept few-files by BackgroundCompaction.
    compacted_tables: tuple[str, ...] = ()

    def __init__(self, config: ProcessorConfig, lake: Lake, *, role: Role,
                 member: GroupMember | None = None):
        """`member` is the stage's consumer-group member where the caller started its join
        already (`membership.start_members`); otherwise the stage starts it first. Either
        way the rest of the stage (the runs, the subclass's state, the imports of its first
        table reads) is built while the broker holds the join, and the first `poll_once`
        takes its outcome. The stage owns the member from here on, and closes it when it
        fails to build."""
        if member is None:
            member = GroupMember(config, role)
        self.config = config
        self.lake = lake
        self.group_id, self.topic = member.group_id, member.topic
        self.session_timeout_ms = member.session_timeout_ms
        self.member = member  # until the first poll takes its outcome
        self.consumer = member.consumer
        self.health = StageHealth(role, self.group_id, config.kafka.bootstrap_servers,
                                  config.broker_timeout_s, config.join_timeout_s)
        self.health.session_timeout_ms = self.session_timeout_ms
        self.producer: Any = None
        try:
            self.compaction = BackgroundCompaction(lake, self.compacted_tables,
                                                   config.compact_every)
            # Which lake this is, as the decisions records name it (decisions.LAKE)
            self.lake_id = str(lake.refresh("events").metadata().id)
            self.topics = config.kafka.topics
            # Decisions stay on loopback or a LAN inside the deployment: compressing them
            # costs more CPU on both stages than it saves on the wire.
            self.producer = config.kafka.producer(compression_type=None)
            self.dead_letters = DeadLetters(lake, self.producer, self.topics.deadletter)
            # The group stage, which archives run_started events, keeps the runs table.
            self.runs = RunConfigs(config.kafka, self.dead_letters, lake, save=role == "groups")
        except BaseException:
            member.close()
            if self.producer is not None:
                self.producer.close()
            raise
        self.topic_id: Any = None  # the broker's id of `topic` when it was taken over
        self.connections: set[Any] = set()  # the consumer's, as of the last poll
        self.freezes = FreezeWatch.freezes()  # as of the last poll
        # Why the owned partitions are checked (their records held back) before more of
        # them is handled: a new broker connection or a freeze of the process.
        self.unverified: str | None = None
        self.last_activity = time.monotonic()
        self.joined = False  # idle only counts once the consumer group assigned partitions
        self.newly_assigned: set[TopicPartition] = set()
        # An assignment may be empty (more members than partitions): it still ends the join.
        self.rebalanced = False
        self.owned: set[int] = set()  # partitions taken over and not revoked since
        self.consumed: dict[int, int] = {}  # partition -> last offset committed, for the lag
        self.last_records: dict[int, Any] = {}  # partition -> the last record handled
        # Set while a poll's records are handled and committed, which can take longer than
        # --until-idle on a large lake: that is work, not idleness.
        self.working = False
        # Owned partitions read up to the end offsets of the last check (_check_caught_up)
        self.caught_up = False
        # When the end offsets `caught_up` was measured against were read: what another
        # stage sent before then, this stage has read.
        self.caught_up_as_of = 0.0
        self.end_checked_at = 0.0
        self.ends_checked: dict[TopicPartition, int] = {}  # end offsets at that check
        self.empty_polls = 0  # in a row
        self.unowned_polls = 0  # in a row, with an assigned partition not taken over
        self.stall_reported_at = 0

    def _member(self, listener: ConsumerRebalanceListener) -> Any:
        """A new consumer of the stage's group, at `session_timeout_ms`, with `listener`."""
        consumer = group_consumer(self.config, self.group_id, self.topic,
                                  self.session_timeout_ms, listener)
        self.health.session_timeout_ms = self.session_timeout_ms
        return consumer

    def _rejoin_with_longer_session_timeout(self) -> None:
        """The broker refused `session_timeout_ms`: the next of SESSION_TIMEOUTS_MS, unless
        the user chose it (a one-line error then)."""
        longer = [ms for ms in SESSION_TIMEOUTS_MS if ms > self.session_timeout_ms]
        if self.config.session_timeout_ms is not None or not longer:
            raise ConfigError(
                f"--session-timeout-ms: the broker refuses {self.session_timeout_ms} ms "
                "(outside its group.min.session.timeout.ms..group.max.session.timeout.ms; "
                "Apache Kafka's minimum is 6000 by default)")
        log.info("%s stage: the broker refuses a %d ms session timeout; joining with %d ms",
                 self.health.role, self.session_timeout_ms, longer[0])
        self.consumer.close()
        self.session_timeout_ms = longer[0]
        self.consumer = self._member(self)

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.newly_assigned |= set(assigned)
        self.rebalanced = True

    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        # Also reached from on_partitions_lost (a session expired), after which kafka-python
        # lists no assignment while it rejoins: read to the end before says nothing now.
        self.newly_assigned -= set(revoked)
        self.owned -= {tp.partition for tp in revoked}
        self.caught_up, self.ends_checked = False, {}
        for tp in revoked:
            self.last_records.pop(tp.partition, None)
        self._release({tp.partition for tp in revoked})

    def poll_once(self) -> int:
        """One poll: take over new partitions, process what arrived, commit. Returns count."""
        self.runs.refresh()
        try:
            first = self.member.take_first_poll()
            if first is not None:
                try:
                    polled = first.result()
                finally:  # the stage is whole now: its callbacks can run
                    self.member.listener.release(self)
            else:
                # A join gets up to the session timeout: Tansu answers it after half of that.
                polled = poll_in_group(self.consumer, self.config.poll_timeout_ms,
                                       join_wait_ms=self.session_timeout_ms)
        except InvalidSessionTimeoutError:
            self._rejoin_with_longer_session_timeout()
            return 0
        self.working = bool(polled)
        now = time.monotonic()
        reachable = bool(polled) or broker_reachable(self.consumer)
        taken_over = False
        if self.rebalanced:
            self.rebalanced = False
            assigned, self.newly_assigned = self.newly_assigned, set()
            if assigned and self._took_over(assigned):
                taken_over = True
                self.topic_id = topic_id(self.consumer, self.topic)
                self.owned |= {tp.partition for tp in assigned}
                self.caught_up, self.ends_checked = False, {}
                # A stall counts from the take-over: not the polls of a (long) join before
                self.empty_polls = self.stall_reported_at = 0
            self.joined = True
            self.health.joined(sorted(tp.partition for tp in self.consumer.assignment()))
            self.last_activity = time.monotonic()
            # Records fetched before the seek come again from the new position.
            polled = {tp: r for tp, r in polled.items() if tp not in assigned}
        # A topic recreated under a running stage (a broker restarted empty, with memory
        # storage; a topic deleted and created again while the process was frozen) that
        # is already longer than what was read keeps every position valid, and records
        # of it can come before any rebalance or metadata refresh: a new broker connection
        # or a freeze tells. (A take-over checks its partitions itself.)
        connections, freezes = broker_connections(self.consumer), FreezeWatch.freezes()
        if self.owned and not taken_over:
            if connections - self.connections:
                self.unverified = "a new broker connection"
            elif freezes != self.freezes:
                self.unverified = "a freeze of the process"
        self.connections, self.freezes = connections, freezes
        if self.unverified is not None:
            polled = self._checked_partitions(polled, self.unverified)
        # A failed hand-off (its sends not acknowledged, most likely) stops the stage here:
        # after the check above, whose refusal of a recreated topic says what happened to
        # the broker, and before the health watch, whose outage report says less.
        handed = self._handed_off
        if handed is not None and handed.done():
            handed.result()
        self.health.observe_broker(reachable, now)
        self.health.observe_join(self.joined, now)
        if self._assignment_stuck():
            self._rejoin_with_a_new_consumer(
                f"kept partitions assigned without handing them over for {REJOIN_AFTER_S:.0f} s "
                "of polls (an unfinished rejoin)")
            return 0
        batch = self._new_batch()
        count = 0
        # A topic recreated with neither a freeze nor a new connection (a live broker): its
        # topic id tells, once the client's metadata has it (where the broker has ids).
        current_id = topic_id(self.consumer, self.topic)
        if self.topic_id is not None and current_id not in (None, self.topic_id) and polled:
            tp = next(iter(polled))
            self._refuse(tp, f"its topic id changed from {self.topic_id} to {current_id} "
                             "while being read")
        for tp, records in polled.items():
            for record in records:
                self._handle(record, batch)
                batch.last_offset[tp.partition] = record.offset
            self.last_records[tp.partition] = records[-1]
            count += len(records)
        self._commit(batch)
        if count:
            self.last_activity = time.monotonic()
            self.empty_polls = self.stall_reported_at = 0
        else:
            self.empty_polls += 1
        if self._check_caught_up():
            self._rejoin_with_a_new_consumer("stopped fetching while behind its end offsets")
        self.working = False
        if batch.last_offset:
            self.health.last_commit_at = time.time()
            self.consumed.update(batch.last_offset)
            # highwater comes with every fetch response: no request of its own
            self.health.lag = sum(
                max(0, (self.consumer.highwater(tp) or 0) - self.consumed[tp.partition] - 1)
                for tp in self.consumer.assignment() if tp.partition in self.consumed
            )
        return count

    def _took_over(self, assigned: set[TopicPartition]) -> bool:
        """Take `assigned` over, or, when the broker cannot answer the continuity check yet
        (a probe consumer that cannot bootstrap on a starved machine: CI saw "could not be
        read within 10 s"), release what was taken and try again at the next poll."""
        try:
            self._take_over(assigned)
            return True
        except (KafkaError, TopicUnreadableError, BrokerUnavailableError) as exc:
            log.warning("%s stage: cannot take partitions %s over yet (%s); trying again",
                        self.health.role, sorted(tp.partition for tp in assigned), exc)
            self._release({tp.partition for tp in assigned})
            self.newly_assigned |= assigned & set(self.consumer.assignment())
            self.rebalanced = True
            return False

    def _checked_partitions(self, polled: dict, why: str) -> dict:
        """`polled`, once every owned partition is checked to be the one the lake read;
        while the broker cannot answer that yet, none of it: the records are fetched again
        after the next check."""
        started = time.monotonic()
        owned = sorted((tp for tp in self.consumer.assignment() if tp.partition in self.owned),
                       key=lambda tp: tp.partition)
        try:
            for tp in owned:
                records = polled.get(tp)
                position = records[0].offset if records else fetch_position(self.consumer, tp)
                self.check_continuity(tp, position - 1 if position else None)
        # A probe consumer that cannot bootstrap in time (a starved machine) is an outage
        # of the moment like the others, not a reason to stop.
        except (KafkaError, TopicUnreadableError, BrokerUnavailableError) as exc:
            log.warning("%s stage: cannot check yet that its partitions are the ones the "
                        "lake read (%s); holding their messages back", self.health.role, exc)
            for tp, records in polled.items():
                self.consumer.seek(tp, records[0].offset)
            return {}
        log.info("%s stage: partitions %s checked against the lake after %s (%.2f s)",
                 self.health.role, [tp.partition for tp in owned], why,
                 time.monotonic() - started)
        self.unverified = None
        return polled

    def _assignment_stuck(self) -> bool:
        assigned = {tp.partition for tp in self.consumer.assignment()}
        waiting = self.joined and not assigned <= self.owned
        self.unowned_polls = self.unowned_polls + 1 if waiting else 0
        return self.unowned_polls >= max(1, int(REJOIN_AFTER_S * 1000
                                                / self.config.poll_timeout_ms))

    def _rejoin_with_a_new_consumer(self, why: str) -> None:
        """Leave the group and join it again: what a consumer stuck in a rebalance or a
        fetch needs. The partitions this stage owns are released and taken over again
        from the lake, as after any rebalance."""
        assigned = set(self.consumer.assignment())
        log.warning("%s stage: the consumer %s; joining the group again with a new one",
                    self.health.role, why)
        self.on_partitions_revoked(assigned)
        self.consumer.close()
        self.newly_assigned, self.rebalanced, self.unowned_polls = set(), False, 0
        # Not idle until the new member has its partitions (its first assignment can be
        # empty); the revocation above forgot what the old member had read.
        self.joined = False
        self.health.started_at = time.monotonic()  # --join-timeout-s counts from here
        self.health.state = "joining"  # the new member's partitions are logged once it joins
        self.consumer = self._member(self)

    def _check_caught_up(self) -> bool:
        """At most every CATCH_UP_CHECK_S: have the owned partitions been read to the end
        offsets they had at the previous check, and the runs topic to its end? A poll can
        come back empty while messages wait (a slow broker, the first fetch after a
        take-over), and `idle` must not take that for the end. A partition still behind
        after STALL_REPORT_S of empty polls is logged with its fetch state; True when one
        of them is not paused: a fetch that never completes (kafka-python 3.0 on Apache
        Kafka), which a new consumer ends. Polls are counted, not seconds, so a process
        that was frozen (SIGSTOP, a descheduled container) does not look stalled when it
        wakes."""
        now = time.monotonic()
        if self.health.unreachable_since is not None or now - self.end_checked_at < CATCH_UP_CHECK_S:
            return False
        if self._hand_off_running:
            # Not idle meanwhile anyway; and against a broker that stopped answering, the
            # look-ups below (up to PROBE_TIMEOUT_S each) held up the poll that raises the
            # hand-off's failure for a minute.
            return False
        previous_at, self.end_checked_at = self.end_checked_at, now
        owned = [tp for tp in self.consumer.assignment() if tp.partition in self.owned]
        try:
            end = self.consumer.end_offsets(owned, timeout_ms=int(PROBE_TIMEOUT_S * 1000))
            runs_read = self.runs.all_read(timeout_ms=int(PROBE_TIMEOUT_S * 1000))
            others_read = self._unassigned_in_lake()
        except KafkaError:
            return False  # the broker health check reports an outage
        # What the partitions held at the previous check must have been read: a topic that
        # never stops growing (the group stage's watermarks on `rollout.decisions`) is never
        # read to its current end, but always to where it was half a second ago.
        target = {tp: self.ends_checked.get(tp, end[tp]) for tp in owned}
        as_of = previous_at if any(tp in self.ends_checked for tp in owned) else now
        self.ends_checked = end
        behind = [tp for tp in owned if (fetch_position(self.consumer, tp) or 0) < target[tp]]
        self.caught_up = not behind and runs_read and others_read
        self.caught_up_as_of = as_of
        polls = max(1, int(STALL_REPORT_S * 1000 / self.config.poll_timeout_ms))
        if not behind or self.empty_polls - self.stall_reported_at < polls:
            return False
        self.stall_reported_at = self.empty_polls
        states = self.consumer._subscription.assignment  # no public view without requests
        for tp in behind:
            state = states[tp]
            log.warning(
                "%s stage: %s[%d] holds messages up to offset %d, but %d polls in a row "
                "returned none: position %s, paused %s, awaiting reset %s, awaiting "
                "validation %s, pending revocation %s", self.health.role, tp.topic,
                tp.partition, target[tp] - 1, self.empty_polls, fetch_position(self.consumer, tp),
                state.paused, state.awaiting_reset, state.awaiting_validation,
                state._pending_revocation)
        return any(not states[tp].paused for tp in behind)

    def _unassigned_in_lake(self) -> bool:
        """Whether the lake holds what the topic's partitions not assigned to this member
        hold, as far as the stage's lake records tell (`_lake_positions`). A member can be
        assigned nothing while it is its group's only one (the group leader assigns only
        what its metadata lists at the join): idle then would end `--until-idle` with the
        topic unread and the rest of the processor done. Unknown partitions count as
        unread."""
        partitions = self.consumer.partitions_for_topic(self.topic)
        if not partitions:
            return False
        assigned = {tp.partition for tp in self.consumer.assignment()}
        others = [TopicPartition(self.topic, p) for p in sorted(partitions - assigned)]
        read = self._lake_positions(others) if others else None
        if read is None:
            return True
        end = self.consumer.end_offsets(others, timeout_ms=int(PROBE_TIMEOUT_S * 1000))
        for tp in others:
            recorded = read[tp]
            if end[tp] and (recorded is None or recorded + 1 < end[tp]):
                return False
        return True

    def _lake_positions(self, partitions: list[TopicPartition]
                        ) -> dict[TopicPartition, int | None] | None:
        """The last offset of each of `partitions` the lake has recorded (None: none yet),
        or None when the stage's lake cannot tell (the default: only the group stage
        records every offset it reads)."""
        return None

    def check_continuity(self, tp: TopicPartition, recorded: int | None) -> None:
        """Refuse to resume a partition of a topic that was recreated since the lake read it.

        A restarted in-memory broker starts every topic again at offset 0: resuming after
        the offset the lake recorded would skip the new messages as already processed.
        The topic is the one the lake read when it still reaches `recorded` and holds the
        last message the lake stored of it (`_stored_message`), byte for byte. (The end
        offset alone cannot tell: Tansu under-reports it for multi-record batches.)
        """
        if recorded is None:
            return
        if self.consumer.end_offsets([tp], timeout_ms=int(PROBE_TIMEOUT_S * 1000))[tp] == 0:
            self._refuse(tp, f"it is empty but the lake holds it up to offset {recorded}")
        stored = self._stored_message(tp, recorded)
        probe = self.config.kafka.consumer(group_id=None, max_poll_records=1)
        try:
            probe.assign([tp])
            first = self._read_from(probe, tp, recorded)
            if first.offset < recorded:  # an offset past the end reads from the start
                self._refuse(tp, f"it holds no message at offset {recorded}, which the lake "
                                 "already stored")
            if stored is None:
                return
            offset, fingerprint = stored
            record = first if offset == recorded else self._read_from(probe, tp, offset)
            if record.offset != offset:
                log.warning("%s[%d]@%d is gone (retention?): cannot check that the topic is "
                            "the one the lake read", tp.topic, tp.partition, offset)
            elif self._fingerprint(record) != fingerprint:
                self._refuse(tp, f"its message at offset {offset} is not the one the lake "
                                 "stored")
        finally:
            probe.close()

    def _refuse(self, tp: TopicPartition, why: str) -> None:
        raise RolloutlakeError(
            f"{tp.topic}[{tp.partition}]: the topic was recreated ({why}; a restarted in-memory "
            f"broker?): resuming would skip its new messages. Process them into a fresh lake "
            f"(--lake), or publish to fresh topics (--topic-prefix); {self.lake.root} stays as "
            "it is"
        )

    def _read_from(self, probe: Any, tp: TopicPartition, offset: int) -> Any:
        """The first message at or after `offset` (or from the start when `offset` is past
        the end), read by a consumer of its own: the group's is mid-join."""
        probe.seek(tp, offset)
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while time.monotonic() < deadline:
            for record in probe.poll(timeout_ms=200).get(tp, []):
                return record
        raise TopicUnreadableError(
            f"{tp.topic}[{tp.partition}]@{offset} could not be read within {PROBE_TIMEOUT_S:g} s")

    def _stored_message(self, tp: TopicPartition, up_to: int) -> tuple[int, bytes] | None:
        """Offset and `_fingerprint` of the last message at or before `up_to` the lake
        stored: by default from the `events` archive and the dead letters' raw bytes."""
        in_partition = (pc.field("topic") == tp.topic) & (pc.field("partition") == tp.partition)
        found: tuple[int, bytes] | None = None
        for table, column in (("events", "payload"), ("dead_letters", "raw")):
            rows = self.lake.read(table, columns=["offset"], filter=in_partition
                                  & (pc.field("offset") <= up_to) & pc.field(column).is_valid())
            if rows.num_rows == 0:
                continue
            offset = pc.max(rows.column("offset")).as_py()
            if found is not None and found[0] >= offset:
                continue
            value = self.lake.read(table, columns=[column], filter=in_partition
                                   & (pc.field("offset") == offset)).column(column)[0].as_py()
            found = (offset, value.encode() if isinstance(value, str) else value)
        return found

    def _fingerprint(self, record: Any) -> bytes:
        """What the lake keeps of a message to recognise it: the value, as archived."""
        return record.value

    @property
    def idle(self) -> bool:
        """Nothing to do as far as this stage can tell: joined, every partition the
        consumer is assigned taken over and read to its end offset (as of the last check),
        no poll in progress. Between a revocation and the
        take-over of the next assignment (a rejoin revokes every partition, and the group
        assigns them again only once each member rejoined: seconds, or a dead member's
        session) the stage owns nothing and its partitions' work is still ahead, such as
        a group stage re-sending the decisions a killed owner archived but never sent."""
        assigned = {tp.partition for tp in self.consumer.assignment()}
        return (self.joined and not self.working and assigned <= self.owned
                and self.caught_up and not self.dead_letters.rows
                and not self._hand_off_running)

    @property
    def _handed_off(self) -> Future[None] | None:
        """The last work the stage handed to a thread of its own (the group stage's archive
        and decisions, the batch stage's seal); its failure stops the stage."""
        return None

    @property
    def _hand_off_running(self) -> bool:
        handed = self._handed_off
        return handed is not None and not handed.done()

    def await_sent(self, sent: list[Any], what: str) -> None:
        """Wait for `sent`, futures of this stage's sends of `what`, to be acknowledged;
        BrokerUnavailableError when the broker did not take one within --broker-timeout-s.
        The stage then stops before it commits what comes after the sends, where it would
        have waited for kafka-python's 120 s delivery timeout and then gone on as if they
        were sent. The restart sends again what the lake does not record as sent
        (decisions, demand); a `step_sealed` follows its `steps` row, and is not sent again
        (a worker waiting for it stops after `--seal-wait-s` without news)."""
        why = unacknowledged(self.producer, sent, self.config.broker_timeout_s)
        if why is not None:
            raise BrokerUnavailableError(
                f"{self.health.role} stage: {what} not acknowledged by the broker at "
                f"{self.config.kafka.bootstrap_servers}{why}; exiting so it can be restarted "
                "once the broker is back"
            )

    def close(self, timeout_s: float | None = None) -> None:
        """Flush and close the clients; `timeout_s` bounds it when the broker may be gone."""
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if not close_producer(self.producer, timeout_s):
            # Only on the way out after an error: what was not sent is re-derived from the
            # lake on restart.
            log.info("%s stage: unsent messages dropped at exit", self.health.role)
        self.member.abandon_first_poll()
        self.consumer.close(timeout_ms=timeout_ms)
        self.runs.close()
        self.compaction.close()

    def _take_over(self, assigned: set[TopicPartition]) -> None:
        raise NotImplementedError

    def _release(self, partitions: set[int]) -> None:
        raise NotImplementedError

    def _new_batch(self) -> Any:
        """An empty batch of this poll's outputs, with a `last_offset` dict per partition."""
        raise NotImplementedError

    def _handle(self, record: Any, batch: Any) -> None:
        raise NotImplementedError

    def _commit(self, batch: Any) -> None:
        raise NotImplementedError
