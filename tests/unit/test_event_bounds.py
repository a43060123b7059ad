"""CONTRACT section 2 "Bounds": the schema refuses what the tables cannot store, by name."""

from __future__ import annotations

import json
import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.bounds import MAX_OBJECT_BYTES, MAX_OBJECT_DEPTH
from schemas.errors import EventValidationError
from schemas.events import decode_event, encode_event, parse_event


def _event(kind: str, **fields):
    base = {"event_id": "e1", "type": kind, "schema_version": 1, "run_id": "r1"}
    if kind != "run_started":
        base.update(group_index=0)
    if kind in ("sample_finished", "compaction_fragment", "reward", "sample_aborted"):
        base.update(rollout_id=0)
    if kind in ("sample_finished", "compaction_fragment"):
        base.update(prompt_tokens=[1], response_tokens=[2])
    if kind == "sample_finished":
        base.update(status="completed", reward=1.0)
    if kind == "compaction_fragment":
        base.update(fragment_index=0)
    if kind == "group_started":
        base.update(step=0, n_samples=2)
    if kind == "reward":
        base.update(reward=1.0)
    if kind == "sample_aborted":
        base.update(reason="timeout")
    if kind == "run_started":
        base.update(config={"n_samples_per_prompt": 2, "rollout_batch_size": 1})
    base.update(fields)
    return base


def _nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


