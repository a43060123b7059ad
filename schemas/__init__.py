"""The code form of CONTRACT.md: event models, control messages and Delta table schemas."""

from schemas.errors import RolloutlakeError
from schemas.events import EVENT_MODELS, RunConfig, decode_event, encode_event, parse_event
from schemas.tables import TABLES, content_sha256

__all__ = [
    "EVENT_MODELS",
    "TABLES",
    "RolloutlakeError",
    "RunConfig",
    "content_sha256",
    "decode_event",
    "encode_event",
    "parse_event",
]
