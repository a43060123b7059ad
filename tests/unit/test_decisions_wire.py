"""The wire form of `rollout.decisions` (ingest/processor/decisions.py): what a group stage
sends reads back as sent, and anything else is refused with the header or field named."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pytest

from ingest.core.decided import FRAGMENTS, DecisionHeader, Opened
from ingest.processor.decisions import (
    UnreadableRecord,
    decision_header,
    decode_fragments,
    encode_opened,
    encode_watermark,
    fragments_ipc,
    opened_notice,
    watermark_notice,
)


class _Record:
    def __init__(self, headers: list[tuple[str, bytes]]):
        self.headers = headers


HEADER = DecisionHeader(run_id="r", group_index=3, step=1, n_samples=4, decision="kept",
                        reason=None, counted=True, decided_at=1.7e9, first_event_at=1.7e9,
                        source={"partition": 0, "offset": 12}, at_us=1_700_000_000_000_000)


def test_what_a_group_stage_sends_reads_back_as_sent():
    assert decision_header(_Record([("decision", HEADER.to_json())])) == HEADER
    opened = Opened("r", 3, 1, 1_700_000_000_000_000, 0, 12)
    assert opened_notice(_Record(encode_opened(opened))) == opened
    assert watermark_notice(_Record(encode_watermark(2, 5, 9))) == {
        "partition": 2, "at_us": 5, "next_offset": 9}
    empty = FRAGMENTS.empty_table()
    assert decode_fragments(fragments_ipc(empty)).equals(empty)
    # records sent before later fields existed
    old = {k: v for k, v in orjson.loads(HEADER.to_json()).items()
           if k not in ("cancel_min_ts", "offered", "source", "fragments_in_archive", "at_us")}
    assert decision_header(_Record([("decision", orjson.dumps(old))])).at_us is None
    assert opened_notice(_Record([("opened", b'{"run_id": "r", "group_index": 1, "step": 0}')]))
    assert decision_header(_Record([("lake", b"x")])) is None


def _decision(**changes) -> bytes:
    return orjson.dumps({**orjson.loads(HEADER.to_json()), **changes})


@pytest.mark.parametrize("headers, named", [
    ([("decision", b"not json")], "'decision' header is not JSON"),
    ([("decision", b"[1]")], "'decision' header is not a JSON object"),
    ([("decision", _decision(group_index="3"))], "group_index is '3'"),
    ([("decision", _decision(counted=1))], "counted is '1'"),
    ([("decision", _decision(decision="maybe"))], "decision is 'maybe', not kept or dropped"),
    ([("decision", _decision(source={"partition": "0"}))], "source is not"),
    ([("decision", _decision(extra=1))], "unknown fields ['extra']"),
    ([("decision", orjson.dumps({"run_id": "r"}))], "lacks ['counted'"),
    ([("opened", b'{"run_id": 5, "group_index": 1, "step": 0}')], "'opened' header's run_id"),
    ([("opened", b"{}")], "'opened' header lacks"),
    ([("watermark", b'{"partition": "x", "at_us": 1}')], "'watermark' header's partition"),
    ([("watermark", b"null")], "'watermark' header is not a JSON object"),
])
def test_a_header_no_group_stage_sends_is_refused_naming_it(headers, named):
    record = _Record(headers)
    with pytest.raises(UnreadableRecord) as refused:
        for read in (watermark_notice, opened_notice, decision_header):
            read(record)
    assert named in str(refused.value)


def test_a_value_that_is_no_fragments_table_is_refused():
    with pytest.raises(UnreadableRecord, match="not an Arrow IPC stream"):
        decode_fragments(b"garbage")
    other = pa.table({"x": [1, 2]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, other.schema) as writer:
        writer.write_table(other)
    with pytest.raises(UnreadableRecord, match="not a table of the decision's fragments"):
        decode_fragments(sink.getvalue())
