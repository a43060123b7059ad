"""Events with their per-token arrays in the compact typed form, written by hand (little-
endian, as another language's producer would), not by the SDK under test."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from schemas.token_arrays import TOKEN_FIELDS


def b64(values: Any, dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def compact(body: dict[str, Any], fields: Any = TOKEN_FIELDS) -> dict[str, Any]:
    """`body` with the given per-token fields in the compact form, the others as JSON lists."""
    out = dict(body)
    for name in fields:
        if out.get(name) is not None:
            kind = TOKEN_FIELDS[name]
            out[name] = {"dtype": kind.dtype, "b64": b64(out[name], kind.numpy.str)}
    return out
