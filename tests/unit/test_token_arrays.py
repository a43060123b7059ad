"""Per-token arrays as JSON lists or compact typed arrays: the same arrays, rows and hashes."""

from __future__ import annotations

import base64
import json
import math

import jsonschema
import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.core.assembly import GroupBuilder
from ingest.core.batching import RunBatcher
from ingest.core.decide import decide
from ingest.core.filters import miles_group
from schemas.errors import EventValidationError
from schemas.events import EVENT_MODELS, RunConfig, decode_event, encode_event
from schemas.token_arrays import TOKEN_FIELDS
from tests.support.token_forms import b64, compact

N_SAMPLES = 2


def _fragment_body(draw, rollout_id: int, kind: str, fragment_index: int, count: int) -> dict:
    n = draw(st.integers(0, 12))
    body = {
        "event_id": f"{kind}-{rollout_id}-{fragment_index}", "type": kind, "schema_version": 1,
        "run_id": "prop", "group_index": 0, "rollout_id": rollout_id,
        "prompt_tokens": draw(st.lists(st.integers(0, 2**31 - 1), max_size=6)),
        "response_tokens": draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
    }
    if draw(st.booleans()):
        body["loss_mask"] = draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n))
    if draw(st.booleans()):
        # float32 values, as engines report them; a list of doubles would round on storage
        body["rollout_log_probs"] = [float(np.float32(v)) for v in draw(st.lists(
            st.floats(-30.0, 0.0, width=32), min_size=n, max_size=n))]
    if kind == "sample_finished":
        body.update(status="completed", fragment_count=count, fragment_index=fragment_index,
                    sample_index=rollout_id, reward=float(rollout_id))
    else:
        body["fragment_index"] = fragment_index
    return body


@st.composite
def groups(draw):
    """The events of one complete group, as JSON-list dicts; each rollout has 1-3 fragments."""
    events = [{"event_id": "start", "type": "group_started", "schema_version": 1,
               "run_id": "prop", "group_index": 0, "step": 0, "n_samples": N_SAMPLES}]
    for rollout_id in range(N_SAMPLES):
        count = draw(st.integers(1, 3))
        for index in range(count):
            kind = "sample_finished" if index == count - 1 else "compaction_fragment"
            events.append(_fragment_body(draw, rollout_id, kind, index, count))
    return events


def _rows_and_hash(raw_events: list[bytes]):
    builder = GroupBuilder("prop", 0, 0.0)
    for raw in raw_events:
        assert builder.apply(decode_event(raw)).accepted
    group = builder.group
    assert group.complete
    config = RunConfig(n_samples_per_prompt=N_SAMPLES, rollout_batch_size=1)
    decided = decide(group, config, at_us=1, source={"partition": 0, "offset": 0},
                     decided_at=1.0)
    assert decided.error is None and decided.group.header.decision == "kept"
    sealed = RunBatcher("prop", config).offer(decided.group, now=1.0).sealed
    return decided.group.fragments, sealed[0].rows, sealed[0].content_sha256


@settings(max_examples=60, deadline=None)
@given(groups(), st.data())
def test_lists_compact_and_mixed_forms_give_the_same_arrays_rows_and_hash(events, data):
    as_lists = [orjson.dumps(e) for e in events]
    as_compact = [orjson.dumps(compact(e)) for e in events]
    # mixed: every event picks its own subset of fields to send compact
    as_mixed = [orjson.dumps(compact(e, data.draw(st.sets(st.sampled_from(sorted(TOKEN_FIELDS))))))
                for e in events]
    for listed, packed in zip(as_lists, as_compact, strict=True):
        a, b = decode_event(listed), decode_event(packed)
        for name in TOKEN_FIELDS:
            x, y = getattr(a, name, None), getattr(b, name, None)
            assert (x is None) == (y is None), name
            if x is not None:
                assert x.dtype == y.dtype and np.array_equal(x, y), name
    fragments, rows, sha = _rows_and_hash(as_lists)
    for other in (as_compact, as_mixed):
        other_fragments, other_rows, other_sha = _rows_and_hash(other)
        assert other_fragments.equals(fragments)
        assert other_rows.equals(rows)
        assert other_sha == sha
    # what went in as lists comes out of the tables as the same values
    by_id = {(e["rollout_id"], e["fragment_index"]): e for e in events if "rollout_id" in e}
    for row in rows.to_pylist():
        sent = by_id[(row["rollout_id"], row["fragment_index"])]
        assert row["response_tokens"] == sent["response_tokens"]
        assert row["loss_mask"] == sent.get("loss_mask", [1] * len(sent["response_tokens"]))
        assert row["rollout_log_probs"] == sent.get("rollout_log_probs")


