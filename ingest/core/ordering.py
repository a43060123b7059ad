"""Event time and the order of decisions: what makes batches a function of the events.

Event time. Every archived trajectory event gets an event time, in integer microseconds:
its `ts`, else its Kafka record timestamp; never later than the record timestamp nor
than `MAX_AHEAD_S` after the moment it is read (a producer clock ahead cannot time out
other groups), and never earlier than its partition's watermark, the largest event time archived on that partition so far. Event
time therefore only grows along a partition. The archive stores it (`events.event_time`),
so a restart and `rolloutlake replay` see exactly the times the live processor used.

Order. Everything the batch stage applies carries an `OrderKey`: the event time of the
archived event that produced it (a group's `group_started` for its `opened` notice, the
completing event for a decision, first event + `group_timeout_s` for a timeout), then
that event's partition and offset (-1 for a timeout), then kind, run and group. Along one
partition keys grow with offsets (so with one partition the order is the offset order).

Watermarks. The group stage tells the batch stage how far each events partition has come
with a `Bound`: (its watermark, the partition, the offset after the last record it
processed there). Every item it can still send for that partition has a key whose
(time, partition, offset) is at or after that bound: later records have later offsets and
times at or after the watermark, and a timeout comes due only once the watermark has
passed its deadline. An item whose (time, partition, offset) is below every partition's
bound can have no item before it still to come: `DecisionMerge` applies items in key
order at that moment, a decision as soon as the watermark sent after it arrives (its own
record's offset is below that bound). Replay sorts the same keys.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

OPENED, DECIDED = 0, 1  # a group is opened before it can be decided at the same time
MAX_AHEAD_S = 5.0  # beyond the reader's clock: a record timestamp set in the future


def micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


def timeout_micros(seconds: float) -> int:
    """A run's `group_timeout_s` in microseconds, at least one: a deadline at the first
    event's own time would sort before that event's bound, already sent (applied late)."""
    return max(1, micros(seconds))


# (event time, events partition, offset): where an item or a watermark stands.
Bound = tuple[int, int, int]


@dataclass(frozen=True, order=True, slots=True)
class OrderKey:
    at_us: int
    partition: int
    offset: int
    kind: int
    run_id: str
    group_index: int

    def position(self) -> Bound:
        return (self.at_us, self.partition, self.offset)


def watermark_bound(partition: int, at_us: int, next_offset: int | None) -> Bound:
    """The bound of a watermark notice: every later item of `partition` is at or after it.
    A notice without `next_offset` (sent before notices carried it) promises only event
    times at or after `at_us`, so nothing at that very time passes it."""
    return (at_us, -1, -1) if next_offset is None else (at_us, partition, next_offset)


@dataclass(slots=True)
class PartitionClock:
    """The event time of one events partition: the largest event time archived on it."""

    watermark_us: int | None = None

    def event_time(self, ts: float | None, record_ms: int | None, read_at: float) -> int:
        """The event time of an event read now (not yet archived: `advance` does that)."""
        stamp = micros(record_ms / 1000) if record_ms is not None and record_ms >= 0 else None
        own = micros(ts) if ts is not None else stamp
        if own is None:
            own = micros(read_at)
        if stamp is not None:
            own = min(own, stamp)
        own = min(own, micros(read_at + MAX_AHEAD_S))
        return own if self.watermark_us is None else max(own, self.watermark_us)

    def advance(self, at_us: int) -> bool:
        """Move the watermark to `at_us`; True when it moved."""
        if self.watermark_us is not None and at_us <= self.watermark_us:
            return False
        self.watermark_us = at_us
        return True


@dataclass(slots=True)
class TimeoutQueue:
    """Undecided groups of one partition by first event time, per run (a run has one
    timeout, so each run's queue is ordered by deadline too)."""

    runs: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def add(self, run_id: str, group_index: int, first_us: int) -> None:
        heapq.heappush(self.runs.setdefault(run_id, []), (first_us, group_index))

    def due(self, watermark_us: int, timeout_us: Any) -> list[tuple[int, str, int]]:
        """Pop (deadline, run, group) of every entry whose deadline is <= the watermark;
        `timeout_us(run_id)` gives a run's timeout. Entries of groups decided meanwhile
        come out too; the caller skips them."""
        out = []
        for run_id, queue in self.runs.items():
            timeout = timeout_us(run_id)
            while queue and queue[0][0] + timeout <= watermark_us:
                first_us, group_index = heapq.heappop(queue)
                out.append((first_us + timeout, run_id, group_index))
        out.sort()
        return out


class DecisionMerge:
    """Items of several events partitions, released in `OrderKey` order once safe.

    An item is released when its position is below every events partition's bound (see
    the module's docstring). An item that comes with a position below what was already
    released (`late`) is released at once.
    """

    def __init__(self, partitions: int):
        self.partitions = partitions
        self.watermarks: dict[int, Bound] = {}
        self._heap: list[tuple[OrderKey, int, Any]] = []
        self._seq = 0
        self.released: Bound | None = None
        self.late = 0

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A batch snapshot written before bounds carried offsets holds watermarks and the
        # released frontier as times: the same promise as a notice without an offset.
        if "released_us" in state:
            released = state.pop("released_us")
            state["released"] = None if released is None else watermark_bound(0, released, None)
            state["watermarks"] = {p: watermark_bound(p, at_us, None)
                                   for p, at_us in state["watermarks"].items()}
        self.__dict__.update(state)

    def watermark(self, partition: int, at_us: int, next_offset: int | None = None) -> None:
        bound = watermark_bound(partition, at_us, next_offset)
        if partition not in self.watermarks or bound > self.watermarks[partition]:
            self.watermarks[partition] = bound

    def frontier(self) -> Bound | None:
        """Items positioned below it are safe to release; None until every partition has
        reported a watermark."""
        try:
            return min(self.watermarks[p] for p in range(self.partitions))
        except KeyError:
            return None

    def add(self, key: OrderKey, item: Any) -> None:
        if self.released is not None and key.position() < self.released:
            self.late += 1
        heapq.heappush(self._heap, (key, self._seq, item))
        self._seq += 1

    def ready(self) -> list[tuple[OrderKey, Any]]:
        frontier = self.frontier()
        if frontier is not None and (self.released is None or frontier > self.released):
            self.released = frontier
        out = []
        while self._heap and self.released is not None \
                and self._heap[0][0].position() < self.released:
            key, _, item = heapq.heappop(self._heap)
            out.append((key, item))
        return out

    def drain(self) -> list[tuple[OrderKey, Any]]:
        """Everything, in key order (replay: the whole stream is known)."""
        out = []
        while self._heap:
            key, _, item = heapq.heappop(self._heap)
            out.append((key, item))
        return out

    def __len__(self) -> int:
        return len(self._heap)
