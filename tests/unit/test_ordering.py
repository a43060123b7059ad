"""Event time and decision order (pure core)."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ingest.core.ordering import (
    DECIDED,
    OPENED,
    DecisionMerge,
    OrderKey,
    PartitionClock,
    TimeoutQueue,
    timeout_micros,
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


def test_a_decision_is_released_by_the_bound_sent_after_it_not_by_a_later_event():
    merge = DecisionMerge(partitions=1)
    merge.add(key(100, offset=7), "completed at offset 7")
    merge.watermark(0, 100, next_offset=7)  # the bound of a poll that ended before it
    assert merge.ready() == []
    merge.watermark(0, 100, next_offset=8)  # its own poll's: nothing before it can come
    assert [item for _, item in merge.ready()] == ["completed at offset 7"]


def test_at_one_event_time_the_lower_partition_goes_first():
    merge = DecisionMerge(partitions=2)
    merge.add(key(50, partition=0, offset=3), "p0")
    merge.add(key(50, partition=1, offset=4), "p1")
    merge.watermark(0, 50, next_offset=4)
    merge.watermark(1, 50, next_offset=5)
    # partition 0 may still send (50, 0, 4), which goes before (50, 1, 4)
    assert [item for _, item in merge.ready()] == ["p0"]
    merge.watermark(0, 51, next_offset=9)
    assert [item for _, item in merge.ready()] == ["p1"]


def test_a_snapshot_of_the_merge_from_before_bounds_loads_with_time_only_watermarks():
    old = DecisionMerge(partitions=1)
    old.add(key(100, offset=7), "held")
    old.__dict__.update(watermarks={0: 100}, released_us=90)
    del old.__dict__["released"]
    merge = pickle.loads(pickle.dumps(old))
    assert merge.ready() == []  # 100 is not past 100 for a time-only watermark
    merge.watermark(0, 100, next_offset=8)
    assert [item for _, item in merge.ready()] == ["held"]


@st.composite
def partition_streams(draw):
    """Per events partition, its polls: the items each produced (kind, time, offset), in
    offset order with times that never go down, then the poll's bound."""
    streams = []
    for partition in range(draw(st.integers(1, 3))):
        polls, at_us, offset = [], 0, 0
        for _ in range(draw(st.integers(0, 4))):
            items = []
            for _ in range(draw(st.integers(0, 3))):  # records of the poll
                at_us += draw(st.integers(0, 2))  # ties within and across partitions
                for kind in draw(st.sampled_from([[], [DECIDED], [OPENED], [OPENED, DECIDED]])):
                    items.append(key(at_us, partition, offset, kind, group=offset))
                offset += 1
            polls.append((items, (at_us, offset)))
        streams.append(polls)
    return streams


@given(partition_streams(), st.randoms(use_true_random=False))
def test_any_interleaving_of_partitions_releases_every_item_in_key_order(streams, rnd):
    merge = DecisionMerge(partitions=len(streams))
    released, queues = [], [list(polls) for polls in streams]
    for partition in range(len(streams)):
        merge.watermark(partition, 0, next_offset=0)  # taken over: nothing read yet
    while any(queues):
        partition = rnd.choice([p for p, q in enumerate(queues) if q])
        items, (at_us, next_offset) = queues[partition].pop(0)
        for item in items:
            merge.add(item, item)
            released += [k for k, _ in merge.ready()]
        merge.watermark(partition, at_us, next_offset)
        released += [k for k, _ in merge.ready()]
    released += [k for k, _ in merge.drain()]
    every = [item for polls in streams for items, _ in polls for item in items]
    assert released == sorted(every) and merge.late == 0


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


@pytest.mark.parametrize("group_timeout_s", [1e-9, 4.9e-7, 1e-6, 600.0])
def test_a_timeout_comes_due_after_the_bound_its_first_event_sent_never_late(group_timeout_s):
    """Any timeout the schema accepts (> 0), however short: its decision sorts after what
    the group's first event released, so it is applied in order, as replay sorts it."""
    first_us, offset = 1_000, 7
    queue, merge = TimeoutQueue(), DecisionMerge(partitions=1)
    queue.add("r", 0, first_us)
    merge.add(key(first_us, offset=offset, kind=OPENED), "opened")
    merge.watermark(0, first_us, next_offset=offset + 1)  # the poll of the first event
    assert [item for _, item in merge.ready()] == ["opened"]
    assert queue.due(first_us, lambda run: timeout_micros(group_timeout_s)) == []
    later_us = first_us + timeout_micros(group_timeout_s)
    [(deadline_us, _, _)] = queue.due(later_us, lambda run: timeout_micros(group_timeout_s))
    merge.add(key(deadline_us, offset=-1), "timed out")
    merge.watermark(0, later_us, next_offset=offset + 2)
    assert [item for _, item in merge.ready()] == ["timed out"] and merge.late == 0
