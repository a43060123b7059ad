"""Wire form of `rollout.decisions`: a JSON header plus the group's fragments as Arrow IPC.

Besides decisions the topic carries `opened` notices (header only, empty value): one per
archived `group_started`, so the batch stage counts prompts issued per step in order.

The header (Kafka header `decision`) is all a controller needs — run, group, step,
decision, reason — so controllers never decode the token payload.
"""

from __future__ import annotations

from typing import Any

import orjson
import pyarrow as pa

from ingest.core.decided import FRAGMENTS, DecidedGroup, DecisionHeader

HEADER = "decision"
OPENED = "opened"  # a group_started was archived: {run_id, group_index, step, at}


def encode_decision(decided: DecidedGroup) -> tuple[list[tuple[str, bytes]], bytes]:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, FRAGMENTS) as writer:
        writer.write_table(decided.fragments)
    return [(HEADER, decided.header.to_json())], sink.getvalue().to_pybytes()


def decision_header(record: Any) -> DecisionHeader | None:
    """The header of a `rollout.decisions` record, or None for a foreign message."""
    for name, value in record.headers or ():
        if name == HEADER:
            return DecisionHeader.from_json(value)
    return None


def encode_opened(run_id: str, group_index: int, step: int, at: float) -> list[tuple[str, bytes]]:
    body = {"run_id": run_id, "group_index": group_index, "step": step, "at": at}
    return [(OPENED, orjson.dumps(body))]


def opened_notice(record: Any) -> dict[str, Any] | None:
    """The body of an `opened` notice, or None for any other record."""
    for name, value in record.headers or ():
        if name == OPENED:
            return orjson.loads(value)
    return None


def decode_fragments(value: bytes) -> pa.Table:
    with pa.ipc.open_stream(pa.py_buffer(value)) as reader:
        return reader.read_all()