def test_the_sdk_form_is_compact_and_decodes_back():
    body = {"event_id": "e1", "type": "sample_finished", "schema_version": 1, "run_id": "r",
            "group_index": 0, "rollout_id": 0, "status": "completed", "prompt_tokens": [5, 6],
            "response_tokens": [7, 8, 2**31 - 1], "loss_mask": [0, 1, 1],
            "rollout_log_probs": [-0.5, -1.25, 0.0], "reward": 1.0}
    event = decode_event(orjson.dumps(body))
    wire = orjson.loads(encode_event(event))
    assert wire["response_tokens"] == {"dtype": "int32", "b64": b64([7, 8, 2**31 - 1], "<i4")}
    assert wire["loss_mask"] == {"dtype": "int8", "b64": b64([0, 1, 1], "<i1")}
    assert wire["rollout_log_probs"] == {"dtype": "float32", "b64": b64([-0.5, -1.25, 0], "<f4")}
    again = decode_event(encode_event(event))
    assert again.response_tokens.tolist() == body["response_tokens"]
    assert again.rollout_log_probs.tolist() == body["rollout_log_probs"]


def _sample_with(**fields) -> bytes:
    body = {"event_id": "bad", "type": "sample_finished", "schema_version": 1, "run_id": "r",
            "group_index": 0, "rollout_id": 0, "status": "completed", "reward": 1.0,
            "prompt_tokens": {"dtype": "int32", "b64": b64([1, 2], "<i4")},
            "response_tokens": {"dtype": "int32", "b64": b64([3, 4, 5], "<i4")}}
    body.update(fields)
    return orjson.dumps(body)


# (case, fields, field named by the error, words of the reason)
MALFORMED = [
    ("bad base64", {"response_tokens": {"dtype": "int32", "b64": "AAA*"}},
     "response_tokens.b64", "not valid base64"),
    ("wrong dtype", {"prompt_tokens": {"dtype": "int64", "b64": b64([1], "<i8")}},
     "prompt_tokens.dtype", "'int64' is not 'int32'"),
    ("length not a multiple of the item size",
     {"response_tokens": {"dtype": "int32", "b64": base64.b64encode(b"\x01\x00\x00\x00\x02").decode()}},
     "response_tokens.b64", "5 bytes is not a whole number of int32 values"),
    ("mask shorter than the response", {"loss_mask": {"dtype": "int8", "b64": b64([1, 1], "<i1")}},
     "loss_mask", "loss_mask has 2 entries but response_tokens has 3"),
    ("log-probs longer than the response",
     {"rollout_log_probs": {"dtype": "float32", "b64": b64([0, 0, 0, 0], "<f4")}},
     "rollout_log_probs", "rollout_log_probs has 4 entries but response_tokens has 3"),
    ("NaN log-prob", {"rollout_log_probs": {"dtype": "float32", "b64": b64([0, math.nan, 0], "<f4")}},
     "rollout_log_probs.1", "finite"),
    ("infinite log-prob", {"rollout_log_probs": {"dtype": "float32", "b64": b64([-math.inf, 0, 0], "<f4")}},
     "rollout_log_probs.0", "finite"),
    ("negative token", {"prompt_tokens": {"dtype": "int32", "b64": b64([1, -7], "<i4")}},
     "prompt_tokens.1", "greater than or equal to 0"),
    ("mask value 2", {"loss_mask": {"dtype": "int8", "b64": b64([1, 2, 0], "<i1")}},
     "loss_mask.1", "0 or 1"),
    ("mask value -1", {"loss_mask": {"dtype": "int8", "b64": b64([1, 0, -1], "<i1")}},
     "loss_mask.2", "0 or 1"),
    ("token beyond int32 in a list", {"response_tokens": [1, 2**31, 3]},
     "response_tokens.1", f"less than or equal to {2**31 - 1}"),
    ("log-prob beyond float32 in a list", {"rollout_log_probs": [0.0, 0.0, -1e39]},
     "rollout_log_probs.2", "within +-"),
    ("extra key", {"response_tokens": {"dtype": "int32", "b64": "", "endian": "big"}},
     "response_tokens", "exactly the keys 'dtype' and 'b64'"),
    ("b64 not a string", {"response_tokens": {"dtype": "int32", "b64": [1, 2]}},
     "response_tokens.b64", "must be a base64 string"),
    ("neither list nor object", {"response_tokens": "AAAA"},
     "response_tokens", "valid list or a compact array"),
    ("negative token in an abort", None, "response_tokens.0", "greater than or equal to 0"),
]


