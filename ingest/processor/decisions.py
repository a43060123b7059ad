"""Wire form of `rollout.decisions`: a JSON header plus the group's fragments as Arrow IPC.

The header (Kafka header `decision`) is all a controller needs — run, group, step,
decision, reason — so controllers never decode the token payload.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from ingest.core.decided import FRAGMENTS, DecidedGroup, DecisionHeader

HEADER = "decision"


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


def decode_fragments(value: bytes) -> pa.Table:
    with pa.ipc.open_stream(pa.py_buffer(value)) as reader:
        return reader.read_all()
