"""Event time and decision order (pure core)."""

from __future__ import annotations

from ingest.core.ordering import (
    DECIDED,
    OPENED,
    DecisionMerge,
    OrderKey,
    PartitionClock,
    TimeoutQueue,
)


def key(at_us: int, partition: int = 0, offset: int = 0, kind: int = DECIDED, group: int = 0):
    return OrderKey(at_us, partition, offset, kind, "r", group)


def test_event_time_is_ts_at_most_the_record_time_and_never_before_the_watermark():
    clock = PartitionClock()
    assert clock.event_time(10.5, 11_000, read_at=99.0) == 10_500_000
    assert clock.event_time(50.0, 11_000, read_at=99.0) == 11_000_000  # clock ahead: clamped
    assert clock.event_time(None, 12_000, read_at=99.0) == 12_000_000
    assert clock.event_time(None, None, read_at=99.0) == 99_000_000
    # a record timestamp far in the future (a raw producer) counts as just ahead of now
    assert clock.event_time(None, 10**12, read_at=99.0) == 104_000_000
    assert clock.advance(12_000_000) and not clock.advance(11_000_000)
    assert clock.event_time(10.5, 11_000, read_at=99.0) == 12_000_000


def test_merge_waits_for_every_partition_then_releases_in_key_order():
    merge = DecisionMerge(partitions=2)
    merge.add(key(30, partition=0, group=3), "g3")
    merge.add(key(10, partition=0, group=1), "g1")
    merge.watermark(0, 40)
    assert merge.ready() == []  # partition 1 has not said how far it is
    merge.add(key(20, partition=1, group=2), "g2")
    merge.watermark(1, 25)
    assert [item for _, item in merge.ready()] == ["g1", "g2"]
    merge.watermark(1, 30)
    assert merge.ready() == []  # 30 is not past 30: partition 1 may still send time 30
    merge.watermark(1, 31)
    assert [item for _, item in merge.ready()] == ["g3"]
    assert len(merge) == 0 and merge.late == 0


def test_a_decision_below_what_was_released_is_counted_late_and_released():
    merge = DecisionMerge(partitions=1)
    merge.watermark(0, 100)
    merge.ready()
    merge.add(key(50), "late")
    assert [item for _, item in merge.ready()] == ["late"] and merge.late == 1


def test_opened_sorts_before_a_decision_of_the_same_event():
    merge = DecisionMerge(partitions=0)
    merge.add(key(5, offset=7, kind=DECIDED), "decided")
    merge.add(key(5, offset=7, kind=OPENED), "opened")
    merge.add(key(5, offset=3, kind=DECIDED, group=9), "earlier offset")
    assert [item for _, item in merge.drain()] == ["earlier offset", "opened", "decided"]


def test_timeouts_come_due_per_run_in_deadline_order():
    queue = TimeoutQueue()
    queue.add("a", 1, 100)
    queue.add("b", 2, 50)
    queue.add("a", 3, 10)
    timeouts = {"a": 20, "b": 100}
    assert queue.due(130, timeouts.__getitem__) == [(30, "a", 3), (120, "a", 1)]
    assert queue.due(150, timeouts.__getitem__) == [(150, "b", 2)]
