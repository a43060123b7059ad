"""A decided group (and an opened one) as the group stage hands it to the batch stage.

The fragments travel as one Arrow table per group (columnar token lists, no per-token
Python on the batch side); the group-level facts travel as a small header that
controllers can read without touching the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from ingest.core.model import Group
from ingest.core.ordering import DECIDED, OPENED, OrderKey
from ingest.core.rewards import numeric_reward
from schemas.token_arrays import TOKEN_FIELDS

FRAGMENTS = pa.schema(
    [
        pa.field("rollout_id", pa.int64(), False),
        pa.field("sample_index", pa.int64()),
        pa.field("fragment_index", pa.int32(), False),
        pa.field("status", pa.string(), False),
        pa.field("abort_reason", pa.string()),
        pa.field("reward", pa.float64()),  # numeric value through the run's reward_key
        pa.field("reward_json", pa.string()),  # the reward as sent (int/float/dict/null)
        pa.field("weight_version", pa.int64()),
        pa.field("response_length", pa.int32(), False),
        pa.field("effective_length", pa.int32(), False),
        pa.field("metadata_json", pa.string()),
        pa.field("prompt_tokens", pa.list_(pa.int32()), False),
        pa.field("response_tokens", pa.list_(pa.int32()), False),
        pa.field("loss_mask", pa.list_(pa.int8()), False),
        pa.field("rollout_log_probs", pa.list_(pa.float32())),
    ]
)


@dataclass(slots=True)
class DecisionHeader:
    """Group-level facts of one decision (JSON in the Kafka header `decision`)."""

    run_id: str
    group_index: int
    step: int | None
    n_samples: int | None
    decision: str  # kept / dropped (surplus is decided later, by the batch stage)
    reason: str | None
    counted: bool
    decided_at: float
    first_event_at: float
    # Earliest `ts` of the group's aborts when every abort is a `cancelled` one
    # (`ingest.core.decide`: cancelled at seal).
    cancel_min_ts: float | None = None
    offered: bool = True  # reached the filter chain (False for a group_timeout)
    source: dict[str, int] = field(default_factory=dict)  # events partition/offset deciding it
    # Too large to travel inline: the batch stage re-assembles the fragments from the
    # `events` archive, which the group stage commits before it publishes the decision.
    fragments_in_archive: bool = False
    # Event time the decision is ordered by (`ingest.core.ordering`): the completing
    # event's, or first event + group_timeout_s for a timeout. The seal time of the step
    # it fills, too.
    at_us: int | None = None

    def to_json(self) -> bytes:
        return orjson.dumps(self)  # orjson's own dataclass encoder: 10x asdict's deep copy

    def order_key(self) -> OrderKey:
        """Where the batch stage applies it (`ingest.core.ordering`)."""
        return OrderKey(-1 if self.at_us is None else self.at_us,
                        self.source.get("partition", -1), self.source.get("offset", -1),
                        DECIDED, self.run_id, self.group_index)

    @property
    def ordered_at(self) -> float:
        """The event time it is ordered by, in seconds: the seal time of a step it fills."""
        return self.decided_at if self.at_us is None else self.at_us / 1e6

    @classmethod
    def from_json(cls, raw: bytes) -> DecisionHeader:
        return cls(**orjson.loads(raw))


@dataclass(slots=True)
class DecidedGroup:
    header: DecisionHeader
    fragments: pa.Table  # FRAGMENTS rows, in Miles order (rollouts, then fragment index)

    def order_key(self) -> OrderKey:
        return self.header.order_key()


@dataclass(frozen=True, slots=True)
class Opened:
    """A group's `group_started` was archived: one prompt issued for `step` (the `opened`
    notice on `rollout.decisions`)."""

    run_id: str
    group_index: int
    step: int
    at_us: int  # event time of the group_started
    partition: int
    offset: int

    def order_key(self) -> OrderKey:
        return OrderKey(self.at_us, self.partition, self.offset, OPENED, self.run_id,
                        self.group_index)


_NO_VALUES = np.zeros(0, np.int8)


def _json_or_none(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _list_column(values: list[Any], type_: pa.ListType) -> pa.ListArray:
    """One list column from per-row arrays (None for a null row), in one concatenation."""
    item = type_.value_type.to_pandas_dtype()
    arrays = [_NO_VALUES if v is None else np.asarray(v) for v in values]
    offsets = np.zeros(len(arrays) + 1, np.int32)
    # from an array: np.cumsum of a Python list with `out=` takes a slow generic path
    np.cumsum(np.fromiter(map(len, arrays), np.int32, len(arrays)), out=offsets[1:])
    flat = np.concatenate(arrays).astype(item, copy=False) if arrays else _NO_VALUES.astype(item)
    nulls = [v is None for v in values]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type_.value_type), type=type_,
                                    mask=pa.array(nulls, pa.bool_()) if any(nulls) else None)


def fragments_table(group: Group, reward_key: str | None, *, with_tokens: bool) -> pa.Table:
    """Flatten a group into FRAGMENTS rows; token columns stay empty when not needed.

    Token arrays go to Arrow as numpy buffers (one concatenation per column), never as
    Python objects per token.
    """
    cols: dict[str, list[Any]] = {name: [] for name in FRAGMENTS.names}

    def add(rollout, index, fragment) -> None:
        cols["rollout_id"].append(rollout.rollout_id)
        cols["sample_index"].append(rollout.sample_index)
        cols["fragment_index"].append(index)
        cols["status"].append(rollout.status or "missing")
        cols["abort_reason"].append(rollout.abort_reason)
        cols["reward"].append(
            None if rollout.aborted or not rollout.reward_known
            else numeric_reward(rollout.reward, reward_key)
        )
        cols["reward_json"].append(_json_or_none(rollout.reward) if rollout.reward_known else None)
        cols["weight_version"].append(rollout.weight_version)
        meta = dict(rollout.metadata)
        if fragment is None:
            length = effective = int(meta.get("partial_response_length", 0))
            prompt = response = mask = _NO_VALUES
            log_probs = None
        else:
            meta = {**fragment.metadata, **meta} if fragment.metadata else meta
            length, effective = fragment.response_length, fragment.effective_response_length
            if with_tokens:
                prompt, response = fragment.prompt_tokens, fragment.response_tokens
                mask = (np.ones(length, np.int8) if fragment.loss_mask is None
                        else fragment.loss_mask)
                log_probs = fragment.rollout_log_probs
            else:
                prompt = response = mask = _NO_VALUES
                log_probs = None
        cols["response_length"].append(length)
        cols["effective_length"].append(effective)
        cols["metadata_json"].append(_json_or_none(meta) if meta else None)
        cols["prompt_tokens"].append(prompt)
        cols["response_tokens"].append(response)
        cols["loss_mask"].append(mask)
        cols["rollout_log_probs"].append(log_probs)

    for rollout in group.ordered_rollouts():
        fragments = rollout.ordered_fragments()
        if not fragments:
            add(rollout, 0, None)
        for fragment in fragments:
            add(rollout, fragment.fragment_index, fragment)
    columns = {name: (_list_column(values, FRAGMENTS.field(name).type)
                      if name in TOKEN_FIELDS else values)
               for name, values in cols.items()}
    return pa.table(columns, schema=FRAGMENTS)
