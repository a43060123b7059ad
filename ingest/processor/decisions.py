"""Wire form of `rollout.decisions`: a JSON header plus the group's fragments as Arrow IPC.

Besides decisions the topic carries `opened` notices (header only, empty value): one per
archived `group_started`, so the batch stage counts prompts issued per step in order; and
`watermark` notices (header only, sent to every partition): how far an events partition's
event time and offsets have come, so the batch stage knows which decisions are safe to apply in order.

Every record also names, in the Kafka header `lake`, the lake whose group stage sent it
(the Delta table id of its `events` archive, which copies of the lake keep): two
deployments on one topic prefix (a second lake derived from the same events) share the
topic, and a batch stage applies only the records of its own lake.

The header (Kafka header `decision`) is all a controller needs — run, group, step,
decision, reason — so controllers never decode the token payload.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pyarrow as pa

from ingest.core.decided import FRAGMENTS, DecidedGroup, DecisionHeader, Opened

HEADER = "decision"
# Decisions larger than this carry no fragments (see DecisionHeader.fragments_in_archive):
# a group of several 8 MiB samples would not fit in one Kafka message.
INLINE_LIMIT_BYTES = 4 * 1024 * 1024
# a group_started was archived: {run_id, group_index, step, at, at_us, partition, offset}
OPENED = "opened"
# {partition, at_us, next_offset}: events partition `partition` reached event time `at_us`
# and offset `next_offset` (`ordering.Bound`; notices sent before it existed lack it)
WATERMARK = "watermark"
LAKE = "lake"


def lake_header(lake_id: str) -> tuple[str, bytes]:
    return (LAKE, lake_id.encode())


def sender_lake(record: Any) -> str | None:
    """The lake a decisions record was sent for; None for records without the header
    (sent before it existed: taken as this lake's)."""
    value = _header(record, LAKE)
    return None if value is None else bytes(value).decode(errors="replace")


def encode_decision(decided: DecidedGroup) -> tuple[list[tuple[str, bytes]], bytes]:
    value = fragments_ipc(decided.fragments)
    header = decided.header
    if len(value) > INLINE_LIMIT_BYTES:
        header = replace(header, fragments_in_archive=True)
        value = fragments_ipc(FRAGMENTS.empty_table())
    return [(HEADER, header.to_json())], value


def fragments_ipc(table: pa.Table) -> bytes:
    """A group's FRAGMENTS rows as one Arrow IPC stream (`decode_fragments` reads it)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, FRAGMENTS) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class UnreadableRecord(ValueError):
    """A `rollout.decisions` record whose headers or value are not what a group stage
    sends; the message names the header or field."""


# The fields of each header, and the JSON types each may hold (None: null; float also
# takes a whole number). The first set of each pair is the required fields: notices and
# decisions sent before a field existed lack it.
_DECISION_FIELDS: dict[str, tuple[Any, ...]] = {
    "run_id": (str,), "group_index": (int,), "step": (int, None), "n_samples": (int, None),
    "decision": (str,), "reason": (str, None), "counted": (bool,), "decided_at": (float,),
    "first_event_at": (float,), "cancel_min_ts": (float, None), "offered": (bool,),
    "source": (dict,), "fragments_in_archive": (bool,), "at_us": (int, None),
}
_DECISION_REQUIRED = {"run_id", "group_index", "step", "n_samples", "decision", "reason",
                      "counted", "decided_at", "first_event_at"}
_OPENED_FIELDS: dict[str, tuple[Any, ...]] = {
    "run_id": (str,), "group_index": (int,), "step": (int,), "at": (float,),
    "at_us": (int,), "partition": (int,), "offset": (int,),
}
_OPENED_REQUIRED = {"run_id", "group_index", "step"}
_WATERMARK_FIELDS: dict[str, tuple[Any, ...]] = {
    "partition": (int,), "at_us": (int,), "next_offset": (int,)}
_WATERMARK_REQUIRED = {"partition", "at_us"}


def _is(value: Any, kind: Any) -> bool:
    if kind is None:
        return value is None
    if kind is float:
        return type(value) in (int, float)
    return type(value) is kind  # not isinstance: JSON true is no int


def _checked_body(record: Any, name: str, fields: dict[str, tuple[Any, ...]],
                  required: set[str]) -> dict[str, Any] | None:
    """The JSON object in the record's header `name`, checked against `fields`; None
    without that header; UnreadableRecord naming what is wrong."""
    raw = _header(record, name)
    if raw is None:
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UnreadableRecord(f"its '{name}' header is not JSON") from None
    if not isinstance(body, dict):
        raise UnreadableRecord(f"its '{name}' header is not a JSON object")
    missing, unknown = sorted(required - body.keys()), sorted(body.keys() - fields.keys())
    if missing or unknown:
        raise UnreadableRecord(f"its '{name}' header lacks {missing} or has unknown "
                               f"fields {unknown}"[:300])
    for key, value in body.items():
        if not any(_is(value, kind) for kind in fields[key]):
            raise UnreadableRecord(f"its '{name}' header's {key} is {str(value)[:60]!r}, of "
                                   "the wrong type")
    return body


def decision_header(record: Any) -> DecisionHeader | None:
    """The header of a `rollout.decisions` record, or None for a foreign message;
    UnreadableRecord for one that is not what a group stage sends."""
    body = _checked_body(record, HEADER, _DECISION_FIELDS, _DECISION_REQUIRED)
    if body is None:
        return None
    if body["decision"] not in ("kept", "dropped"):
        raise UnreadableRecord(f"its '{HEADER}' header's decision is "
                               f"{body['decision'][:60]!r}, not kept or dropped")
    if not all(type(v) is int for v in body.get("source", {}).values()):
        raise UnreadableRecord(f"its '{HEADER}' header's source is not partition/offset "
                               "numbers")
    return DecisionHeader(**body)


def encode_opened(opened: Opened) -> list[tuple[str, bytes]]:
    body = {"run_id": opened.run_id, "group_index": opened.group_index, "step": opened.step,
            "at": opened.at_us / 1e6, "at_us": opened.at_us, "partition": opened.partition,
            "offset": opened.offset}
    return [(OPENED, orjson.dumps(body))]


def opened_notice(record: Any) -> Opened | None:
    """The group an `opened` notice announces, or None for any other record."""
    body = _checked_body(record, OPENED, _OPENED_FIELDS, _OPENED_REQUIRED)
    if body is None:
        return None
    return Opened(body["run_id"], body["group_index"], body["step"], body.get("at_us", -1),
                  body.get("partition", -1), body.get("offset", -1))


def encode_watermark(partition: int, at_us: int, next_offset: int) -> list[tuple[str, bytes]]:
    body = {"partition": partition, "at_us": at_us, "next_offset": next_offset}
    return [(WATERMARK, orjson.dumps(body))]


def watermark_notice(record: Any) -> dict[str, Any] | None:
    """The body of a `watermark` notice, or None for any other record."""
    return _checked_body(record, WATERMARK, _WATERMARK_FIELDS, _WATERMARK_REQUIRED)


def _header(record: Any, name: str) -> bytes | None:
    """The value of the record's first Kafka header `name`."""
    for key, value in record.headers or ():
        if key == name:
            return value
    return None


def decode_fragments(value: bytes | pa.Buffer) -> pa.Table:
    """The FRAGMENTS table of a decision's value; UnreadableRecord for anything else."""
    try:
        with pa.ipc.open_stream(pa.py_buffer(value)) as reader:
            table = reader.read_all()
    except pa.ArrowException as err:
        raise UnreadableRecord(f"its value is not an Arrow IPC stream ({err})"[:300]) from None
    if not table.schema.equals(FRAGMENTS):
        raise UnreadableRecord("its value is not a table of the decision's fragments")
    return table
