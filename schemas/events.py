"""Typed models of every event in CONTRACT section 2, and their one parsing entry point.

These models are the single source of truth for the wire format: the JSON Schema export,
the producer SDK, the gateway and the stream processor all validate through them.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

import numpy as np
import orjson
from annotated_types import GroupedMetadata
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StrictInt,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from schemas.bounds import (
    INT32_MAX,
    INT64_MAX,
    JSON_INT_MAX,
    JSON_INT_MIN,
    MAX_OBJECT_BYTES,
    TS_MAX,
    FieldValueError,
    check_json_value,
    check_run_id,
    check_text,
)
from schemas.errors import EventValidationError
from schemas.token_arrays import (
    LOG_PROBS,
    LOSS_MASK,
    TOKEN_IDS,
    TokenArrayKind,
    decode_token_array,
    encode_token_array,
)

SCHEMA_VERSION = 1

# CONTRACT section 2 "Bounds": every number is bounded to what the tables store, so an
# event the schema accepts can always be archived, decided and written.
RunId = Annotated[
    str,
    Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$"),
    AfterValidator(check_run_id),
]
_RUN_ID = TypeAdapter(RunId)


def run_id_argument(value: str) -> str:
    """argparse `type=` of every `--run` flag: a run id of the contract, or a one-line error."""
    try:
        return _RUN_ID.validate_python(value)
    except ValidationError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a run id (1-128 characters of A-Z a-z 0-9 . _ -, "
            "not '.' or '..')") from None


EventId = Annotated[str, Field(min_length=1, max_length=128)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
PositiveInt = Annotated[StrictInt, Field(ge=1, le=INT64_MAX)]
# Columns stored as int32: n_samples, fragment_count and fragment_index.
PositiveInt32 = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
NonNegativeInt32 = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
Timestamp = Annotated[float, Field(allow_inf_nan=False, ge=0, le=TS_MAX)]


@dataclass(frozen=True)
class _TokenArray(GroupedMetadata):
    """A per-token field: a JSON list or a compact array on the wire, a read-only numpy
    array in the model (schemas/token_arrays.py); written back in the compact form."""

    kind: TokenArrayKind
    optional: bool = False

    def __iter__(self) -> Iterator[Any]:
        kind, optional = self.kind, self.optional

        def validate(value: Any) -> np.ndarray | None:
            if value is None and optional:
                return None
            return decode_token_array(kind, value)

        schema = kind.json_schema()
        if optional:
            schema = {"anyOf": [*schema.pop("anyOf"), {"type": "null"}], **schema}
        yield PlainValidator(validate)
        yield PlainSerializer(
            lambda values: None if values is None else encode_token_array(kind, values),
            when_used="json",
        )
        yield WithJsonSchema(schema)


# Token ids are stored as int32, loss masks as int8, rollout_log_probs as float32.
TokenIds = Annotated[np.ndarray, _TokenArray(TOKEN_IDS)]
OptionalTokenIds = Annotated[np.ndarray | None, _TokenArray(TOKEN_IDS, optional=True)]
OptionalLossMask = Annotated[np.ndarray | None, _TokenArray(LOSS_MASK, optional=True)]
OptionalLogProbs = Annotated[np.ndarray | None, _TokenArray(LOG_PROBS, optional=True)]


def _bounded_object(max_bytes: int | None):
    def check(value: Any) -> Any:
        check_json_value(value, max_bytes=max_bytes)
        return value

    return AfterValidator(check)


# Free-form JSON (metadata, labels, chat messages, reward objects): nesting, numbers and
# size bounded, checked without recursion (see schemas/bounds.py).
JsonObject = Annotated[dict[str, Any], _bounded_object(MAX_OBJECT_BYTES)]
JsonValue = Annotated[Any, _bounded_object(None)]


def _reward(value: Any) -> Any:
    """A reward keeps its JSON type: int 0 and float 0.0 give different DAPO drop reasons."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not JSON_INT_MIN <= value <= JSON_INT_MAX:
            raise FieldValueError("", "integer reward does not fit in 64 bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise FieldValueError("", f"reward {value} is not a finite number")
        return value
    if isinstance(value, dict):
        check_json_value(value, max_bytes=MAX_OBJECT_BYTES)
        return value
    raise FieldValueError("", f"reward must be a number, a boolean, an object or null, "
                              f"not {type(value).__name__}")


# One validator instead of a union, so a bad reward gets one error that says what is wrong.
Reward = Annotated[
    Any,
    PlainValidator(_reward),
    WithJsonSchema({"anyOf": [
        {"type": "boolean"},
        {"type": "integer", "minimum": JSON_INT_MIN, "maximum": JSON_INT_MAX},
        {"type": "number"},
        {"type": "object", "additionalProperties": True},
        {"type": "null"},
    ]}),
]

DAPO_FILTER_PATH = "ingest.core.filters.reward_nonzero_std"
MILES_DAPO_FILTER_ALIASES = (
    "miles.rollout.filter_hub.common_filters.apply_reward_nonzero_std_filter",
    "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
)


def resolve_filter_path(path: str) -> str:
    """`path`, or the built-in DAPO filter's path for the Miles paths of that filter."""
    return DAPO_FILTER_PATH if path in MILES_DAPO_FILTER_ALIASES else path


class _Event(BaseModel):
    """Fields common to every event."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    event_id: EventId
    type: str
    schema_version: Literal[1] = Field(description="Contract version; always 1.")
    run_id: RunId
    ts: Timestamp | None = Field(default=None, description="Producer time, seconds since the epoch.")
    producer: str | None = Field(default=None, description="Worker or environment id.")

    @model_validator(mode="after")
    def _strings_storable(self) -> _Event:
        for name, value in self.__dict__.items():
            if isinstance(value, str):
                check_text(value, name)
        return self


class RunConfig(BaseModel):
    """The `config` object of `run_started`. Unknown keys are kept for user filters."""

    model_config = ConfigDict(extra="allow", frozen=True)

    n_samples_per_prompt: PositiveInt
    rollout_batch_size: PositiveInt = Field(description="Kept groups per step.")
    over_sampling_batch_size: PositiveInt | None = Field(
        default=None, description="Groups issued per refill; defaults to rollout_batch_size."
    )
    dynamic_sampling_filter_path: str | None = None
    reward_key: str | None = None
    advantage_estimator: Literal["grpo", "gspo", "reinforce_plus_plus_baseline", "none"] = "grpo"
    std_normalization: bool = True
    max_staleness: NonNegativeInt = 0
    group_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600.0
    partial_rollout: bool = False

    @model_validator(mode="after")
    def _extra_keys_storable(self) -> RunConfig:
        for key, value in (self.model_extra or {}).items():
            check_json_value(value, path=key)
        return self

    @model_validator(mode="after")
    def _over_sampling_at_least_batch(self) -> RunConfig:
        if self.over_sampling_batch_size is not None and (
            self.over_sampling_batch_size < self.rollout_batch_size
        ):
            raise FieldValueError(
                "over_sampling_batch_size",
                f"over_sampling_batch_size ({self.over_sampling_batch_size}) must be >= "
                f"rollout_batch_size ({self.rollout_batch_size})"
            )
        return self

    @property
    def effective_over_sampling_batch_size(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size

    @property
    def resolved_filter_path(self) -> str | None:
        """The filter path with the Miles aliases mapped to the built-in DAPO filter."""
        path = self.dynamic_sampling_filter_path
        return None if path is None else resolve_filter_path(path)

    @property
    def extra_args(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunStarted(_Event):
    type: Literal["run_started"] = "run_started"
    config: RunConfig
    dataset: str | None = Field(default=None, description="Dataset name prompts are served from.")


class PromptRef(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    dataset: str
    row: NonNegativeInt

    @model_validator(mode="after")
    def _extra_keys_storable(self) -> PromptRef:
        for key, value in (self.model_extra or {}).items():
            check_json_value(value, path=key)
        return self


class GroupStarted(_Event):
    type: Literal["group_started"] = "group_started"
    group_index: NonNegativeInt
    step: NonNegativeInt = Field(description="The step whose weights generate this group.")
    n_samples: PositiveInt32
    prompt: str | list[Annotated[dict[str, Any], _bounded_object(None)]] | None = None
    label: JsonValue = None
    prompt_ref: PromptRef | None = None
    metadata: JsonObject = Field(default_factory=dict)


class _FragmentFields(_Event):
    """Token payload shared by `sample_finished` and `compaction_fragment`."""

    group_index: NonNegativeInt
    rollout_id: NonNegativeInt
    prompt_tokens: TokenIds
    response_tokens: TokenIds
    loss_mask: OptionalLossMask = Field(
        default=None, description="0/1 per response token; absent means all ones."
    )
    rollout_log_probs: OptionalLogProbs = None
    metadata: JsonObject = Field(default_factory=dict)

    @model_validator(mode="after")
    def _per_token_lengths_match(self) -> _FragmentFields:
        n = len(self.response_tokens)
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise FieldValueError(
                "loss_mask",
                f"loss_mask has {len(self.loss_mask)} entries but response_tokens has {n}"
            )
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != n:
            raise FieldValueError(
                "rollout_log_probs",
                f"rollout_log_probs has {len(self.rollout_log_probs)} entries but "
                f"response_tokens has {n}"
            )
        return self


class SampleFinished(_FragmentFields):
    type: Literal["sample_finished"] = "sample_finished"
    sample_index: NonNegativeInt | None = Field(default=None, description="Miles `index`.")
    status: Literal["completed", "truncated"]
    reward: Reward = Field(
        default=None, description="Absent: the reward comes in a `reward` event; null: failed."
    )
    fragment_count: PositiveInt32 = 1
    fragment_index: NonNegativeInt32 | None = Field(
        default=None, description="Defaults to fragment_count - 1."
    )
    weight_version: NonNegativeInt | None = None
    response_text: str | None = None

    @model_validator(mode="after")
    def _fragment_index_in_range(self) -> SampleFinished:
        if self.fragment_index is not None and self.fragment_index >= self.fragment_count:
            raise FieldValueError(
                "fragment_index",
                f"fragment_index {self.fragment_index} is not below fragment_count "
                f"{self.fragment_count}"
            )
        return self

    @property
    def has_reward(self) -> bool:
        """True when the event itself carries the reward (a null reward included)."""
        return "reward" in self.model_fields_set

    @property
    def resolved_fragment_index(self) -> int:
        return self.fragment_count - 1 if self.fragment_index is None else self.fragment_index


class CompactionFragment(_FragmentFields):
    type: Literal["compaction_fragment"] = "compaction_fragment"
    fragment_index: NonNegativeInt32


class RewardEvent(_Event):
    type: Literal["reward"] = "reward"
    group_index: NonNegativeInt
    rollout_id: NonNegativeInt
    reward: Reward = Field(description="Required; null means scoring failed.")


class SampleAborted(_Event):
    type: Literal["sample_aborted"] = "sample_aborted"
    group_index: NonNegativeInt
    rollout_id: NonNegativeInt
    reason: Annotated[str, Field(min_length=1)]
    response_tokens: OptionalTokenIds = None
    recyclable: bool = False


TrajectoryEvent = GroupStarted | SampleFinished | CompactionFragment | RewardEvent | SampleAborted
AnyEvent = RunStarted | TrajectoryEvent

EVENT_MODELS: dict[str, type[AnyEvent]] = {
    "run_started": RunStarted,
    "group_started": GroupStarted,
    "sample_finished": SampleFinished,
    "compaction_fragment": CompactionFragment,
    "reward": RewardEvent,
    "sample_aborted": SampleAborted,
}
TRAJECTORY_EVENT_TYPES = frozenset(EVENT_MODELS) - {"run_started"}

_EVENT_ADAPTERS = {name: TypeAdapter(model) for name, model in EVENT_MODELS.items()}
# One discriminated union parsed straight from JSON bytes in Rust: the fast path for
# valid events (no intermediate Python dict of token lists).
_ANY_EVENT_JSON = TypeAdapter(Annotated[AnyEvent, Field(discriminator="type")])


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _most_specific(errors: list[Any]) -> Any:
    """Of a union's errors, the one that says most: a failed check over a type mismatch,
    then the deepest position (a list given for `prompt` is blamed for its content, not for
    not being a string)."""
    return min(enumerate(errors), key=lambda item: (
        item[1]["type"].endswith("_type") and len(errors) > 1, -len(item[1]["loc"]), item[0]
    ))[1]


def _describe(err: ValidationError, event_type: str, event_id: Any) -> EventValidationError:
    errors = err.errors(include_url=False)
    first = errors[0]
    if len(errors) > 1 and len({e["loc"][:1] for e in errors}) == 1:
        first = _most_specific(errors)  # several branches of one union field failed
    # Union branches appear in `loc` as their type tags (`list[...]`, `str`); drop them.
    loc = ".".join(str(p) for i, p in enumerate(first["loc"])
                   if not (i == 1 and len(errors) > 1 and isinstance(p, str)
                           and (p in _UNION_TAGS or "[" in p)))
    msg = first["msg"]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, FieldValueError):
        loc = ".".join(p for p in (loc, cause.field) if p)
        msg = str(cause)
    loc = loc or "(event)"
    label = f"{event_type} event" + (f" {event_id!r}" if isinstance(event_id, str) else "")
    if first["type"] == "missing":
        msg = "required field is missing"
    return EventValidationError(f"{label}: {loc}: {msg}", field=loc, event_type=event_type)


def parse_event(data: Any, *, allowed: frozenset[str] | None = None) -> AnyEvent:
    """Validate one decoded event (a dict). Raises `EventValidationError` naming the field."""
    if not isinstance(data, dict):
        raise EventValidationError(
            f"event must be a JSON object, got {type(data).__name__}", field="(event)"
        )
    event_type = data.get("type")
    if not isinstance(event_type, str) or event_type not in EVENT_MODELS:
        known = ", ".join(sorted(allowed or EVENT_MODELS))
        raise EventValidationError(
            f"event {data.get('event_id')!r}: type: {event_type!r} is not one of {known}",
            field="type",
        )
    if allowed is not None and event_type not in allowed:
        raise EventValidationError(
            f"{event_type} event {data.get('event_id')!r}: type: not accepted here "
            f"(expected one of {', '.join(sorted(allowed))})",
            field="type",
            event_type=event_type,
        )
    try:
        return _EVENT_ADAPTERS[event_type].validate_python(data)
    except ValidationError as err:
        raise _describe(err, event_type, data.get("event_id")) from None


def decode_event(raw: bytes, *, allowed: frozenset[str] | None = None) -> AnyEvent:
    """Decode UTF-8 JSON bytes and validate them as one event."""
    try:
        event = _ANY_EVENT_JSON.validate_json(raw)
    except ValidationError:
        pass  # parse again below, for an error message that names event and field
    else:
        if allowed is None or event.type in allowed:
            return event
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        not_json = EventValidationError(f"message is not valid UTF-8 JSON: {err}", field="(event)")
        try:
            lenient = load_json(raw)
        except orjson.JSONDecodeError:
            raise not_json from None
        # Still refused (the archive is re-read with orjson), but with the field to blame.
        parse_event(lenient, allowed=allowed)
        raise not_json from None
    return parse_event(data, allowed=allowed)


def parse_trajectory_event(data: Any) -> TrajectoryEvent:
    """`parse_event` for the events topic: `run_started` is refused like an unknown type."""
    # `allowed` refuses run_started, the one event outside TrajectoryEvent.
    return cast(TrajectoryEvent, parse_event(data, allowed=TRAJECTORY_EVENT_TYPES))


def decode_trajectory_event(raw: bytes) -> TrajectoryEvent:
    """`decode_event` for the events topic: `run_started` is refused like an unknown type."""
    # `allowed` refuses run_started, the one event outside TrajectoryEvent.
    return cast(TrajectoryEvent, decode_event(raw, allowed=TRAJECTORY_EVENT_TYPES))


def load_json(raw: bytes | str) -> Any:
    """Decode JSON with orjson; what only Python's lenient reader takes (`NaN`, `Infinity`,
    numbers beyond a double) is read with it, so validation can name the field to blame.
    Raises orjson.JSONDecodeError when neither reads it."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as strict_error:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise strict_error from None


def encode_event(event: AnyEvent) -> bytes:
    """The canonical wire form: UTF-8 JSON without fields left at an implicit default,
    per-token arrays in the compact form (schemas/token_arrays.py)."""
    body = event.model_dump(mode="json", exclude_unset=True)
    # `type` and `schema_version` may be left at their defaults but are required on the wire.
    body["type"] = event.type
    body["schema_version"] = SCHEMA_VERSION
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError as err:  # a nested string the field checks do not reach
        raise EventValidationError(
            f"{event.type} event {getattr(event, 'event_id', None)!r}: cannot be written as "
            f"JSON: {err}", field="(event)", event_type=event.type) from None


def event_group_key(run_id: str, group_index: int) -> bytes:
    """Kafka key of a trajectory event: every event of a group lands on one partition."""
    return f"{run_id}:{group_index}".encode()
