"""Per-token arrays of an event (CONTRACT section 2): JSON lists or the compact typed form.

`prompt_tokens`, `response_tokens`, `loss_mask` and `rollout_log_probs` are sent either as
JSON lists or as a compact array, an object of exactly two keys:

    {"dtype": "int32", "b64": "<base64 of the little-endian values>"}

with one dtype per field: `int32` for token ids, `int8` for `loss_mask`, `float32` for
`rollout_log_probs` (the types of the table columns). Both forms decode here to the same
numpy array, checked with vectorised numpy (token ids >= 0, mask 0/1, finite log-probs);
errors name the field and, for a bad value, its position (`response_tokens.3`), as the
list form's errors always did. Pure: no Kafka, no pydantic.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64

from schemas.bounds import FLOAT32_MAX, INT32_MAX, FieldValueError

COMPACT_KEYS = frozenset({"dtype", "b64"})


@dataclass(frozen=True)
class TokenArrayKind:
    """What one per-token field holds: its compact dtype and the range of its values."""

    dtype: str  # name in the compact form
    numpy: np.dtype  # little-endian numpy dtype of the compact bytes and of the decoded array
    description: str

    def json_schema(self) -> dict[str, Any]:
        items: dict[str, Any]
        if self is TOKEN_IDS:
            items = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
        elif self is LOSS_MASK:
            items = {"enum": [0, 1]}
        else:
            items = {"type": "number", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX}
        return {
            "description": self.description,
            "anyOf": [
                {"type": "array", "items": items},
                {
                    "type": "object",
                    "description": f"compact form: base64 of little-endian {self.dtype} values",
                    "properties": {
                        "dtype": {"const": self.dtype},
                        "b64": {"type": "string", "contentEncoding": "base64"},
                    },
                    "required": ["dtype", "b64"],
                    "additionalProperties": False,
                },
            ],
        }


TOKEN_IDS = TokenArrayKind("int32", np.dtype("<i4"), "token ids (int32 >= 0)")
LOSS_MASK = TokenArrayKind("int8", np.dtype("<i1"), "0/1 per response token")
LOG_PROBS = TokenArrayKind("float32", np.dtype("<f4"), "finite log-probability per response token")
# The per-token fields of `sample_finished` and `compaction_fragment` (`sample_aborted`
# has `response_tokens` too), and what each holds.
TOKEN_FIELDS: dict[str, TokenArrayKind] = {
    "prompt_tokens": TOKEN_IDS,
    "response_tokens": TOKEN_IDS,
    "loss_mask": LOSS_MASK,
    "rollout_log_probs": LOG_PROBS,
}


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _check_values(kind: TokenArrayKind, values: np.ndarray) -> None:
    """Raise FieldValueError at the first value out of the field's range.

    One reduction per bound on the way through (a few us on a 2k-token array; the element
    masks cost more): the position is looked for only once a bound is broken. A bound
    the array's dtype cannot break (an int32 above INT32_MAX, a finite float32 beyond
    FLOAT32_MAX) is not checked."""
    if not values.size:
        return
    if kind is TOKEN_IDS:
        if values.min() < 0:
            raise FieldValueError(str(_first(values < 0)),
                                  "Input should be greater than or equal to 0")
        if values.dtype != kind.numpy and values.max() > INT32_MAX:
            raise FieldValueError(str(_first(values > INT32_MAX)),
                                  f"Input should be less than or equal to {INT32_MAX}")
    elif kind is LOSS_MASK:
        if values.min() < 0 or values.max() > 1:
            raise FieldValueError(str(_first((values != 0) & (values != 1))),
                                  "Input should be 0 or 1")
    else:
        if not np.isfinite(values).all():
            raise FieldValueError(str(_first(~np.isfinite(values))),
                                  "Input should be a finite number")
        if values.dtype != kind.numpy and np.abs(values).max() > FLOAT32_MAX:
            raise FieldValueError(str(_first(np.abs(values) > FLOAT32_MAX)),
                                  f"Input should be within +-{FLOAT32_MAX} (float32)")


def _from_list(kind: TokenArrayKind, value: list[Any]) -> np.ndarray:
    types = set(map(type, value))
    if kind is LOG_PROBS:
        allowed: tuple[type, ...] = (float, int)
    elif kind is LOSS_MASK:
        allowed = (int, bool)
    else:
        allowed = (int,)
    if not types.issubset(allowed):
        index = next(i for i, v in enumerate(value) if type(v) not in allowed)
        expected = "a valid number" if kind is LOG_PROBS else "a valid integer"
        raise FieldValueError(str(index), f"Input should be {expected}")
    wide = np.float64 if kind is LOG_PROBS else np.int64
    try:
        values = np.array(value, dtype=wide)
    except OverflowError:  # an integer beyond 64 bits
        index = next(i for i, v in enumerate(value) if abs(v) >= 2**63)
        raise FieldValueError(str(index), "Input is out of range") from None
    if values.ndim != 1:  # pragma: no cover - element types are checked above
        raise FieldValueError("", "Input should be a flat list")
    _check_values(kind, values)
    return values.astype(kind.numpy)


def _from_compact(kind: TokenArrayKind, value: dict[str, Any]) -> np.ndarray:
    if value.keys() != COMPACT_KEYS:
        raise FieldValueError("", f"a compact array has exactly the keys 'dtype' and 'b64', "
                                  f"not {sorted(map(str, value))}")
    dtype, data = value["dtype"], value["b64"]
    if dtype != kind.dtype:
        raise FieldValueError("dtype", f"dtype {dtype!r} is not {kind.dtype!r}, the dtype of "
                                       "this field")
    if not isinstance(data, str):
        raise FieldValueError("b64", f"b64 must be a base64 string, not {type(data).__name__}")
    try:
        raw = pybase64.b64decode(data, validate=True)  # SIMD: ~9x the standard decoder
    except (binascii.Error, ValueError):
        # pybase64 refuses padding after a whole quantum ("AAAA="), which the standard
        # decoder takes: the standard decoder's verdict and message stay the contract.
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as err:
            raise FieldValueError("b64", f"b64 is not valid base64: {err}") from None
    size = kind.numpy.itemsize
    if len(raw) % size:
        raise FieldValueError("b64", f"{len(raw)} bytes is not a whole number of {kind.dtype} "
                                     f"values ({size} bytes each)")
    values = np.frombuffer(raw, dtype=kind.numpy)
    _check_values(kind, values)
    return values


def decode_token_array(kind: TokenArrayKind, value: Any) -> np.ndarray:
    """The field's values as a read-only 1-d array of `kind.numpy`, from either form.

    Raises FieldValueError; its `field` is the position or key to blame within the field.
    """
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise FieldValueError("", f"expected a 1-d array, got {value.ndim} dimensions")
        if value.dtype.kind not in "iuf" or (kind is not LOG_PROBS and value.dtype.kind == "f"):
            raise FieldValueError("", f"array dtype {value.dtype} does not hold {kind.dtype}")
        _check_values(kind, value)
        values = value.astype(kind.numpy)
    elif isinstance(value, list | tuple):
        values = _from_list(kind, list(value))
    elif isinstance(value, dict):
        values = _from_compact(kind, value)
    else:
        raise FieldValueError("", "Input should be a valid list or a compact array "
                                  f"{{\"dtype\": \"{kind.dtype}\", \"b64\": ...}}")
    values.flags.writeable = False  # shared by the event, the group and the Arrow rows
    return values


def encode_token_array(kind: TokenArrayKind, values: np.ndarray) -> dict[str, str]:
    """The compact form of `values` (already of the field's range)."""
    data = np.ascontiguousarray(values, dtype=kind.numpy).tobytes()
    return {"dtype": kind.dtype, "b64": pybase64.b64encode(data).decode("ascii")}
