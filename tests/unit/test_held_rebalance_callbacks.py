"""A stage's rebalance callbacks held while it is built (processor/membership.py)."""

from __future__ import annotations

import threading
import time

from kafka import TopicPartition

from ingest.processor.membership import HeldRebalanceCallbacks

A, B = {TopicPartition("events", 0)}, {TopicPartition("events", 1)}


class Recorder:
    """Stands for the stage: records the callbacks it gets, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, set[TopicPartition]]] = []
        self.revoking = threading.Event()  # set once a revocation has started
        self.gate = threading.Event()  # a revocation finishes once this is set
        self.gate.set()

    def on_partitions_revoked(self, partitions):
        self.revoking.set()
        self.gate.wait(10)
        self.calls.append(("revoked", set(partitions)))

    def on_partitions_assigned(self, partitions):
        self.calls.append(("assigned", set(partitions)))

    def on_partitions_lost(self, partitions):
        self.calls.append(("lost", set(partitions)))


def test_callbacks_are_held_in_order_until_release_then_go_straight_to_the_stage():
    stage = Recorder()
    held = HeldRebalanceCallbacks()
    held.on_partitions_revoked(set())  # before the first JoinGroup
    held.on_partitions_assigned(A)
    assert stage.calls == []
    held.release(stage)  # type: ignore[arg-type]
    assert stage.calls == [("revoked", set()), ("assigned", A)]
    held.on_partitions_lost(A)
    assert stage.calls[-1] == ("lost", A)


def test_a_callback_that_comes_during_the_release_follows_the_held_ones():
    stage = Recorder()
    held = HeldRebalanceCallbacks()
    held.on_partitions_revoked(A)
    stage.gate.clear()  # the held revocation, replayed, waits
    release = threading.Thread(target=held.release, args=(stage,))
    release.start()
    assert stage.revoking.wait(10)
    assign = threading.Thread(target=held.on_partitions_assigned, args=(B,))
    assign.start()
    time.sleep(0.2)  # time for the assignment to overtake the replay, were it not held back
    stage.gate.set()
    release.join(10)
    assign.join(10)
    assert stage.calls == [("revoked", A), ("assigned", B)]