@pytest.mark.parametrize(("fields", "field", "words"), [c[1:] for c in MALFORMED],
                         ids=[c[0] for c in MALFORMED])
def test_a_malformed_compact_array_is_refused_naming_the_field(fields, field, words):
    if fields is None:
        raw = orjson.dumps({"event_id": "bad", "type": "sample_aborted", "schema_version": 1,
                            "run_id": "r", "group_index": 0, "rollout_id": 0, "reason": "x",
                            "response_tokens": {"dtype": "int32", "b64": b64([-1], "<i4")}})
    else:
        raw = _sample_with(**fields)
    with pytest.raises(EventValidationError) as caught:
        decode_event(raw)
    assert caught.value.field == field
    message = str(caught.value)
    assert "\n" not in message and f": {field}: " in message and words in message, message


def test_padding_after_a_whole_quantum_decodes_as_the_standard_decoder_decodes_it():
    """The standard decoder takes "=" after a whole 4-character quantum (the SIMD decoder
    alone would refuse it): such events were always taken, and a replay takes them still."""
    padded = b64([3, 4, 5], "<i4") + "="
    assert base64.b64decode(padded, validate=True) == np.array([3, 4, 5], "<i4").tobytes()
    event = decode_event(_sample_with(response_tokens={"dtype": "int32", "b64": padded}))
    assert event.response_tokens.tolist() == [3, 4, 5]


def test_the_json_schema_takes_both_forms_and_refuses_a_wrong_dtype():
    schema = EVENT_MODELS["sample_finished"].model_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    listed = orjson.loads(_sample_with(prompt_tokens=[1, 2], response_tokens=[3],
                                       loss_mask=[1], rollout_log_probs=[-0.5]))
    packed = orjson.loads(_sample_with(
        loss_mask={"dtype": "int8", "b64": b64([1, 1, 0], "<i1")},
        rollout_log_probs={"dtype": "float32", "b64": b64([0, 0, 0], "<f4")}))
    assert list(validator.iter_errors(listed)) == []
    assert list(validator.iter_errors(packed)) == []
    wrong = {**packed, "loss_mask": {"dtype": "float32", "b64": ""}}
    assert [e.json_path for e in validator.iter_errors(wrong)] == ["$.loss_mask"]
    assert "compact form" in json.dumps(schema["properties"]["response_tokens"])


def test_user_filters_get_python_lists_and_the_built_in_filter_no_token_lists():
    """Miles filters index, add and compare `tokens` as lists; the arrays are numpy
    inside. The built-in DAPO filter reads rewards only, so its samples carry no lists."""
    builder = GroupBuilder("r", 0, 0.0)
    builder.apply(decode_event(orjson.dumps({"event_id": "s", "type": "group_started",
                                             "schema_version": 1, "run_id": "r",
                                             "group_index": 0, "step": 0, "n_samples": 1})))
    builder.apply(decode_event(_sample_with(
        loss_mask={"dtype": "int8", "b64": b64([1, 0, 1], "<i1")},
        rollout_log_probs={"dtype": "float32", "b64": b64([-0.5, -0.25, 0], "<f4")})))
    (full,) = miles_group(builder.group)
    assert full.tokens == [1, 2, 3, 4, 5] and type(full.tokens[0]) is int
    assert full.loss_mask == [1, 0, 1] and full.rollout_log_probs == [-0.5, -0.25, 0.0]
    assert full.response_length == 3 and full.effective_response_length == 2
    (bare,) = miles_group(builder.group, tokens_too=False)
    assert (bare.tokens, bare.loss_mask, bare.rollout_log_probs) == ([], None, None)
    assert (bare.reward, bare.response_length, bare.status) == (1.0, 3, "completed")


def test_an_events_row_its_columns_cannot_hold_is_refused_naming_the_column():
    from ingest.processor.group_stage import _check_cells

    row = {"run_id": "r", "event_id": "e", "type": "reward", "group_index": 0, "rollout_id": 0,
           "topic": "t", "partition": 0, "offset": 5, "payload": b"{}", "step": None}
    _check_cells(row)
    with pytest.raises(ValueError, match="partition 2147483648 does not fit the int32 column"):
        _check_cells({**row, "partition": 2**31})
    with pytest.raises(ValueError, match="group_index 'x' does not fit the int64 column"):
        _check_cells({**row, "group_index": "x"})
    with pytest.raises(UnicodeEncodeError):
        _check_cells({**row, "event_id": "\ud800"})
