"""The write-ahead log of the prompt cursors: the acknowledged `group_started` events of a
run on the events topic, read back to roll a checkpoint forward after a restart."""

from __future__ import annotations

from kafka import TopicPartition
from kafka.errors import AuthorizationError, KafkaError

from gateway.prompts.cursor import LoggedRows
from ingest.io.kafka import PUBLISHERS, KafkaSettings, PartitionReader, not_authorized
from schemas.errors import BrokerUnavailableError, EventValidationError, UnavailableError
from schemas.events import GroupStarted, decode_event

# The quiet poll that confirms the end (Tansu under-reports end offsets of multi-record
# batches, so end_offsets alone stops early).
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
    reader: PartitionReader | None = None
    try:
        reader = PartitionReader(kafka, [topic], what="prompt cursor log", start={
            TopicPartition(topic, partition): offset for partition, offset in start.items()})
        first = reader.consumer.beginning_offsets(reader.tps)
        for tp in reader.tps:
            at = start.get(tp.partition, 0)
            if first[tp] > at:
                raise UnavailableError(f"cannot restore the prompt cursor of run {run_id!r}: "
                                       f"{topic} partition {tp.partition} no longer holds "
                                       f"offset {at} (retention?)")
        for record in reader.read_to_end(timeout_s=WAL_READ_LIMIT_S, quiet_ms=WAL_QUIET_MS):
            if not (record.key or b"").startswith(prefix) or b"group_started" not in record.value:
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
            seen[record.partition] = max(seen.get(record.partition, 0), record.offset + 1)
    except TimeoutError:
        raise UnavailableError(f"reading {topic} to restore run {run_id!r} took over "
                               f"{WAL_READ_LIMIT_S:.0f} s") from None
    except AuthorizationError as err:
        raise not_authorized(kafka, err, PUBLISHERS) from None
    except KafkaError as err:
        raise BrokerUnavailableError(
            f"could not read {topic} to restore the prompt cursor: {type(err).__name__}"
        ) from None
    finally:
        if reader is not None:
            reader.close()
    return logged, seen
