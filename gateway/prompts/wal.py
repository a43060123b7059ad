"""The write-ahead log of the prompt cursors: the acknowledged `group_started` events of a
run on the events topic, read back to roll a checkpoint forward after a restart."""

from __future__ import annotations

import time

from kafka import TopicPartition
from kafka.errors import KafkaError

from gateway.prompts.cursor import LoggedRows
from ingest.io.kafka import KafkaSettings
from schemas.errors import BrokerUnavailableError, EventValidationError, UnavailableError
from schemas.events import GroupStarted, decode_event

# Poll timeout, and the quiet poll that confirms the end (Tansu under-reports end offsets
# of multi-record batches, so end_offsets alone stops early).
WAL_POLL_MS = 200
WAL_QUIET_MS = 500
WAL_READ_LIMIT_S = 300.0
_GROUP_STARTED = frozenset({"group_started"})


def read_group_log(kafka: KafkaSettings, topic: str, run_id: str, start: dict[int, int]
                   ) -> tuple[LoggedRows, dict[int, int]]:
    """The run's `group_started` events from `start` (partition -> offset; {} = from the
    beginning) to the end of `topic`: group -> {(dataset, version, row)}, and per
    partition the offset after the last one read."""
    prefix = f"{run_id}:".encode()
    logged: dict[int, set[tuple[str, int | None, int]]] = {}
    seen: dict[int, int] = {}
    consumer = kafka.consumer()
    try:
        parts = [TopicPartition(topic, p)
                 for p in sorted(consumer.partitions_for_topic(topic) or {0})]
        consumer.assign(parts)
        first = consumer.beginning_offsets(parts)
        for tp in parts:
            at = start.get(tp.partition, 0)
            if first[tp] > at:
                raise UnavailableError(f"cannot restore the prompt cursor of run {run_id!r}: "
                                       f"{topic} partition {tp.partition} no longer holds "
                                       f"offset {at} (retention?)")
            consumer.seek(tp, at)
        end = consumer.end_offsets(parts)
        deadline = time.monotonic() + WAL_READ_LIMIT_S
        while time.monotonic() < deadline:
            polled = consumer.poll(WAL_POLL_MS)
            if not polled:
                if any(consumer.position(tp) < end[tp] for tp in parts):
                    continue
                polled = consumer.poll(WAL_QUIET_MS)  # past the reported end: until quiet
                if not polled:
                    break
            for tp, records in polled.items():
                for record in records:
                    if not (record.key or b"").startswith(prefix) or \
                            b"group_started" not in record.value:
                        continue
                    try:
                        event = decode_event(record.value, allowed=_GROUP_STARTED)
                    except EventValidationError:
                        continue
                    assert isinstance(event, GroupStarted)
                    if event.run_id != run_id or event.prompt_ref is None:
                        continue
                    ref = event.prompt_ref
                    logged.setdefault(event.group_index, set()).add(
                        (ref.dataset, getattr(ref, "version", None), ref.row))
                    seen[tp.partition] = max(seen.get(tp.partition, 0), record.offset + 1)
        else:
            raise UnavailableError(f"reading {topic} to restore run {run_id!r} took over "
                                   f"{WAL_READ_LIMIT_S:.0f} s")
    except KafkaError as err:
        raise BrokerUnavailableError(
            f"could not read {topic} to restore the prompt cursor: {type(err).__name__}"
        ) from None
    finally:
        consumer.close()
    return logged, seen
