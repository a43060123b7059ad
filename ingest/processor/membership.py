"""A stage's consumer-group member, which starts joining before the stage is built.

Most of a processor's start-up is its groups' joins (Tansu holds a JoinGroup for half the
session timeout, 1 s at the default 2 s), and a join needs only kafka-python and the
parsed settings. A `GroupMember` subscribes and polls on a thread of its own until its
join completes, so the rest of the start (the processor's heavy imports, the tables, the
stage's state) happens while the broker holds the join; the stage takes the member over
and its first poll takes the join's outcome. This module imports neither deltalake nor
pyarrow.

kafka-python calls the join's rebalance callbacks on its network thread, possibly before
the stage exists: they go to `HeldRebalanceCallbacks`, which keeps them in order until the
stage's first poll and then hands them over.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Literal

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition

from ingest.io.kafka import poll_in_group, subscribe_once_listed
from schemas.errors import RolloutlakeError

if TYPE_CHECKING:
    from ingest.processor.config import ProcessorConfig

Role = Literal["groups", "batches"]
# The stages an instance runs, by `--stages`
STAGE_ROLES: dict[str, tuple[Role, ...]] = {
    "all": ("groups", "batches"), "groups": ("groups",), "batches": ("batches",)}
TOPIC_WAIT_S = 10.0
# Session timeouts a stage joins with, in order, while --session-timeout-ms is not given:
# Tansu answers a join after about half the session timeout (in whole seconds, at least
# one), most of a processor's start-up at 6 s; Apache Kafka refuses less than its
# group.min.session.timeout.ms, 6000 by default.
SESSION_TIMEOUTS_MS = (2000, 6000)


def stage_topic(config: ProcessorConfig, role: Role) -> str:
    """The topic the stage of `role` consumes: events for the group stage, decisions for the
    batch stage."""
    return config.kafka.topics.events if role == "groups" else config.kafka.topics.decisions


def group_consumer(config: ProcessorConfig, group_id: str, topic: str, session_timeout_ms: int,
                   listener: ConsumerRebalanceListener) -> KafkaConsumer:
    """A consumer subscribed to `topic` in `group_id`, at `session_timeout_ms`, with
    `listener` for its rebalances."""
    consumer = config.kafka.consumer(
        group_id=group_id,
        session_timeout_ms=session_timeout_ms,
        heartbeat_interval_ms=max(500, session_timeout_ms // 3),
        max_poll_records=config.max_poll_records,
    )
    try:
        subscribe_once_listed(consumer, topic, listener, timeout_s=TOPIC_WAIT_S)
    except RolloutlakeError:
        consumer.close()
        raise
    return consumer


class HeldRebalanceCallbacks(ConsumerRebalanceListener):
    """A member's rebalance listener until its stage's first poll.

    kafka-python calls the listener of a join on its network thread: before the JoinGroup
    (revoking what the member had, nothing at first) and once assigned, which can be
    before the stage exists or has its state. The calls are held, in order, until
    `release` hands them to the stage; from then on they go straight to it.
    """

    def __init__(self) -> None:
        self._stage: ConsumerRebalanceListener | None = None
        self._lock = threading.Lock()
        self._held: list[tuple[str, set[TopicPartition]]] = []
        self.assigned = threading.Event()  # a join completed (its assignment may be empty)

    def _call(self, name: str, partitions: set[TopicPartition]) -> None:
        with self._lock:
            if self._stage is None:
                self._held.append((name, set(partitions)))
                return
        getattr(self._stage, name)(partitions)

    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self._call("on_partitions_revoked", revoked)

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._call("on_partitions_assigned", assigned)
        self.assigned.set()

    def on_partitions_lost(self, lost: set[TopicPartition]) -> None:
        self._call("on_partitions_lost", lost)

    def release(self, stage: ConsumerRebalanceListener) -> None:
        # Under the lock: a call that comes meanwhile waits, and follows the held ones.
        with self._lock:
            held, self._held, self._stage = self._held, [], stage
            for name, partitions in held:
                getattr(stage, name)(partitions)


class GroupMember:
    """The consumer a stage of `role` joins its group with, subscribed on creation, its
    first polls running on a thread of their own: until the join completes (the
    coordinator is found by a first short poll, which leaves the join in flight; the next
    one waits for it, as `poll_in_group` does), or for one join wait at most, after which
    the stage's own polls go on, watching the broker and the join's time."""

    def __init__(self, config: ProcessorConfig, role: Role):
        self.topic = stage_topic(config, role)
        self.group_id = f"{config.group_prefix}-{role}"
        self.session_timeout_ms = config.session_timeout_ms or SESSION_TIMEOUTS_MS[0]
        self.listener = HeldRebalanceCallbacks()
        self.consumer = group_consumer(config, self.group_id, self.topic,
                                       self.session_timeout_ms, self.listener)
        # Handed to the thread, not read back from `first_poll`, which the stage may have
        # taken by the time the thread runs.
        first: Future[dict] = Future()
        self.first_poll: Future[dict] | None = first
        threading.Thread(target=self._poll_until_joined, args=(first, config.poll_timeout_ms),
                         name=f"{role}-join", daemon=True).start()

    def _poll_until_joined(self, first: Future[dict], poll_timeout_ms: int) -> None:
        deadline = time.monotonic() + self.session_timeout_ms / 1000
        try:
            polled: dict = {}
            while (not polled and not self.listener.assigned.is_set()
                   and time.monotonic() < deadline):
                polled = poll_in_group(self.consumer, poll_timeout_ms,
                                       join_wait_ms=self.session_timeout_ms)
            first.set_result(polled)
        except BaseException as err:  # the stage's thread raises it, as from its own poll
            first.set_exception(err)

    def take_first_poll(self) -> Future[dict] | None:
        """The first polls' outcome, handed out once (None after that)."""
        first, self.first_poll = self.first_poll, None
        return first

    def abandon_first_poll(self) -> None:
        """Wait for first polls no stage will take (it stops or failed before), so that the
        consumer can be closed: the consumer is not for two threads at once."""
        first = self.take_first_poll()
        if first is not None:
            wait([first])

    def close(self) -> None:
        """Leave the group: for a member whose stage was never built."""
        self.abandon_first_poll()
        self.consumer.close()


def start_members(config: ProcessorConfig, roles: tuple[Role, ...]) -> dict[Role, GroupMember]:
    """A member joining for each of `roles`; the topics must exist (a broker such as Tansu
    creates a topic a client asks about, with its default partition count)."""
    members: dict[Role, GroupMember] = {}
    try:
        for role in roles:
            members[role] = GroupMember(config, role)
    except BaseException:
        for member in members.values():
            member.close()
        raise
    return members
