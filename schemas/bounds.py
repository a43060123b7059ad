"""What the tables can store (CONTRACT section 2 "Bounds"), and the check of free-form JSON.

Free-form values (metadata, labels, chat messages, reward objects) reach Delta as JSON
written by orjson, which refuses integers beyond 64 bits, strings with lone surrogates and
nesting beyond 255 levels. Parsers accept more than that (pydantic reads `NaN` and
1000-level nesting), so every such value is checked here before an event is accepted.
The walk uses an explicit stack: a hostile value cannot hit Python's recursion limit.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
# 9999-12-31T23:59:59Z: the last second a timestamp column (and Python datetime) holds.
TS_MAX = 253_402_300_799.0
# orjson writes integers from -2^63 to 2^64 - 1.
JSON_INT_MIN, JSON_INT_MAX = -(2**63), 2**64 - 1
MAX_OBJECT_DEPTH = 32
MAX_OBJECT_BYTES = 1024 * 1024  # encoded size of one metadata or reward object


class FieldValueError(ValueError):
    """A check failed; `field` is the field (or `a.b.3` position) to blame in the message."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _join(path: str, part: object) -> str:
    return f"{path}.{part}" if path else str(part)


def check_text(value: str, path: str = "") -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FieldValueError(path, "string is not valid UTF-8 (it holds a lone surrogate)") from None


def check_json_value(value: Any, *, path: str = "", max_depth: int = MAX_OBJECT_DEPTH,
                     max_bytes: int | None = None) -> None:
    """Raise `FieldValueError` unless `value` is JSON that the tables store unchanged.

    Objects and arrays nest at most `max_depth` levels (the value itself is level 1),
    numbers are finite and integers fit 64 bits, strings and keys are valid UTF-8, and the
    encoded size is at most `max_bytes` when given.
    """
    stack: list[tuple[Any, str, int]] = [(value, path, 1)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > max_depth:
                raise FieldValueError(where, f"nested deeper than {max_depth} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise FieldValueError(where, f"object key {key!r} is not a string")
                    check_text(key, where)
                    stack.append((child, _join(where, key), depth + 1))
            else:
                stack.extend((child, _join(where, i), depth + 1) for i, child in enumerate(item))
        elif isinstance(item, str):
            check_text(item, where)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not JSON_INT_MIN <= item <= JSON_INT_MAX:
                raise FieldValueError(where, "integer does not fit in 64 bits")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise FieldValueError(where, f"{item} is not a finite number")
        else:
            raise FieldValueError(where, f"{type(item).__name__} is not a JSON value")
    if max_bytes is not None:
        size = len(orjson.dumps(value))
        if size > max_bytes:
            raise FieldValueError(path, f"{size} bytes encoded, over the limit of {max_bytes}")


def check_run_id(value: str) -> str:
    """Refuse the run ids that are path steps: a run id names folders (Delta partitions)."""
    if value in (".", ".."):
        raise FieldValueError("", f"run id {value!r} is a path step, not a name")
    return value
