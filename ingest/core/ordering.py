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
partition keys grow with offsets (so with one partition the order is the offset order),
and once every events partition's watermark has passed a key's time, no item with a
smaller key can still come: `DecisionMerge` applies items in key order at that moment.
Replay sorts the same keys.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

OPENED, DECIDED = 0, 1  # a group is opened before it can be decided at the same time
MAX_AHEAD_S = 5.0  # beyond the reader's clock: a record timestamp set in the future


def micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


@dataclass(frozen=True, order=True, slots=True)
class OrderKey:
    at_us: int
    partition: int
    offset: int
    kind: int
    run_id: str
    group_index: int


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

    An item is released when every events partition's watermark is past its time: each
    partition's later items have keys at or after its watermark. An item that comes
    with a key below what was already released (`late`) is released at once.
    """

    def __init__(self, partitions: int):
        self.partitions = partitions
        self.watermarks: dict[int, int] = {}
        self._heap: list[tuple[OrderKey, int, Any]] = []
        self._seq = 0
        self.released_us: int | None = None
        self.late = 0

    def watermark(self, partition: int, at_us: int) -> None:
        if at_us > self.watermarks.get(partition, -1):
            self.watermarks[partition] = at_us

    def frontier(self) -> int | None:
        """Items with an earlier time are safe to release; None until every partition
        has reported a watermark."""
        try:
            return min(self.watermarks[p] for p in range(self.partitions))
        except KeyError:
            return None

    def add(self, key: OrderKey, item: Any) -> None:
        if self.released_us is not None and key.at_us < self.released_us:
            self.late += 1
        heapq.heappush(self._heap, (key, self._seq, item))
        self._seq += 1

    def ready(self) -> list[tuple[OrderKey, Any]]:
        frontier = self.frontier()
        out = []
        while self._heap and (
            (frontier is not None and self._heap[0][0].at_us < frontier)
            or (self.released_us is not None and self._heap[0][0].at_us < self.released_us)
        ):
            key, _, item = heapq.heappop(self._heap)
            out.append((key, item))
        if frontier is not None and (self.released_us is None or frontier > self.released_us):
            self.released_us = frontier
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
