"""What-if settings: `KEY=VALUE` overrides of a run's config, parsed and checked in one place.

`replay --config KEY=VALUE ...` re-derives a run under them; the keys are the settings that
change what a run trains on without changing its events:

| key | config field | value |
|---|---|---|
| `filter` | `dynamic_sampling_filter_path` | `none`, `dapo` (the built-in DAPO filter) or a user filter's dotted path |
| `rollout_batch_size`, `over_sampling_batch_size` | same | positive integer |
| `advantage_estimator` | same | `grpo`, `gspo`, `reinforce_plus_plus_baseline`, `none` |
| `std_normalization` | same | `true` / `false` |
| `reward_key` | same | a key of the samples' reward dict, or `none` |
| `max_staleness` | same | non-negative integer |
| `arg.NAME` | the extra key `NAME` a user filter reads (`args.NAME`) | a JSON value (`3`, `"x"`, `[1,2]`), else the text as a string |

Nothing is adjusted silently: overrides that contradict each other or the run's config
(`over_sampling_batch_size` below `rollout_batch_size`) fail with a line that names the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import orjson
from pydantic import ValidationError

from ingest.core.filters import load_filter
from schemas.errors import ConfigError
from schemas.events import DAPO_FILTER_PATH, RunConfig

EXTRA_PREFIX = "arg."
NONE_WORDS = ("none", "null", "off")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _boolean(text: str) -> bool:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in words:
        raise ValueError("must be true or false")
    return words[text.lower()]


def _filter_path(text: str) -> str | None:
    if text.lower() in NONE_WORDS:
        return None
    if text.lower() == "dapo":
        return DAPO_FILTER_PATH
    load_filter(text)  # FilterLoadError names the path and what is wrong with it
    return text


def _optional_text(text: str) -> str | None:
    return None if text.lower() in NONE_WORDS else text


def _one_of(field: str) -> Callable[[str], str]:
    choices = get_args(RunConfig.model_fields[field].annotation)

    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text
    return parse


# --config key -> (RunConfig field, value parser)
KEYS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "filter": ("dynamic_sampling_filter_path", _filter_path),
    "rollout_batch_size": ("rollout_batch_size", _positive),
    "over_sampling_batch_size": ("over_sampling_batch_size", _positive),
    "advantage_estimator": ("advantage_estimator", _one_of("advantage_estimator")),
    "std_normalization": ("std_normalization", _boolean),
    "reward_key": ("reward_key", _optional_text),
    "max_staleness": ("max_staleness", _non_negative),
}


@dataclass(frozen=True)
class WhatIf:
    """Overrides of a run's config, by config field (extra keys under their own name)."""

    overrides: dict[str, Any]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.overrides.items()) or "no change"

    def apply(self, config: RunConfig) -> RunConfig:
        """The run's config under the overrides; ConfigError names a contradiction."""
        body = {**config.model_dump(exclude_none=True), **self.overrides}
        body = {k: v for k, v in body.items() if v is not None}
        try:
            return RunConfig.model_validate(body)
        except ValidationError as err:
            first = err.errors()[0]
            raise ConfigError(f"--config {self.describe()}: {first['msg']}") from None


def parse_what_if(items: Sequence[str]) -> WhatIf:
    """`KEY=VALUE` items into a `WhatIf`; one-line ConfigError for an unknown key or a bad
    value. A key given twice is refused (which one was meant?)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--config {item!r}: expected KEY=VALUE")
        if key.startswith(EXTRA_PREFIX) and len(key) > len(EXTRA_PREFIX):
            field, value = key.removeprefix(EXTRA_PREFIX), _json_or_text(text)
            if field in RunConfig.model_fields:
                raise ConfigError(f"--config {item!r}: {field} is a config field; "
                                  f"pass {field}=VALUE if it is a what-if key")
        elif key in KEYS:
            field, parse = KEYS[key]
            try:
                value = parse(text.strip())
            except ValueError as err:
                reason = str(err) if "invalid literal" not in str(err) else "not an integer"
                raise ConfigError(f"--config {item!r}: {key} {reason}") from None
        else:
            raise ConfigError(f"--config {item!r}: unknown key {key!r} (keys: "
                              f"{', '.join(KEYS)}, {EXTRA_PREFIX}NAME for a user filter's "
                              "argument)")
        if field in overrides:
            raise ConfigError(f"--config {item!r}: {key} is given twice")
        overrides[field] = value
    return WhatIf(overrides)


def _json_or_text(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
