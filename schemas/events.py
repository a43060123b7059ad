"""Typed models of every event in CONTRACT section 2, and their one parsing entry point.

These models are the single source of truth for the wire format: the JSON Schema export,
the producer SDK, the gateway and the stream processor all validate through them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from schemas.errors import EventValidationError

SCHEMA_VERSION = 1

RunId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
EventId = Annotated[str, Field(min_length=1, max_length=128)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
TokenIds = list[StrictInt]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
LossMask = list[Literal[0, 1]]
# A reward keeps its JSON type: int 0 and float 0.0 give different DAPO drop reasons.
Reward = StrictBool | StrictInt | StrictFloat | dict[str, Any] | None

DAPO_FILTER_PATH = "ingest.filters.reward_nonzero_std"
MILES_DAPO_FILTER_ALIASES = (
    "miles.rollout.filter_hub.common_filters.apply_reward_nonzero_std_filter",
    "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
)


class FieldValueError(ValueError):
    """A cross-field check failed; `field` is the field to blame in the error message."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class _Event(BaseModel):
    """Fields common to every event."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    event_id: EventId
    type: str
    schema_version: Literal[1] = Field(description="Contract version; always 1.")
    run_id: RunId
    ts: float | None = Field(default=None, description="Producer time, seconds since the epoch.")
    producer: str | None = Field(default=None, description="Worker or environment id.")


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
    group_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    partial_rollout: bool = False

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
        return DAPO_FILTER_PATH if path in MILES_DAPO_FILTER_ALIASES else path

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


class GroupStarted(_Event):
    type: Literal["group_started"] = "group_started"
    group_index: NonNegativeInt
    step: NonNegativeInt = Field(description="The step whose weights generate this group.")
    n_samples: PositiveInt
    prompt: str | list[dict[str, Any]] | None = None
    label: Any = None
    prompt_ref: PromptRef | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class _FragmentFields(_Event):
    """Token payload shared by `sample_finished` and `compaction_fragment`."""

    group_index: NonNegativeInt
    rollout_id: NonNegativeInt
    prompt_tokens: TokenIds
    response_tokens: TokenIds
    loss_mask: LossMask | None = Field(
        default=None, description="0/1 per response token; absent means all ones."
    )
    rollout_log_probs: list[FiniteFloat] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

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
    fragment_count: PositiveInt = 1
    fragment_index: NonNegativeInt | None = Field(
        default=None, description="Defaults to fragment_count - 1."
    )
    weight_version: StrictInt | None = None
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
    fragment_index: NonNegativeInt


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
    response_tokens: TokenIds | None = None
    recyclable: bool = False


TrajectoryEvent = GroupStarted | SampleFinished | CompactionFragment | RewardEvent | SampleAborted
AnyEvent = RunStarted | TrajectoryEvent

EVENT_MODELS: dict[str, type[_Event]] = {
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


def _describe(err: ValidationError, event_type: str, event_id: Any) -> EventValidationError:
    first = err.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in first["loc"])
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
        raise EventValidationError(f"message is not valid UTF-8 JSON: {err}", field="(event)") from None
    return parse_event(data, allowed=allowed)


def encode_event(event: BaseModel) -> bytes:
    """The canonical wire form: UTF-8 JSON without fields left at an implicit default."""
    body = event.model_dump(mode="json", exclude_unset=True)
    # `type` and `schema_version` may be left at their defaults but are required on the wire.
    body["type"] = event.type
    body["schema_version"] = SCHEMA_VERSION
    return orjson.dumps(body)


def event_group_key(run_id: str, group_index: int) -> bytes:
    """Kafka key of a trajectory event: every event of a group lands on one partition."""
    return f"{run_id}:{group_index}".encode()