OUT_OF_BOUNDS = [
    ("token id >= 2^31", "sample_finished", {"response_tokens": [2**31]}, "response_tokens.0"),
    ("negative token id", "compaction_fragment", {"prompt_tokens": [-1]}, "prompt_tokens.0"),
    ("group_index >= 2^63", "reward", {"group_index": 2**63}, "group_index"),
    ("sample_index >= 2^63", "sample_finished", {"sample_index": 2**63}, "sample_index"),
    ("rollout_id >= 2^63", "sample_aborted", {"rollout_id": 2**64}, "rollout_id"),
    ("step >= 2^63", "group_started", {"step": 2**63}, "step"),
    ("n_samples beyond int32", "group_started", {"n_samples": 2**31}, "n_samples"),
    ("fragment_count beyond int32", "sample_finished", {"fragment_count": 2**31}, "fragment_count"),
    ("fragment_index beyond int32", "compaction_fragment", {"fragment_index": 2**31},
     "fragment_index"),
    ("negative weight_version", "sample_finished", {"weight_version": -1}, "weight_version"),
    ("NaN reward", "reward", {"reward": math.nan}, "reward"),
    ("infinite reward", "sample_finished", {"reward": math.inf}, "reward"),
    ("integer reward beyond 64 bits", "reward", {"reward": 2**64}, "reward"),
    ("NaN inside a reward object", "reward", {"reward": {"score": math.nan}}, "reward.score"),
    ("infinite log-prob", "sample_finished", {"rollout_log_probs": [-math.inf]},
     "rollout_log_probs.0"),
    ("log-prob beyond float32", "sample_finished", {"rollout_log_probs": [-1e39]},
     "rollout_log_probs.0"),
    ("NaN ts", "reward", {"ts": math.nan}, "ts"),
    ("ts past year 9999", "reward", {"ts": 1e300}, "ts"),
    ("metadata 33 levels deep", "sample_finished", {"metadata": _nested(MAX_OBJECT_DEPTH + 1)},
     "metadata" + ".a" * MAX_OBJECT_DEPTH),
    ("metadata 300 levels deep", "group_started", {"metadata": _nested(300)},
     "metadata" + ".a" * MAX_OBJECT_DEPTH),
    ("reward object 40 levels deep", "reward", {"reward": _nested(40)},
     "reward" + ".a" * MAX_OBJECT_DEPTH),
    ("big integer in metadata", "compaction_fragment", {"metadata": {"seed": [2**70]}},
     "metadata.seed.0"),
    ("NaN in metadata", "sample_finished", {"metadata": {"x": math.nan}}, "metadata.x"),
    ("metadata over the size limit", "group_started",
     {"metadata": {"blob": "x" * MAX_OBJECT_BYTES}}, "metadata"),
    ("label nested too deep", "group_started", {"label": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
     "label" + ".0" * MAX_OBJECT_DEPTH),
    ("chat prompt nested too deep", "group_started", {"prompt": [{"role": _nested(40)}]},
     "prompt.0.role" + ".a" * (MAX_OBJECT_DEPTH - 1)),
    ("lone surrogate in a string field", "sample_finished", {"response_text": "\ud800"},
     "response_text"),
    ("lone surrogate in a metadata key", "sample_finished", {"metadata": {"\udc00": 1}},
     "metadata"),
    ("unknown config key holding NaN", "run_started",
     {"config": {"n_samples_per_prompt": 2, "rollout_batch_size": 1, "extra": {"x": math.nan}}},
     "config.extra.x"),
    ("infinite group timeout", "run_started",
     {"config": {"n_samples_per_prompt": 2, "rollout_batch_size": 1,
                 "group_timeout_s": math.inf}}, "config.group_timeout_s"),
    ("run id '..'", "reward", {"run_id": ".."}, "run_id"),
    ("run id '.'", "group_started", {"run_id": "."}, "run_id"),
]


@pytest.mark.parametrize(("kind", "fields", "field"), [c[1:] for c in OUT_OF_BOUNDS],
                         ids=[c[0] for c in OUT_OF_BOUNDS])
def test_out_of_bounds_values_are_refused_naming_the_field(kind, fields, field):
    with pytest.raises(EventValidationError) as caught:
        parse_event(_event(kind, **fields))
    assert caught.value.field == field
    message = str(caught.value)
    assert "\n" not in message and f": {field}: " in message


@pytest.mark.parametrize(("kind", "fields"), [
    ("sample_finished", {"response_tokens": [2**31 - 1], "sample_index": 2**63 - 1,
                         "weight_version": 2**63 - 1, "rollout_log_probs": [-3.4e38]}),
    ("group_started", {"n_samples": 2**31 - 1, "metadata": _nested(MAX_OBJECT_DEPTH)}),
    ("reward", {"reward": {"score": 2**64 - 1}, "ts": 253_402_300_799.0}),
    ("reward", {"reward": -(2**63)}),
    ("reward", {"reward": True, "run_id": "...a"}),
])
def test_values_at_the_bounds_are_accepted(kind, fields):
    event = parse_event(_event(kind, **fields))
    assert event.type == kind


def test_nan_in_json_is_refused_on_the_fast_path():
    raw = orjson.dumps(_event("reward")).replace(b'"reward":1.0', b'"reward":NaN')
    with pytest.raises(EventValidationError):
        decode_event(raw)


def test_nesting_deeper_than_any_parser_limit_is_one_clear_error():
    deep = _nested(100_000)
    with pytest.raises(EventValidationError, match="nested deeper than 32 levels"):
        parse_event(_event("reward", reward=deep))
    raw = b'{"event_id":"e","type":"reward","schema_version":1,"run_id":"r","group_index":0,' \
          b'"rollout_id":0,"reward":' + b'{"a":' * 5000 + b'1' + b'}' * 5000 + b'}'
    with pytest.raises(EventValidationError):
        decode_event(raw)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                               max_size=3),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(reward=json_values, metadata=st.dictionaries(st.text(max_size=3), json_values, max_size=3),
       depth=st.integers(min_value=0, max_value=40))
def test_the_json_fast_path_and_the_archive_path_agree(reward, metadata, depth):
    """The processor decodes bytes on a fast path, while restart and replay re-parse the
    archived payload through orjson: both must accept and refuse the same events, or an
    accepted event would stop a restart."""
    body = _event("sample_finished", reward=reward, metadata={"m": metadata, "d": _nested(depth)})
    raw = json.dumps(body).encode()  # writes big integers, NaN and Infinity too
    try:
        fast = decode_event(raw)
    except EventValidationError:
        fast = None
    try:
        slow = parse_event(orjson.loads(raw))
    except (EventValidationError, orjson.JSONDecodeError):
        slow = None
    assert (fast is None) == (slow is None)
    if fast is not None:
        assert fast.model_dump_json() == slow.model_dump_json()


def test_an_event_that_cannot_be_written_as_json_is_a_validation_error():
    event = parse_event(_event("group_started", prompt_ref={"dataset": "d\ud800", "row": 0}))
    with pytest.raises(EventValidationError, match="group_started event 'e1': cannot be written"):
        encode_event(event)
