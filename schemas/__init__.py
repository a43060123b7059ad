"""The code form of CONTRACT.md: event models, control messages and Delta table schemas.

The names below load on first use: `schemas.errors`, which every command imports at start,
must not pull in numpy, pyarrow and pydantic with the event models and table schemas.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "EVENT_MODELS": "schemas.events",
    "TABLES": "schemas.tables",
    "RolloutlakeError": "schemas.errors",
    "RunConfig": "schemas.events",
    "content_sha256": "schemas.tables",
    "decode_event": "schemas.events",
    "encode_event": "schemas.events",
    "parse_event": "schemas.events",
}
__all__ = ["EVENT_MODELS", "TABLES", "RolloutlakeError", "RunConfig", "content_sha256",
           "decode_event", "encode_event", "parse_event"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'schemas' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
